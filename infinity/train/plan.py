"""What the checks of `infinity train` decided (main.py makes it, before anything is built) and the run reads
(loop.py). Its own module, so that the run depends on the decisions, not on the command line that made them."""

from __future__ import annotations

import argparse
import dataclasses

from infinity.train import models


@dataclasses.dataclass(kw_only=True)
class Plan:
    """Everything checked, before the model is built."""

    args: argparse.Namespace
    shape: models.ModelShape
    config: dict  # the raw config with the command line's overrides applied
    world_size: int
    rank: int
    notes: list[str]  # what the command changed, said once at the start
    nvme_paths: list[str]
    vocab_size: int  # the model config's (token ids must stay below it)
    numel: int  # distinct parameters
