"""``deepspeed.runtime.zero``'s paths: the estimators in stage3 and stage_1_and_2, offload_states' enums in
offload_config."""

from infinity.runtime.zero import offload_config, stage3, stage_1_and_2

__all__ = ["offload_config", "stage3", "stage_1_and_2"]
