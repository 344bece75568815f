"""``deepspeed.runtime.zero.stage3``'s estimators (infinity/estimators.py)."""

from infinity.estimators import (
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)

__all__ = ["estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live"]
