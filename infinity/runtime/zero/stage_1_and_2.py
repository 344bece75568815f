"""``deepspeed.runtime.zero.stage_1_and_2``'s estimators (infinity/estimators.py)."""

from infinity.estimators import (
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = ["estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero2_model_states_mem_needs_all_live"]
