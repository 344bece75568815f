"""Compact optimizer states: how an offloaded tile's states are stored, and turned back into fp32 for the step.

[Note: compact states]
An offloaded tile is [master | state 1 | state 2 ...] ([Note: tiles] in tiles.py). With the config's
``"infinity": {"optimizer_state_dtype": ...}`` the states (not the master) are stored narrower:
- "fp32": as they are (4 bytes an element), the default;
- "bf16": rounded to bfloat16 (2 bytes), any elementwise optimizer;
- "int8": one byte an element plus an fp32 scale per block of BLOCK elements (1.0625 bytes), for Adam and AdamW
  only: blockwise quantization, as 8-bit Adam does (bitsandbytes, torchao), each block divided by its largest
  magnitude and each element replaced by the nearest (in ratio) of 256 codes spaced evenly in log scale, so small values
  keep their relative precision (a linear code would zero most of the second moment: squared gradients span
  many decades). The first moment takes a signed code, the second an unsigned one over twice the decades.
The master stays fp32: the update is computed in fp32 on decoded states (a workspace the step reuses), and only
what is stored is rounded. The step stores the second moment (int8) and every bf16 state with stochastic
rounding (int8: to one of the two codes around the value, in log scale, where the codes are spaced evenly; bf16:
random low bits added, then cut), so a state that changes by less than half a step each time, as Adam's second
moment does with beta2 0.999, still moves on average instead of sticking to its code. Measured on the codec
alone (2000 steps of beta2 0.999, then half the gradients ten times smaller): rounded to nearest, the stored
second moment of those was 2.1x (int8) and 2.8x (bf16) the true one; rounded stochastically 0.95x and 1.00x.
int8 rounds in log scale because rounding unbiased in value, on codes 9.6% apart, made a second moment's typical
value drift to a third of itself (a multiplicative random walk); its first moment, which moves by a tenth each
step, keeps rounding to nearest (stochastic rounding doubled its error). The randomness is seeded by tile and
step, so a resumed run rounds as the uninterrupted one. Other stores (a checkpoint's states, the
partitioned-state helpers) round to nearest: decoded values come back to the same codes. Adam with int8 states
stores 6.125 bytes an element instead of 12.

Tiles are cut at multiples of 64 elements (tiles.cut), so with BLOCK = 64 only a run's last tile ends in a partial
block, which takes one more scale, and each state's bytes are padded to 4 (the plan's estimate, bytes_per_element,
leaves room for both: COMPACT_TILE_SLACK in memory/plan.py).
"""

from __future__ import annotations

import math

import torch

from infinity.errors import ConfigError

BLOCK = 64  # elements per int8 scale; tiles are cut at multiples of it (tiles.SIMD_NUMEL)
STATE_DTYPES = ("fp32", "bf16", "int8")
STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}  # stored bytes per element (whole blocks)
INT8_RULES = {"exp_avg": "signed", "exp_avg_sq": "unsigned", "max_exp_avg_sq": "unsigned"}  # Adam's states
_SIGNED_DECADES = 5  # the signed code spans magnitudes 1e-5..1 of the block's largest
_UNSIGNED_DECADES = 10  # the second moment, a square: twice as many


