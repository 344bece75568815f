"""``deepspeed.runtime.zero.stage3``'s estimators (infinity/estimators.py) and unwrap_model_for_generation
(infinity/zero/init.py)."""

from infinity.estimators import (
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from infinity.zero.init import unwrap_model_for_generation

__all__ = ["estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
           "unwrap_model_for_generation"]
