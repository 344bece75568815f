"""The figure a run reports per step: each field's median over the steps after the first, which also pays for what
the run keeps (faulting in its buffers, opening its files, recording the fetch trace)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import TypeVar

Row = TypeVar("Row")


def steady_medians(rows: list[Row]) -> Row | None:
    """A row of the same dataclass holding each field's median over ``rows[1:]`` (``rows`` where only one ran);
    None where none ran. Each field's median may come from another step."""
    if not rows:
        return None
    steady = rows[1:] or rows
    kind = type(rows[0])
    return kind(**{f.name: statistics.median(getattr(row, f.name) for row in steady) for f in dataclasses.fields(kind)})
