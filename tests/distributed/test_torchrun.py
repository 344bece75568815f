"""Under torchrun, initialize() joins the process group from the environment (the user makes none), and the
engine trains as plain PyTorch does on the whole batch."""

import os
import subprocess
import sys
import textwrap

import torch

from tests.distributed.harness import THREADS_AT_EXIT, assert_no_thread_outlives

LR, WEIGHT_DECAY, STEPS = 0.01, 0.01, 3

SCRIPT = THREADS_AT_EXIT + textwrap.dedent(
    f"""
    import os, sys
    import torch
    import infinity
    torch.set_num_threads(1)
    START = threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {{"train_batch_size": 8, "zero_optimization": {{"stage": 2}},
              "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "weight_decay": {WEIGHT_DECAY}}}}}}}
    engine, *_ = infinity.initialize(model=model, config=config)
    assert torch.distributed.is_initialized() and engine.world_size == 2
    assert engine.train_micro_batch_size_per_gpu() == 4
    gen = torch.Generator().manual_seed(engine.global_rank)
    batches, losses = [], []
    for _ in range({STEPS}):
        batches.append(torch.randn(4, 8, generator=gen))
        loss = engine(batches[-1]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with torch.no_grad():
        after = [engine(batch).pow(2).mean().item() for batch in batches]
    params = [p.detach().clone() for p in engine.module.parameters()]
    result = {{"losses": losses, "after": after, "params": params}}
    torch.save(result, os.path.join(sys.argv[1], f"{{engine.global_rank}}.pt"))
    torch.distributed.barrier()  # nobody tears down while the other rank still talks to the store
    torch.distributed.destroy_process_group()
    """
)


def build() -> torch.nn.Module:
    """The script's model (a copy that drifted would fail the comparison, not pass it)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def reference() -> dict:
    """One process, plain PyTorch: each step on the two ranks' micro-batches concatenated (rank r draws from a
    generator seeded r), mean loss. Per rank: its micro-batch losses before each step and after training."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    gens = [torch.Generator().manual_seed(rank) for rank in (0, 1)]
    batches, losses = [[], []], [[], []]
    for _ in range(STEPS):
        for rank in (0, 1):
            batches[rank].append(torch.randn(4, 8, generator=gens[rank]))
        out = model(torch.cat([batches[0][-1], batches[1][-1]]))
        for rank in (0, 1):
            losses[rank].append(out[4 * rank : 4 * rank + 4].pow(2).mean().item())
        optimizer.zero_grad()
        out.pow(2).mean().backward()
        optimizer.step()
    with torch.no_grad():
        after = [[model(batch).pow(2).mean().item() for batch in batches[rank]] for rank in (0, 1)]
    return {"losses": losses, "after": after, "params": [p.detach().clone() for p in model.parameters()]}


def test_engine_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # no CUDA threads at exit
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
               "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script), str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # The group the script destroyed is let go of too: gloo's threads, still running as the interpreter finalizes,
    # could abort a rank ("terminate called without an active exception"; [Note: teardown]).
    assert_no_thread_outlives(done.stdout, ranks=2)
    ref = reference()
    initial = list(build().parameters())
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        # It trained: after the steps the loss on every batch it saw is lower than before its step.
        assert all(a < b for a, b in zip(got["after"], got["losses"], strict=True)), got
        assert all(not torch.equal(p, p0) for p, p0 in zip(got["params"], initial, strict=True))
        # And it trained as plain PyTorch does on the concatenated batch of 8.
        for key in ("losses", "after"):
            for ours, want in zip(got[key], ref[key][rank], strict=True):
                assert abs(ours - want) <= 1e-5 * abs(want), (rank, key, got[key], ref[key][rank])
        for index, (ours, want) in enumerate(zip(got["params"], ref["params"], strict=True)):
            error = float((ours - want).abs().max() / want.abs().max())
            assert error <= 1e-5, f"rank {rank}, parameter {index}: relative error {error:.1e}"
