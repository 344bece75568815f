"""How Ctrl-C (SIGINT) and SIGTERM end a run: the handler records the signal and raises where the run is, and the
loop checks the record after every micro-step, because Python drops an exception raised inside a finalizer or a
destructor that happened to run when the signal arrived ("Exception ignored in ..."): without the check, such a
signal was lost and the run trained on (seen once in CI: still stepping a minute after the signal)."""

from __future__ import annotations

import signal

_requested: int | None = None


class Stop(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so it ends as Ctrl-C does (exit code 128 + the signal)."""

    signum = signal.SIGTERM


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Stop() if signum == signal.SIGTERM else KeyboardInterrupt()


def on_signal(signum: int, frame) -> None:
    global _requested
    _requested = signum
    raise _interrupt(signum)


def raise_if_requested() -> None:
    """Raises the interrupt of a signal that arrived, if its own raise went nowhere."""
    if _requested is not None:
        raise _interrupt(_requested)


def install() -> dict[int, object]:
    """Our handler for both signals (main thread only); what was there before, to restore after a clean end."""
    global _requested
    _requested = None
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[signum] = signal.signal(signum, on_signal)
        except ValueError:  # not the main thread: signals cannot be set here
            break
    return previous


def restore(previous: dict[int, object]) -> None:
    """Puts back what install() replaced, where ours is still there (a swap store may have chained on top)."""
    for signum, handler in previous.items():
        if signal.getsignal(signum) is on_signal:
            signal.signal(signum, handler)
