"""The exception hierarchy. Every error a user can cause names the key, path or value and the fix."""

from __future__ import annotations

import errno as errno_module
import os


class InfinityError(Exception):
    """Base of every error raised by infinity."""


class ConfigError(InfinityError, ValueError):
    """A config key or constructor argument has a bad value. The message names it and the rule."""


class InvalidTensorError(InfinityError, ValueError):
    """A tensor handed to the I/O engine cannot be used as it is (e.g. not contiguous)."""


class TierBudgetError(InfinityError, MemoryError):
    """A memory tier (device, host, NVMe) cannot hold what was asked of it within its budget."""


class CheckpointError(InfinityError):
    """A checkpoint is missing, incomplete, or does not match the model."""


class AioError(InfinityError):
    """An I/O request failed. Carries the path, the file offset, the errno (None for a short transfer)."""

    def __init__(self, *, op: str, path: str, offset: int, errno: int | None, detail: str = "") -> None:
        self.op = op
        self.path = path
        self.offset = offset
        self.errno = errno
        self.detail = detail
        reason = f"{errno_module.errorcode.get(errno, errno)} ({os.strerror(errno)})" if errno else ""
        parts = [f"{op} of {path!r} at offset {offset} failed"]
        if reason:
            parts.append(reason)
        if detail:
            parts.append(detail)
        super().__init__(": ".join(parts))


class ShortTransferError(AioError):
    """Fewer bytes moved than asked: end of file on a read, a full disk on a write."""


class AioTimeoutError(AioError):
    """No request completed within the handle's timeout (errno ETIMEDOUT): the disk may be stalled.

    The requests still in flight keep their buffers and AIO context for the life of the process, and
    the handle that raised this refuses further requests (see AioHandle)."""


class CollectiveError(InfinityError):
    """A collective failed or timed out: a peer rank exited, hung, or is running something else."""

    def __init__(self, *, op: str, group: str, timeout_s: float | None, cause: str) -> None:
        self.op = op
        self.group = group
        self.timeout_s = timeout_s
        waited = f", or did not answer within {timeout_s:g} s" if timeout_s else ""
        super().__init__(
            f"{op} on the {group} group failed: {cause.strip()[:500]}. Most often a peer rank has exited or "
            f"stopped{waited}; look at the other ranks' output. The timeout is the config key collective_timeout "
            "or the environment variable INFINITY_COLLECTIVE_TIMEOUT_S"
        )


class CollectiveUsageError(InfinityError):
    """A collective API was called on some ranks only: every rank must call it, in the same order."""


class StatesOffloadedError(InfinityError):
    """The engine's states were used while engine.offload_states() had them away."""
