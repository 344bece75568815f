"""DeepSpeed's ``register_external_parameter`` / ``unregister_external_parameter``: a module's forward that uses
another module's parameter. Stage 3 here notices such a use by itself the first time it happens (the unit is
fetched on demand and fetched with the module from then on: [Note: units] in units.py); declaring it makes the
first pass fetch it with the module's own units too. Outside stage 3, or before initialize(), there is nothing to
fetch and the calls only check their arguments."""

from __future__ import annotations

from torch import nn

from infinity.zero.units import stage3_runtime


def _check(module, parameter, what: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"{what}: parameter must be a torch.nn.Parameter, got {type(parameter).__name__}")


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declares that ``module``'s forward uses ``parameter``, which another module owns."""
    _check(module, parameter, "register_external_parameter")
    runtime = stage3_runtime(parameter)
    if runtime is not None:
        runtime.external_use(module, parameter, used=True)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undoes register_external_parameter: ``module`` no longer fetches ``parameter``'s unit with its own."""
    _check(module, parameter, "unregister_external_parameter")
    runtime = stage3_runtime(parameter)
    if runtime is not None:
        runtime.external_use(module, parameter, used=False)
