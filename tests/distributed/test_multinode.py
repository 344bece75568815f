"""Two torchrun "nodes" on this machine (``--nnodes 2 --node-rank 0|1``, one process each, rendezvous on
127.0.0.1) train 3 steps at stage 3 with parameters and optimizer states on NVMe: the losses and weights equal
those of one node running two processes. The two nodes share this machine's memory, and the plan sees that:
both ranks report 2 ranks on their host and plan with half of it (budgets are per host, whatever the launcher
calls a node)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    import infinity
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    nvme, out = sys.argv[1], sys.argv[2]
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    engine, *_ = infinity.initialize(model=model, config=config)
    rank, world = engine.global_rank, engine.world_size
    losses = []
    for step in range(3):
        gen = torch.Generator().manual_seed(0)  # one batch, repeated: the loss must fall
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        loss = (engine(x[4 * rank : 4 * rank + 4]) - y[4 * rank : 4 * rank + 4]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    result = {"losses": losses, "local_ranks": engine.plan.local_ranks, "host_share": engine.plan.host_share,
              "nvme_read": engine.tier_stats()["parameters"]["traffic"]["nvme_read"]["bytes"]}
    torch.save({**result, "weights": weights}, os.path.join(out, f"rank{rank}.pt"))
    engine.destroy()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(commands: list[list[str]], env: dict) -> None:
    running = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for c in commands]  # fmt: skip
    for process in running:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"


def test_two_nodes_train_as_one_node_with_two_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {}
    for layout in ("two-nodes", "one-node"):
        nvme, out = tmp_path / layout / "nvme", tmp_path / layout / "out"
        nvme.mkdir(parents=True)
        out.mkdir()
        args = [str(script), str(nvme), str(out)]
        if layout == "two-nodes":
            port = _free_port()
            _run([[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                   "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", *args]
                  for node in (0, 1)], env)  # fmt: skip
        else:
            _run([[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=0",
                   "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", *args]], env)  # fmt: skip
        results[layout] = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
        assert list(nvme.iterdir()) == []  # every swap folder removed
    for two, one in zip(results["two-nodes"], results["one-node"], strict=True):
        assert two["losses"] == one["losses"] and two["losses"][-1] < two["losses"][0]
        assert all(torch.equal(a, b) for a, b in zip(two["weights"], one["weights"], strict=True))
        assert two["local_ranks"] == one["local_ranks"] == 2  # the nodes share this machine: one host budget
        assert two["host_share"] == one["host_share"] or abs(two["host_share"] - one["host_share"]) < 2**30
        assert two["nvme_read"] > 0
