"""Split masters: an offloaded fp32 master kept as the bf16 weight the model computes with plus 16 low bits.

[Note: split masters]
With bf16 compute, the rank's bf16 weights already hold the top 16 bits of each fp32 master, rounded. With
``"infinity": {"offloaded_master": "split"}`` a tile stores only the rest: a signed 16-bit residual per element,
``master bits - (bf16 weight bits << 16)``, 2 bytes instead of 4 (the fp32 master itself is never stored). The
step joins the master back from the weight and the residual (integer arithmetic on the bit patterns), updates
it in fp32 as before, rounds the new weight to bf16 as before (torch's round to nearest even), and stores the new
residual. Stages 1-2 hold the weights in memory; at stage 3 the step reads each unit's piece before it writes it
(an offloaded piece is read behind the step, as the forward reads it).

Exact except for one case: a master whose low 16 bits are exactly 0x8000 and whose bf16 rounding went down (a
tie, to even) has residual +0x8000, one more than 16 signed bits hold; it is stored as 0x7FFF, which moves that
master by one fp32 ulp (2^-24 of its value) toward zero. The bf16 weight is unchanged (both round to the same
value), so the forward sees the same weights as with fp32 masters; only such a master, about one in 131072 per
step, drifts by that ulp (and may later round to another weight: long runs drift apart by roundings). Any other
writer of the weights (checkpoint load, a partitioned-state set, zero.Init values) rounds with torch's same
rule, so a residual split from the same fp32 value always matches the weight it is joined with again. A weight
written directly (``param.data`` at stages 0-2, between steps) is joined with the old residual: it becomes part
of the master, where fp32 masters would overwrite it at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MASTER_LAYOUTS = ("fp32", "split")  # infinity.offloaded_master
RESIDUAL_MIN, RESIDUAL_MAX = -(1 << 15), (1 << 15) - 1


def stored_master_bytes(numel: int, layout: str) -> int:
    """Bytes a tile's master takes in its segment; padded to 4 so the states after it stay fp32-aligned."""
    if layout == "split":
        return -(-2 * numel // 4) * 4
    return 4 * numel


def master_width(layout: str) -> float:
    """The master's share of a tile's bytes per element, in fp32 units (the plan's state_width)."""
    return 0.5 if layout == "split" else 1.0


@dataclass
class MasterSplitter:
    """Joins and splits one tile's master at a time, in workspaces reused across tiles and steps (no allocation
    per tile: a tile is up to the plan's tile_numel elements). Each is two passes of integer arithmetic on the
    bit patterns (the weight's bits enter as a signed 16-bit number times 2^16)."""

    numel: int  # the widest tile
    master: torch.Tensor = field(init=False)  # the joined fp32 master of the tile in hand
    _bits: torch.Tensor = field(init=False)  # int32: the residual before it is narrowed
    _high: torch.Tensor = field(init=False)  # bf16: a first value's rounding, or a weight not in host memory

    def __post_init__(self) -> None:
        self.master = torch.empty(self.numel, dtype=torch.float32)
        self._bits = torch.empty(self.numel, dtype=torch.int32)
        self._high = torch.empty(self.numel, dtype=torch.bfloat16)

    BYTES_PER_ELEMENT = 4 + 4 + 2  # its workspaces, per element of the widest tile (infinity estimate counts them)

    def _weight_bits(self, weight: torch.Tensor | None, master: torch.Tensor | None = None) -> torch.Tensor:
        """The bf16 weight's bits as int16: the weight itself where it is a host bf16 tensor; else ``master``
        rounded here (the split: what any writer stores), or a host copy of the weight (the join)."""
        if weight is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            return weight.view(torch.int16)
        source = master if master is not None else weight
        high = self._high[: source.numel()]
        high.copy_(source)  # torch's rounding, or the device's weight brought to the host
        return high.view(torch.int16)

    def join(self, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The fp32 master from its bf16 ``weight`` (any device) and int16 ``residual``: a view of ``master``,
        valid until the next join."""
        out = self.master[: residual.numel()]
        bits = out.view(torch.int32)
        bits.copy_(residual)
        bits.add_(self._weight_bits(weight), alpha=1 << 16)  # no overflow: |master - weight| < one bf16 ulp
        return out

    def split(self, master: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """``residual`` (int16, host) <- ``master``'s low bits against its bf16 rounding: ``weight`` where the
        caller has just written it from ``master``, else rounded here. ``master`` (fp32, any device: a first value
        comes from the compute device) is left as it was."""
        if master.device.type != "cpu":
            master = self.master[: master.numel()].copy_(master)
        bits = self._bits[: master.numel()]
        torch.sub(master.view(torch.int32), self._weight_bits(weight, master), alpha=1 << 16, out=bits)
        residual.copy_(bits.clamp_(RESIDUAL_MIN, RESIDUAL_MAX))  # the one tie that does not fit: [Note]
