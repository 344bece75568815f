"""DeepSpeed's ``deepspeed.utils`` helpers for partitioned state, under its names, so a script that calls
``deepspeed.utils.safe_get_full_fp32_param(p)`` runs with ``import infinity as deepspeed``
([Note: partitioned state access] in partitioned_state.py).

The ``full`` getters are collective at ZeRO stages 1-3 with more than one rank (every rank calls them, for the
same parameter, and gets the whole value); the setters take the whole value on every rank and are not. The
``local`` forms read or write this rank's fragment of the parameter (1-D, possibly empty); a local set of a
parameter whose unit is gathered (below stage3_param_persistence_threshold) regathers it: collective. A
parameter the optimizer does not update gets None from a getter. Gradients exist between engine.backward() and
engine.step(); optimizer states once the parameter's param group has stepped."""

from __future__ import annotations

import torch
from torch import nn

from infinity.partitioned_state import StateAccessError, state_of

__all__ = [
    "StateAccessError",
    "safe_get_full_fp32_param",
    "safe_set_full_fp32_param",
    "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state",
    "safe_get_full_grad",
    "safe_set_full_grad",
    "safe_get_local_fp32_param",
    "safe_set_local_fp32_param",
    "safe_get_local_optimizer_state",
    "safe_set_local_optimizer_state",
    "safe_get_local_grad",
    "safe_set_local_grad",
]


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's whole fp32 master (its shape, on the engine's device)."""
    return state_of(param).get(param, None, local=False)


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Sets the parameter's fp32 master, and its compute-dtype weight, to ``value`` (whole, on every rank)."""
    state_of(param).set(param, value, None, local=False)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The parameter's whole optimizer state ``optim_state_key`` ("exp_avg", "exp_avg_sq", ...), fp32."""
    return state_of(param).get(param, optim_state_key, local=False)


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    state_of(param).set(param, value, optim_state_key, local=False)


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's reduced fp32 gradient (the window's, fp16's loss scale divided out), between backward
    and step."""
    return state_of(param).get_grad(param, local=False)


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    state_of(param).set_grad(param, value, local=False)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment of the parameter's fp32 master (1-D)."""
    return state_of(param).get(param, None, local=True)


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    state_of(param).set(param, value, None, local=True)


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    return state_of(param).get(param, optim_state_key, local=True)


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    state_of(param).set(param, value, optim_state_key, local=True)


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    return state_of(param).get_grad(param, local=True)


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    state_of(param).set_grad(param, value, local=True)


def __getattr__(name: str):
    """``infinity.utils.zero_to_fp32`` (DeepSpeed's ``deepspeed.utils.zero_to_fp32``) on first use."""
    if name == "zero_to_fp32":
        import importlib

        return importlib.import_module("infinity.utils.zero_to_fp32")
    raise AttributeError(f"module 'infinity.utils' has no attribute {name!r}")
