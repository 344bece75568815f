"""infinity: ZeRO-Infinity memory tiers (device, host, NVMe) for PyTorch training."""

from infinity.aio import AioHandle, AioSettings
from infinity.errors import (
    AioError,
    CheckpointError,
    ConfigError,
    InfinityError,
    InvalidTensorError,
    ShortTransferError,
    TierBudgetError,
)

__version__ = "0.1.0"

__all__ = [
    "AioError",
    "AioHandle",
    "AioSettings",
    "CheckpointError",
    "ConfigError",
    "InfinityError",
    "InvalidTensorError",
    "ShortTransferError",
    "TierBudgetError",
]
