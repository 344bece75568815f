"""Which checkpoint --resume names, and the step it was saved at, read from its manifest before anything is
built: a --steps the checkpoint has already reached is refused in one line, not found out after the build."""

from __future__ import annotations

import os

from infinity.checkpoint.load import resolve_tag
from infinity.checkpoint.manifest import MANIFEST, Manifest
from infinity.errors import CheckpointError


def checkpoint_and_tag(resume: str) -> tuple[str, str | None]:
    """--resume names a checkpoint folder (its `latest` tag) or one tag folder in it (it holds a manifest)."""
    if os.path.isfile(os.path.join(resume, MANIFEST)):
        resume = os.path.abspath(resume)
        return os.path.dirname(resume), os.path.basename(resume)
    return resume, None


def saved_step(resume: str) -> int | None:
    """The optimizer step the checkpoint was saved at. None when its manifest cannot be read here: the load then
    says what is wrong, in its own words."""
    folder, tag = checkpoint_and_tag(resume)
    tag = resolve_tag(folder, tag)
    if tag is None:
        raise CheckpointError(f"--resume {resume!r}: no checkpoint there (no `latest` file); give the folder --save "
                              "wrote, or one of its tag folders")  # fmt: skip
    try:
        return Manifest.read(os.path.join(folder, tag)).global_steps
    except CheckpointError:
        return None
