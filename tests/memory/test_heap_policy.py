"""The engine's heap policy (infinity/memory/host.py): training in memory reuses freed blocks instead of having the
kernel fault them in again each step; a run on NVMe with a small host share gives them back."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.memory import host

ACTIVATION_BYTES = 64 << 20  # above glibc's largest mmap threshold (32 MiB): a fresh mapping each step by default
SETTLED = 2  # the step whose resident size the engine's HeapWatch settles on (memory/host.py)

# One process per policy: glibc's settings are per process. A stage-3 MLP whose hidden activation is 64 MiB;
# the minor faults and the resident size after each step.
SCRIPT = f"""
import json, resource, sys
import torch, torch.nn as nn
import infinity
from infinity.memory.host import process_status_bytes

torch.manual_seed(0)
batch, width = 512, {ACTIVATION_BYTES} // 4 // 512
model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 1))
config = {{"train_micro_batch_size_per_gpu": batch, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
          "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0}}}}
engine, *_ = infinity.initialize(model=model, config=config)
x, y = torch.randn(batch, 64), torch.randn(batch, 1)
faults, resident = [], []
for step in range(int(sys.argv[1])):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.backward((engine(x) - y).pow(2).mean())
    engine.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    resident.append(process_status_bytes("VmRSS"))
engine.destroy()
print(json.dumps({{"faults": faults, "resident": resident}}))
"""


def _run(steps: int, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in (*host.GLIBC_SETTINGS, "THP_MEM_ALLOC_ENABLE")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(steps)], capture_output=True, text=True,
                          env={**clean, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_training_in_memory_reuses_its_blocks_and_stays_near_its_settled_size():
    """Each step allocates and frees activations of 64 MiB (the hidden layer, its ReLU, their gradients). With
    the engine's KEEP policy they come from the heap the first steps grew: over steps 5-60 the typical step
    faults under 1/64 of one activation's pages, and on average under half of one (glibc's occasional growth by a
    whole block, and the watch's trim after a few of them, fault a block in once: CI saw 20 such blocks in 56
    steps on one run, none on most), against more than one every step in the control below; the resident size
    never passes the settled one by more than the watch's slack."""
    pages = ACTIVATION_BYTES // 4096
    run = _run(60)
    faults, resident = run["faults"][4:], run["resident"]
    assert statistics.median(faults) < pages // 64, faults
    assert sum(faults) < len(faults) * pages // 2, faults
    settled = resident[SETTLED - 1]
    slack = max(host.GROWTH_SLACK_BYTES, settled // host.GROWTH_SLACK_PART)
    assert max(resident[SETTLED:]) <= settled + slack + (8 << 20), [r >> 20 for r in resident]


def _huge_pages_always() -> bool:
    try:
        return "[always]" in Path(host.THP_SETTING).read_text()
    except OSError:
        return False


@pytest.mark.skipif(_huge_pages_always(), reason="huge pages for every mapping: a fresh block takes a few faults")
def test_where_the_user_set_glibc_the_engine_leaves_it_and_every_step_faults_again():
    """The control: with the user's own threshold (glibc's largest, 32 MiB) the engine changes nothing, and each
    step's 64 MiB blocks are fresh mappings, faulted in page by page again."""
    faults = _run(8, MALLOC_MMAP_THRESHOLD_=str(32 << 20))["faults"][4:]
    assert min(faults) > ACTIVATION_BYTES // 4096, faults


def test_policy_follows_the_host_share():
    """In memory at any share, and on NVMe with a large share: freed blocks stay; on NVMe with a small share they
    go back, so the host budget holds."""
    assert host.policy_for(on_nvme=False, host_share=256 << 20) is host.KEEP
    assert host.policy_for(on_nvme=True, host_share=host.REUSE_SHARE_BYTES) is host.KEEP
    assert host.policy_for(on_nvme=True, host_share=host.REUSE_SHARE_BYTES - 1) is host.RETURN
    assert host.BUILD is host.RETURN  # zero.Init's freed full-size parameters go back ([Note: zero.Init memory])


@pytest.mark.skipif(any(name in os.environ for name in host.GLIBC_SETTINGS), reason="glibc set by the user")
def test_setup_gives_a_large_units_one_off_buffers_back(monkeypatch):
    """Stage 3's initialize() fills each unit from whole fp32 values made once; under KEEP the heap would hold
    them as holes the next unit rarely fits, so once SETUP_FREE_BYTES lie free after a unit the free pages go
    back ([Note: setup memory]): with the limit at 48 MiB here (so the test model stays small), one trim, after
    the 67 MB unit (4096 x 4096 weights) left its buffers free, none after the small ones around it."""
    import infinity.engine

    assert host.heap_free_bytes() is not None  # glibc 2.33+: what the rule reads
    monkeypatch.setattr(host, "SETUP_FREE_BYTES", 48 << 20)
    trims = []
    monkeypatch.setattr(host, "trim_heap", lambda: trims.append(host._fixed) or True)
    monkeypatch.setattr(infinity.engine, "trim_heap", lambda: True)  # the one after the partition: not counted
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        assert trims == [host.KEEP] and host._fixed is host.KEEP  # training in memory keeps its blocks
    finally:
        engine.destroy()


@pytest.mark.skipif(any(name in os.environ for name in host.GLIBC_SETTINGS), reason="glibc set by the user")
def test_the_kept_blocks_go_back_when_the_host_runs_short(caplog):
    """KEEP's cache is bounded by the host: once the memory available falls under an eighth of what the plan
    found at initialize, the engine says so once, gives the heap's free pages back and returns freed blocks
    from then on; training goes on. (Here the plan is told it found 1 EiB: any host is short of that.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        assert host._fixed is host.KEEP  # training in memory
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
        assert host._fixed is host.KEEP  # this host has what it had at initialize
        mine = engine.node.ranks[engine.node.rank]
        engine.node = dataclasses.replace(engine.node, ranks=(dataclasses.replace(mine, host_bytes=1 << 60),))
        with caplog.at_level(logging.WARNING, logger="infinity"):
            for _ in range(3):
                engine.backward((engine(x) - y).pow(2).mean())
                engine.step()
        lines = [r.getMessage() for r in caplog.records if "host memory is short" in r.getMessage()]
        assert len(lines) == 1 and "lower the micro-batch" in lines[0], lines
        assert host._fixed is host.RETURN and engine.global_steps == 4
    finally:
        engine.destroy()
        host.fix_heap_policy(host.KEEP)  # as the next engine in this process would find it
