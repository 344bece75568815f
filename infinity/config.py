"""The DeepSpeed-style JSON config, parsed once into typed, validated objects.

Each section is checked key by key: an unknown key is an error naming the closest valid one, a value of
the wrong type or range names the key, the value and the rule, and DeepSpeed's legacy names are accepted
with one deprecation warning each. Components receive only their own section's object.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from infinity.aio.handle import AioSettings
from infinity.errors import ConfigError

# ---- key-level helpers (shared by every section) ----


def check_keys(section: str, raw: Mapping[str, Any], known: set[str]) -> None:
    """Unknown keys are errors, with the closest valid key as a hint."""
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f": did you mean {close[0]}?" if close else f"; valid keys: {', '.join(sorted(known))}"
            raise ConfigError(f"unknown key {section}.{key}{hint}")


def as_int(key: str, value: Any, *, minimum: int | None = None) -> int:
    """Integers, also when written as 5e8 (JSON floats with no fractional part)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{key} must be a whole number, got {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")
    return value


def as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def warn_legacy(old: str, new: str) -> None:
    warnings.warn(f"config key {old} is deprecated; use {new}", DeprecationWarning, stacklevel=4)


def load_json(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A dict, or the path of a JSON file."""
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


# ---- the aio section ----

_AIO_KEYS = {
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "single_submit",
    "overlap_events",
    "use_direct_io",
    "use_gds",
    "thread_count",
}


def parse_aio(raw: Mapping[str, Any] | None) -> AioSettings:
    """The ``aio`` section (DeepSpeed names and defaults) -> AioSettings."""
    raw = dict(raw or {})
    if not isinstance(raw, dict):
        raise ConfigError(f"aio must be an object, got {raw!r}")
    check_keys("aio", raw, _AIO_KEYS)
    if "thread_count" in raw:
        warn_legacy("aio.thread_count", "aio.intra_op_parallelism")
        if "intra_op_parallelism" in raw and raw["intra_op_parallelism"] != raw["thread_count"]:
            raise ConfigError(
                "aio.thread_count and aio.intra_op_parallelism are the same setting and disagree "
                f"({raw['thread_count']} vs {raw['intra_op_parallelism']}); keep only intra_op_parallelism"
            )
        raw["intra_op_parallelism"] = raw.pop("thread_count")
    if raw.pop("use_gds", False):
        raise ConfigError("aio.use_gds (GPUDirect Storage) is not implemented by infinity; remove it or set false")
    kwargs: dict[str, Any] = {}
    for key in ("block_size", "queue_depth", "intra_op_parallelism"):
        if key in raw:
            kwargs[key] = as_int(f"aio.{key}", raw[key])
    for key in ("single_submit", "overlap_events", "use_direct_io"):
        if key in raw:
            kwargs[key] = as_bool(f"aio.{key}", raw[key])
    return AioSettings(**kwargs)
