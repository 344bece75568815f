"""What rank 0 shows while `infinity train` runs: a tqdm bar on a terminal; on a pipe or a log file, one plain
line every tenth of the run (a redrawn bar would fill a log file with carriage returns). The engine's own log
lines (steps_per_print) go through the same writer so they never tear the bar."""

from __future__ import annotations

import dataclasses
import logging
import sys


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepFigures:
    step: int  # optimizer steps done, counting from 1
    loss: float  # mean over the step's micro-batches and ranks
    step_s: float
    tokens_per_s: float  # all ranks
    io_gbps: float  # this rank's NVMe reads + writes during the step


class Progress:
    def __init__(self, *, total_steps: int, first_step: int, enabled: bool, stream=None) -> None:
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._bar = None
        self._every = max(1, (total_steps - first_step) // 10)
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, unit="step", file=self.stream,
                             dynamic_ncols=True, leave=True)  # fmt: skip

    def update(self, figures: StepFigures) -> None:
        if not self.enabled:
            return
        text = (f"loss {figures.loss:.4f}, {figures.tokens_per_s:,.0f} tok/s, {figures.step_s:.2f} s/step, "
                f"I/O {figures.io_gbps:.2f} GB/s")  # fmt: skip
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(figures.step - self._bar.n)
        elif figures.step % self._every == 0 or figures.step == self.total_steps:
            print(f"step {figures.step}/{self.total_steps}: {text}", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ProgressLogHandler(logging.Handler):
    """The `infinity` logger's lines on rank 0, written between bar redraws."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.INFO)
        self.progress = progress
        self.setFormatter(logging.Formatter("[infinity] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.progress.write(self.format(record))
        except Exception:  # a logging failure must not stop training
            self.handleError(record)
