"""The checkpoint's pickled files (the engine state, each rank's RNG), read without running code.

torch.load(weights_only=False) unpickles whatever a file names, so loading a checkpoint someone else wrote could
run anything. Every `.pt` of a checkpoint is therefore loaded with ``weights_only=True`` (tensors, numbers,
strings, and lists, tuples and dicts of them), and a save refuses, by name, a ``client_state`` entry that such a
load could not read back, before anything is written. A user who trusts a checkpoint holding other objects (one
written by an earlier release whose client_state held them) opts in with ``load_checkpoint(...,
weights_only=False)``.

RNG files of earlier releases hold numpy's state as an array: reading those allows numpy's array reconstruction
and nothing else (the globals torch's documentation lists for numpy arrays).
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import torch

from infinity.errors import CheckpointError

OPT_IN = "load_checkpoint(..., weights_only=False)"


def _numpy_array_globals() -> list:
    """What unpickling a numpy array names. A file names _reconstruct where the numpy that wrote it kept it
    (numpy.core in 1.x, numpy._core in 2.x): both names are allowed, for the function this numpy has."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    found: list = [np.ndarray, np.dtype]
    found += [(reconstruct, f"{module}.multiarray._reconstruct") for module in ("numpy.core", "numpy._core")]
    found += [getattr(np.dtypes, name) for name in ("UInt32DType", "Int64DType") if hasattr(np, "dtypes")]
    return found


def _load_allowing_numpy_arrays(path: str) -> object:
    """torch.load(weights_only=True) with numpy's array globals allowed (torch 2.5+: for this call only)."""
    allowed = _numpy_array_globals()
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is None:  # torch 2.4: only the process-wide allowlist, and without (function, name) pairs
        torch.serialization.add_safe_globals([g[0] if isinstance(g, tuple) else g for g in allowed])
        return torch.load(path, weights_only=True)
    with scoped(allowed):
        return torch.load(path, weights_only=True)


def _reason(error: Exception) -> str:
    """torch's one line that says what was refused (its message is a page of advice around it)."""
    advice = ("Weights only load failed", "(1)", "(2)", "Check the documentation")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if not line.startswith(advice):
            return line.removeprefix("WeightsUnpickler error:").strip().split(". Please use")[0]
    return lines[0] if lines else type(error).__name__


def load(path: str, *, weights_only: bool = True, numpy_arrays: bool = False) -> object:
    """A checkpoint's `.pt` file, loaded without running code unless the user opted in. ``numpy_arrays``: an
    earlier release's RNG file (numpy's state as an array). FileNotFoundError as it is; a refused or damaged file
    is a CheckpointError naming it."""
    try:
        if not weights_only:
            return torch.load(path, weights_only=False)
        try:
            return torch.load(path, weights_only=True)
        except pickle.UnpicklingError:
            if not numpy_arrays:
                raise
        return _load_allowing_numpy_arrays(path)  # an earlier release's RNG file: numpy's arrays, nothing else
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds objects that loading would have to run code to build ({_reason(e)}); checkpoints are "
            f"loaded with torch.load(weights_only=True), so nothing in a file can run. If you trust whoever wrote "
            f"it, load it with {OPT_IN}"
        ) from None
    except Exception as e:  # noqa: BLE001 - any other unpickling failure means a damaged file
        raise CheckpointError(f"{path} cannot be read: {e}") from None


def refusal(value: object) -> str | None:
    """Why a weights-only load could not read ``value`` back, or None when it could (a round trip in memory)."""
    buffer = io.BytesIO()
    try:
        torch.save(_on_meta(value), buffer)  # tensors by shape only: the check copies no data
    except Exception as e:  # noqa: BLE001 - not even picklable: say what torch said
        return f"it cannot be saved: {e}"
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True, map_location="meta")
    except pickle.UnpicklingError as e:
        return _reason(e)
    return None


def _on_meta(value: object) -> object:
    """``value`` with its tensors (in dicts, lists and tuples) replaced by meta tensors of the same kind."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta")
    if type(value) is dict:
        return {key: _on_meta(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_on_meta(item) for item in value)
    return value  # anything else is checked as it is


def check_client_state(client_state: dict) -> None:
    """Refuses, naming the key, a client_state entry that a weights-only load could not read back."""
    if not isinstance(client_state, dict):
        raise CheckpointError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    for key, value in client_state.items():
        why = refusal(value)
        if why is not None:
            raise CheckpointError(
                f"save_checkpoint: client_state[{key!r}] holds an object that loading would have to run code to "
                f"build ({why}); checkpoints are loaded without running code: keep client_state to tensors, "
                "numbers, strings, None, and lists, tuples and dicts of them (e.g. save an object's state_dict())"
            )
