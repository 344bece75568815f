"""ZeRO: partitioned optimizer states, gradients (stages 1-2) and parameters (stage 3)."""

from infinity.zero.external import register_external_parameter, unregister_external_parameter
from infinity.zero.init import GatheredParameters, Init, unwrap_model_for_generation

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter",
           "unwrap_model_for_generation"]
