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


def _version() -> str:
    """The installed distribution's version (pyproject.toml is the one place it is written); a source tree
    that was never installed has no metadata, hence the fallback."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("infinity")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

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
