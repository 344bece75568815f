"""DeepSpeed's ``register_external_parameter`` / ``unregister_external_parameter``: a module's forward that uses
another module's parameter. Stage 3 here notices such a use by itself the first time it happens (the unit is
fetched on demand and fetched with the module from then on: [Note: units] in units.py); declaring it makes the
first pass fetch it with the module's own units too. Declared before initialize() (in a module's __init__ under
zero.Init, as DeepSpeed's documentation shows), it is kept until the engine is built; outside stage 3 there is
nothing to fetch."""

from __future__ import annotations

import weakref

from torch import nn

from infinity.zero.units import stage3_runtime

# Declared before an engine existed: module -> the external parameters it uses (weakly: the model owns both).
_DECLARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    else:
        declared = _DECLARED.setdefault(module, [])
        if not any(p is parameter for p in declared):
            declared.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undoes register_external_parameter: ``module`` no longer fetches ``parameter``'s unit with its own."""
    _check(module, parameter, "unregister_external_parameter")
    if module in _DECLARED:
        _DECLARED[module] = [p for p in _DECLARED[module] if p is not parameter]
    runtime = stage3_runtime(parameter)
    if runtime is not None:
        runtime.external_use(module, parameter, used=False)


def declared_external(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """(module, parameter) pairs declared for ``model``'s modules before its engine existed."""
    return [(module, param) for module in model.modules() for param in _DECLARED.get(module, ())]
