"""infinity: ZeRO-Infinity memory tiers (device, host, NVMe) for PyTorch training.

The public names load on first use (PEP 562): `import infinity` alone does not load the compiled I/O core or
torch, so `infinity report` and `infinity --version` still run where the core failed to build, and say so."""

import importlib

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

_LAZY = {
    "AioHandle": "infinity.aio",
    "AioRequest": "infinity.aio",
    "AioSettings": "infinity.aio",
    "Config": "infinity.config",
    "parse_config": "infinity.config",
    "Engine": "infinity.engine",
    "InferenceEngine": "infinity.inference",
    "initialize": "infinity.entry",
    "init_distributed": "infinity.script_api",
    "add_config_arguments": "infinity.script_api",
    "estimate_memory": "infinity.estimators",
    "estimate_zero2_model_states_mem_needs_all_cold": "infinity.estimators",
    "estimate_zero2_model_states_mem_needs_all_live": "infinity.estimators",
    "estimate_zero3_model_states_mem_needs_all_cold": "infinity.estimators",
    "estimate_zero3_model_states_mem_needs_all_live": "infinity.estimators",
}


def __getattr__(name: str):
    """A public name's module, imported on first use; any subpackage (`infinity.zero`, `infinity.aio`) too."""
    if name.startswith("__"):  # hasattr(infinity, "__main__") and the like must not import (or run) anything
        raise AttributeError(f"module 'infinity' has no attribute {name!r}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        try:
            value = importlib.import_module(f"infinity.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"infinity.{name}":
                raise  # the submodule exists but something it imports is missing: say that
            raise AttributeError(f"module 'infinity' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "estimate_memory",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "InferenceEngine",
    "InfinityError",
    "InvalidTensorError",
    "ShortTransferError",
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "parse_config",
    "TierBudgetError",
    "zero",
]
