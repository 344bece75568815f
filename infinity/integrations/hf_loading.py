"""Placeholder (replaced at merge): the config that from_pretrained reads to partition at load time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class HfInfinityConfig:
    """Kept alive by InfinityTrainingArguments, as TrainingArguments keeps its hf_deepspeed_config."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def is_zero3_active(self) -> bool:
        return (self.config.get("zero_optimization") or {}).get("stage") == 3
