"""ZeRO: partitioning of optimizer states (stage 1), gradients (stage 2) and parameters (stage 3)."""
