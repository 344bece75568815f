"""torch's CPU allocator under KEEP where glibc is older than 2.38 ([Note: aligned blocks and glibc] in
infinity/memory/torch_cpu_allocator.py): a freed block is reused by the next block of its size, torch's kernels
run on it (oneDNN's raw scratch blocks too), and where it cannot be built the run goes on with c10's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infinity.memory import host, torch_cpu_allocator

OLD_GLIBC = (torch_cpu_allocator.glibc_version() or (99, 0)) < torch_cpu_allocator.FIXED_GLIBC
needs_old_glibc = pytest.mark.skipif(not OLD_GLIBC, reason="glibc 2.38 and later reuse aligned holes themselves")

# One process per case (torch's allocator and glibc's settings are per process): under KEEP's settings, blocks of
# 8 MiB with a 2 MiB block kept between each pair; every other 8 MiB block freed, then as many asked for again.
# Where a freed block is reused, the new blocks lie in the holes and the heap does not grow.
HOLES = """
import json, sys, torch
from infinity.memory import host, torch_cpu_allocator
made_before = torch.ones((4 << 20) // 4)  # c10's, freed after the switch
host.fix_heap_policy(host.KEEP)
before_was_ours = torch_cpu_allocator.block_is_malloc_backed(made_before)
made_before = None
big, small = (8 << 20) // 4, (2 << 20) // 4
blocks = []
for _ in range(16):
    blocks += [torch.ones(big), torch.ones(small)]
before = host._mallinfo2().arena
holes = {blocks[i].data_ptr() for i in range(0, len(blocks), 4)}
for i in range(0, len(blocks), 4):
    blocks[i] = None
again = [torch.ones(big) for _ in range(len(holes))]
grew = host._mallinfo2().arena - before
reused = sum(min(abs(t.data_ptr() - hole) for hole in holes) < 4096 for t in again)  # in a hole (header aside)
a, b = torch.randn(300, 700, dtype=torch.bfloat16), torch.randn(700, 500, dtype=torch.bfloat16)
product = (a @ b).float()  # oneDNN's bf16 gemm: raw scratch blocks through torch's CPU allocator
expected = a.float() @ b.float()
print(json.dumps({"installed": torch_cpu_allocator.installed(), "grew": grew,
                  "reused": reused, "holes": len(holes), "gemm_error": float((product - expected).abs().max()),
                  "ours": torch_cpu_allocator.block_is_malloc_backed(again[0]),
                  "small_ours": torch_cpu_allocator.block_is_malloc_backed(torch.ones(1000)),
                  "aligned": again[0].data_ptr() % 64 == 0, "before_was_ours": before_was_ours,
                  "raw": torch_cpu_allocator.installed() and torch_cpu_allocator.raw_blocks_round_trip()}))
"""


def _run(script: str, cache: str, **env: str) -> dict:
    dropped = (*host.GLIBC_SETTINGS, torch_cpu_allocator.SETTING, "THP_MEM_ALLOC_ENABLE")
    clean = {k: v for k, v in os.environ.items() if k not in dropped}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
                          env={**clean, "XDG_CACHE_HOME": cache, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_old_glibc
def test_a_freed_block_is_reused_by_the_next_of_its_size(tmp_path):
    ours = _run(HOLES, str(tmp_path))  # built here, not in the user's cache
    assert ours["installed"] and ours["ours"] and ours["aligned"] and not ours["small_ours"], ours
    assert not ours["before_was_ours"] and ours["raw"], ours  # c10's blocks, whole or raw, go back to c10
    assert ours["reused"] == ours["holes"] and ours["grew"] < (1 << 20), ours  # every new block in a hole
    assert ours["gemm_error"] < 1.0, ours  # bf16 inputs, fp32 sums: the same product
    # INFINITY_TORCH_CPU_ALLOCATOR=c10 keeps torch's own. (Whether glibc's aligned allocation then leaves a hole
    # depends on the remainders it split off the block before: an engine's heap is measured in the README.)
    c10 = _run(HOLES, str(tmp_path), **{torch_cpu_allocator.SETTING: "c10"})
    assert not c10["installed"] and not c10["ours"] and not c10["raw"], c10


def test_where_it_is_not_needed_or_not_wanted_it_says_why(monkeypatch):
    monkeypatch.delenv(torch_cpu_allocator.SETTING, raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert torch_cpu_allocator.needed() == "another allocator is preloaded"
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.39")
    assert torch_cpu_allocator.needed() == "glibc 2.39 reuses aligned holes"
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    assert torch_cpu_allocator.needed() is None
    monkeypatch.setenv(torch_cpu_allocator.SETTING, "c10")
    assert torch_cpu_allocator.needed() == f"{torch_cpu_allocator.SETTING}=c10"
    monkeypatch.delenv(torch_cpu_allocator.SETTING)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # the user asked c10 for huge-page blocks: c10's stays
    assert "THP_MEM_ALLOC_ENABLE" in torch_cpu_allocator.needed()
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    monkeypatch.setattr(os, "confstr", lambda name: None)  # another C library
    assert torch_cpu_allocator.needed() == "the C library is not glibc"


NO_COMPILER = """
import json, logging, torch
logging.basicConfig(level=logging.INFO)
import infinity
model = torch.nn.Linear(1024, 1024)
engine, *_ = infinity.initialize(model=model, config={"train_batch_size": 4, "zero_optimization": {"stage": 2},
                                                      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
engine.backward(engine(torch.randn(4, 1024)).pow(2).mean())
engine.step()
from infinity.memory import torch_cpu_allocator
print(json.dumps({"installed": torch_cpu_allocator.installed()}))
"""


@needs_old_glibc
def test_without_a_compiler_the_run_goes_on_with_c10s_and_says_so(tmp_path):
    done = subprocess.run([sys.executable, "-c", NO_COMPILER], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "PATH": str(tmp_path),
                               "XDG_CACHE_HOME": str(tmp_path / "cache")}, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"installed": False}
    assert "the allocator that avoids it is not available: no C++ compiler" in done.stderr, done.stderr[-3000:]
