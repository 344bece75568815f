"""The `infinity` logger's default handler: a user who configured no logging still sees the engine's
steps_per_print lines and its warnings, on rank 0 only (every rank repeating them would say nothing new), as
transformers and DeepSpeed do with their own loggers. Whoever configures logging (a handler on the root logger
or on `infinity`) keeps full control: then nothing is added."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "infinity"


class _DefaultHandler(logging.StreamHandler):
    """The handler this module adds (once). It steps aside as soon as the user configures the root logger, even
    after the engine started: their handlers then get the records (they propagate), and this one says nothing."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def install_default_handler(rank: int) -> None:
    infinity_logger = logging.getLogger(LOGGER_NAME)
    if any(isinstance(h, _DefaultHandler) for h in infinity_logger.handlers):
        return
    if infinity_logger.handlers or logging.getLogger().handlers:
        return  # configured by the user (or by `infinity train`): theirs to decide
    handler = _DefaultHandler(sys.stderr)
    prefix = "[infinity]" if rank == 0 else f"[infinity rank {rank}]"
    handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    infinity_logger.addHandler(handler)
    if infinity_logger.level == logging.NOTSET:  # other ranks' info lines stay out of handlers added later too
        infinity_logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
