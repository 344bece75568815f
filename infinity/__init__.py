"""infinity: ZeRO-Infinity memory tiers (device, host, NVMe) for PyTorch training."""

from infinity.aio import AioHandle, AioRequest, AioSettings
from infinity.config import Config, parse_config
from infinity.engine import Engine, initialize
from infinity.errors import (
    AioError,
    AioTimeoutError,
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
    "AioRequest",
    "AioTimeoutError",
    "AioSettings",
    "CheckpointError",
    "Config",
    "Engine",
    "ConfigError",
    "InfinityError",
    "InvalidTensorError",
    "ShortTransferError",
    "initialize",
    "parse_config",
    "TierBudgetError",
]
