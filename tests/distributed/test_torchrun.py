"""Under torchrun, initialize() joins the process group from the environment (the user makes none)."""

import os
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import infinity
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2}}
    engine, *_ = infinity.initialize(model=model, config=config)
    assert torch.distributed.is_initialized() and engine.world_size == 2
    assert engine.train_micro_batch_size_per_gpu() == 4
    gen = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8, generator=gen)).pow(2).mean())
        engine.step()
    torch.save([p.detach() for p in engine.module.parameters()], os.path.join(sys.argv[1], f"{engine.global_rank}.pt"))
    torch.distributed.barrier()  # nobody tears down while the other rank still talks to the store
    torch.distributed.destroy_process_group()
    """
)


def test_engine_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
               "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script), str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True))
