"""The checkpoint's manifest: what a tag holds, written last, read first.

A tag folder is complete exactly when it has ``manifest.json`` and is not named ``*.tmp`` ([Note: crash-safe
save] in save.py). The manifest lists every array with its shape and dtype (the loader checks each array's Zarr
metadata against it), the param groups (names, hyperparameters, steps), the run's counters and the config.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch

from infinity.checkpoint.zarr_store import read_json
from infinity.errors import CheckpointError

FORMAT = "infinity-zarr"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"


@dataclass(slots=True)
class GroupEntry:
    """One optimizer param group: its parameters (by name, in order), hyperparameters and steps taken."""

    params: list[str]
    hyperparameters: dict
    step: int
    scalars: dict = field(default_factory=dict)  # other scalar state entries (NAdam's mu_product), as JSON


@dataclass(slots=True)
class Manifest:
    world_size: int
    stage: int
    compute_dtype: str
    offload_optimizer: str
    offload_param: str
    global_steps: int
    micro_steps: int
    skipped_steps: int
    arrays: dict[str, dict]  # key -> {"shape": [...], "dtype": "float32", "torch_dtype": "bfloat16"}
    aliases: dict[str, list[str]]  # a tied parameter's saved name -> its other names
    groups: list[GroupEntry]
    state_names: list[str]  # per-element optimizer states saved (exp_avg, ...)
    scalar_keys: list[str]  # the optimizer's non-elementwise state entries ("step")
    config: dict
    library_version: str
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, folder: str) -> Manifest:
        path = os.path.join(folder, MANIFEST)
        raw = read_json(path, "the checkpoint's manifest")
        try:
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            if raw.get("format_version", 0) > FORMAT_VERSION:
                raise ValueError(f"format version {raw['format_version']} is newer than this library reads "
                                 f"({FORMAT_VERSION}); upgrade infinity")  # fmt: skip
            raw["groups"] = [GroupEntry(**g) for g in raw["groups"]]
            found = cls(**raw)
            for key, entry in found.arrays.items():
                if not isinstance(entry.get("shape"), list) or not isinstance(entry.get("dtype"), str):
                    raise ValueError(f"array {key!r} has no shape or dtype")
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{path} is not a valid manifest: {e}") from None
        return found

    def write(self, folder: str) -> None:
        path = os.path.join(folder, MANIFEST)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    def saved_name(self, name: str, known: set[str]) -> str | None:
        """The name a parameter was saved under: itself, or the first owner of a tied weight it aliases."""
        if name in known:
            return name
        for owner, others in self.aliases.items():
            if name in others:
                return owner
        return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def json_safe(value):
    """Hyperparameters as JSON (tuples become lists, tensors numbers); what JSON cannot hold is dropped."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    return None
