"""``deepspeed.runtime.zero``'s paths: the estimators in stage3 and stage_1_and_2."""

from infinity.runtime.zero import stage3, stage_1_and_2

__all__ = ["stage3", "stage_1_and_2"]
