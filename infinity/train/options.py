"""The command-line options `infinity train` and `infinity estimate` share, applied to a DeepSpeed config dict:
--dtype, --micro-batch, and what to say of "auto" values neither can fill. Its own module so the two commands
read the same rules without importing each other."""

from __future__ import annotations

import contextlib

from infinity.config import AutoError

PROG = "infinity train"

SECTIONS = ("zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "aio")


def bf16_units() -> bool:
    """Whether this CPU computes bf16 natively; without, its bf16 matmuls are several times slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", " bf16"))


def apply_dtype(config: dict, dtype: str, notes: list[str]) -> None:
    def enabled(section: str) -> bool:
        return bool(isinstance(config.get(section), dict) and config[section].get("enabled") is True)

    if dtype == "auto":
        import torch

        if enabled("bf16") and not torch.cuda.is_available() and not bf16_units():
            dtype = "fp32"
            notes.append(
                "bf16 -> fp32: this CPU has no bf16 units (its bf16 matmuls are slower); --dtype bf16 keeps it"
            )
        else:
            return
    for section in ("fp16", "bf16"):
        config[section] = {**(config.get(section) or {}), "enabled": section == dtype}


def apply_micro_batch(config: dict, micro_batch: int | None) -> None:
    """--micro-batch keeps the config's global batch when it has one (the accumulation follows), as a
    DeepSpeed user expects; without one the accumulation stays as configured."""
    if micro_batch is None:
        return
    config["train_micro_batch_size_per_gpu"] = micro_batch
    if config.get("train_batch_size") not in (None, "auto") and "gradient_accumulation_steps" in config:
        del config["gradient_accumulation_steps"]  # train_batch_size / (micro x world size), checked by the parse


# "auto" keys a command-line option sets; the others are set in the config.
AUTO_OPTIONS = {
    "fp16.enabled": "--dtype (fp32, bf16 or fp16)",
    "bf16.enabled": "--dtype (fp32, bf16 or fp16)",
    "train_micro_batch_size_per_gpu": "--micro-batch N",
}


def unfilled_auto(error: AutoError, prog: str = PROG) -> str:
    """The config's unfilled "auto" values, all at once, as what to pass or set to ``prog`` (a command shares
    `infinity train`'s --dtype and --micro-batch; initialize() is not the caller's to call here)."""
    by_option: dict[str, list[str]] = {}
    in_config = []
    for item in error.unfilled:
        if item.key in AUTO_OPTIONS:
            by_option.setdefault(AUTO_OPTIONS[item.key], []).append(item.key)
        else:
            in_config.append(item.key + (f" ({item.note})" if item.note else ""))
    parts = [f"pass {option} for {' and '.join(keys)}" for option, keys in by_option.items()]
    if in_config:
        parts.append(f"set {', '.join(in_config)} in the config")
    return f'"auto" values {prog} cannot fill: ' + "; ".join(parts)


def quiet_transformers() -> None:
    """transformers' warnings about configs built here (unused keys, defaults) say nothing a user can act on."""
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
