"""Token batches for `infinity train`, drawn deterministically from (seed, rank, micro-step): a resumed run sees
exactly the batches the uninterrupted run would have seen, with no loader state to save.

- synthetic: each sequence counts up from a random token (the next token is this one + 1, modulo the
  vocabulary), a task a model learns in a few steps, so the loss visibly falls.
- a text file: byte-level tokens (0-255, so no tokenizer to download), random windows of the file, read through
  a memory map so a large file costs no RAM."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch


class DataError(ValueError):
    """A --data that cannot give batches: missing, unreadable, too short, or a vocabulary too small for bytes."""


def _generator(seed: int, rank: int, micro_step: int) -> torch.Generator:
    # distinct, reproducible streams per (seed, rank, micro-step), whatever the world size
    return torch.Generator().manual_seed(((seed * 1_000_003 + rank) * 1_000_000_007 + micro_step) % 2**63)


@dataclasses.dataclass(kw_only=True)
class SyntheticTokens:
    vocab_size: int
    seed: int = 0

    describe = "synthetic (each sequence counts up from a random token)"

    def batch(self, *, rank: int, micro_step: int, micro_batch: int, seq_len: int) -> torch.Tensor:
        generator = _generator(self.seed, rank, micro_step)
        first = torch.randint(0, self.vocab_size, (micro_batch, 1), generator=generator)
        return (first + torch.arange(seq_len)) % self.vocab_size


@dataclasses.dataclass(kw_only=True)
class ByteText:
    path: str
    seed: int = 0

    def __post_init__(self) -> None:
        if os.path.exists(self.path) and not os.path.isfile(self.path):
            raise DataError(f"--data {self.path!r} is not a file; give a text file or 'synthetic'")
        try:
            size = os.path.getsize(self.path)
            self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        except OSError as e:
            raise DataError(f"--data {self.path!r} cannot be read: {e.strerror or e}") from None

    @property
    def describe(self) -> str:
        return f"{self.path} ({len(self._bytes):,} bytes as byte tokens)"

    def check(self, *, seq_len: int, vocab_size: int) -> None:
        if len(self._bytes) < seq_len + 1:
            raise DataError(
                f"--data {self.path!r} holds {len(self._bytes)} bytes; a sequence needs {seq_len + 1}: "
                "give a longer file or a smaller --seq-len"
            )
        if vocab_size < 256:
            raise DataError(f"--data needs a vocabulary of at least 256 byte tokens; the model has {vocab_size}")

    def batch(self, *, rank: int, micro_step: int, micro_batch: int, seq_len: int) -> torch.Tensor:
        generator = _generator(self.seed, rank, micro_step)
        starts = torch.randint(0, len(self._bytes) - seq_len + 1, (micro_batch,), generator=generator)
        rows = [np.asarray(self._bytes[s : s + seq_len], dtype=np.int64) for s in starts.tolist()]
        return torch.from_numpy(np.stack(rows))


def token_source(data: str, *, vocab_size: int, seq_len: int, seed: int) -> SyntheticTokens | ByteText:
    if data == "synthetic":
        return SyntheticTokens(vocab_size=vocab_size, seed=seed)
    source = ByteText(path=data, seed=seed)
    source.check(seq_len=seq_len, vocab_size=vocab_size)
    return source