def _aligned(nbytes: int) -> int:
    """A state's stored bytes padded to a multiple of 4: a tile of an odd element count (a stage-3 run's end)
    would otherwise start the next state's fp32 scales at an offset no float view can take."""
    return -(-nbytes // 4) * 4


def _log_codes(*, signed: bool) -> torch.Tensor:
    """256 sorted codes in [-1, 1] (signed) or [0, 1]: zero and magnitudes spaced evenly in log scale."""
    if signed:
        magnitudes = torch.logspace(-_SIGNED_DECADES, 0, 127, dtype=torch.float64)
        codes = torch.cat([-magnitudes.flip(0), torch.zeros(1, dtype=torch.float64), magnitudes,
                           torch.ones(1, dtype=torch.float64)])  # fmt: skip  (the last, a repeat of 1, is unused)
    else:
        magnitudes = torch.logspace(-_UNSIGNED_DECADES, 0, 255, dtype=torch.float64)
        codes = torch.cat([torch.zeros(1, dtype=torch.float64), magnitudes])
    return codes.to(torch.float32)


class StateCodec:
    """How one state is stored: ``encode`` fp32 values into its bytes, ``decode`` the bytes back into fp32."""

    name = "fp32"
    bytes_per_element = 4.0

    def stored_bytes(self, numel: int) -> int:
        """Rounded up to 4 bytes: the next state's fp32 scales (or the segment's next part) stay aligned."""
        return _aligned(math.ceil(numel * self.bytes_per_element))

    def encode(self, values: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """``generator``: round stochastically with it (the step's stores); None: to nearest (exact values, such as
        a checkpoint's decoded states, come back unchanged)."""
        out[: 4 * values.numel()].view(torch.float32).copy_(values)

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(stored[: 4 * out.numel()].view(torch.float32))


class Bf16Codec(StateCodec):
    name = "bf16"
    bytes_per_element = 2.0

    def encode(self, values: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None = None) -> None:
        target = out[: 2 * values.numel()].view(torch.bfloat16)
        if generator is None:
            target.copy_(values)
            return
        # stochastic: random low 16 bits added, then cut off (bfloat16 is float32's upper half)
        bits = values.contiguous().view(torch.int32) + torch.randint(0, 1 << 16, values.shape, dtype=torch.int32,
                                                                      generator=generator)  # fmt: skip
        target.copy_(bits.bitwise_and_(-(1 << 16)).view(torch.float32))

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(stored[: 2 * out.numel()].view(torch.bfloat16))


class Int8Codec(StateCodec):
    """[scales: fp32 per block | codes: uint8 per element]; see the Note. A tile's last block may be partial (the
    end of a run): it has its own scale. Encoding rounds in log scale (a logarithm and a rounding per element,
    about as fast as Adam's own update; a search among the 256 codes took 18 times as long): each magnitude goes
    to the code nearest in ratio, and below half the smallest code to zero."""

    name = "int8"
    bytes_per_element = 1.0 + 4.0 / BLOCK  # whole blocks; stored_bytes counts a partial last block's scale

    def __init__(self, *, signed: bool) -> None:
        self.signed = signed
        self.decades = _SIGNED_DECADES if signed else _UNSIGNED_DECADES
        self.steps = 126 if signed else 254  # magnitudes 10 ** (-decades + k * decades / steps), k = 0..steps
        self.codes = _log_codes(signed=signed)
        self.smallest = float(self.codes[128 if signed else 1])

    def stored_bytes(self, numel: int) -> int:
        return _aligned(4 * -(-numel // BLOCK) + numel)

    @staticmethod
    def _split(stored: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = -(-numel // BLOCK)
        return stored[: blocks * 4].view(torch.float32), stored[blocks * 4 : blocks * 4 + numel]

    @staticmethod
    def _blocks(flat: torch.Tensor) -> list[torch.Tensor]:
        """The whole blocks as one (blocks, BLOCK) view, and the partial last one as (1, rest)."""
        whole = flat.numel() // BLOCK * BLOCK
        parts = [flat[:whole].view(-1, BLOCK)] if whole else []
        return parts + ([flat[whole:].view(1, -1)] if whole < flat.numel() else [])

    def _indices(self, block: torch.Tensor, scale: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        ratio = block.abs().div_(scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
        k = torch.log10(ratio).add_(self.decades).mul_(self.steps / self.decades)
        if generator is None or self.signed:  # the first moment moves by a tenth a step: nearest keeps it closer
            k.round_()
        else:  # stochastic, in log scale: the code above with the probability of the distance from the one below
            k.add_(torch.rand(k.shape, generator=generator)).floor_()
        k.clamp_(0, self.steps)
        if self.signed:  # codes: -1 .. -smallest (0..126), 0 (127), smallest .. 1 (128..254): 127 + sign (k + 1)
            return k.add_(1).mul_(torch.sign(block)).add_(127).masked_fill_(ratio < self.smallest / 2, 127)
        return k.add_(1).masked_fill_(ratio < self.smallest / 2, 0)  # codes: 0, smallest .. 1

    def encode(self, values: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None = None) -> None:
        scales, codes = self._split(out, values.numel())
        first = 0
        for block, code in zip(self._blocks(values.view(-1)), self._blocks(codes), strict=True):
            scale = scales[first : first + block.shape[0]]
            torch.amax(block.abs(), dim=1, out=scale)
            code.copy_(self._indices(block, scale, generator))
            first += block.shape[0]

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        scales, codes = self._split(stored, out.numel())
        first = 0
        for code, block in zip(self._blocks(codes), self._blocks(out.view(-1)), strict=True):
            torch.mul(self.codes[code.long()], scales[first : first + code.shape[0]].unsqueeze(1), out=block)
            first += code.shape[0]


def codecs_for(state_dtype: str, states: tuple[str, ...], optimizer_name: str) -> list[StateCodec]:
    """The codec of each state of a tile under ``state_dtype``; int8 only for Adam's states (others refused)."""
    if state_dtype == "fp32":
        return [StateCodec() for _ in states]
    if state_dtype == "bf16":
        return [Bf16Codec() for _ in states]
    if not states:
        raise ConfigError(f'infinity.optimizer_state_dtype "int8": {optimizer_name} keeps no per-element state here, '
                          'so there is nothing to store compactly; drop the key')  # fmt: skip
    unknown = [s for s in states if s not in INT8_RULES]
    if unknown:
        raise ConfigError(
            f'infinity.optimizer_state_dtype "int8" quantizes Adam\'s and AdamW\'s moments only; {optimizer_name} '
            f'keeps {list(states)}: use "bf16" (any elementwise optimizer) or "fp32"'
        )
    return [Int8Codec(signed=INT8_RULES[s] == "signed") for s in states]
