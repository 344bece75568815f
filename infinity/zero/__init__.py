"""ZeRO: partitioned optimizer states, gradients (stages 1-2) and parameters (stage 3)."""

from infinity.zero.init import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
