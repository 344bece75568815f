"""`infinity ckpt from-deepspeed` against checkpoints the real DeepSpeed writes (the test extra installs it; on CPU
it runs with DS_ACCELERATOR=cpu over gloo): DeepSpeed trains two steps at ZeRO stage 1, 2 or 3 (fp32 or bf16, one
or two processes) and saves; DeepSpeed's own resume from that checkpoint takes two more steps. The checkpoint,
converted, resumes in infinity at world size 1 and 2: its two steps give DeepSpeed's losses and fp32 masters,
with the optimizer states, step counts, LR scheduler and client state carried over. The model has a frozen
layer, a zero-element parameter and a buffer. The converter reads without running code, and DeepSpeed need not be
importable for it; it refuses to write over the DeepSpeed checkpoint, and rank files of another run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import infinity
import infinity.zero
from infinity.checkpoint.from_deepspeed import from_deepspeed
from infinity.errors import CheckpointError
from infinity.utils import safe_get_full_fp32_param
from tests.distributed.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8
CASES = [(1, "fp32", 2), (2, "fp32", 1), (3, "fp32", 2), (2, "bf16", 2), (3, "bf16", 1)]  # stage, dtype, DS ranks


class Net(nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.last = nn.Linear(16, 4)
        self.register_buffer("offset", torch.linspace(-1, 1, 4))
        if stage < 3:  # DeepSpeed files a zero-element parameter as frozen (its stage 3 fails on one)
            self.unused = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.last(torch.tanh(self.frozen(torch.tanh(self.first(x))))) + self.offset


def build(stage: int) -> nn.Module:
    torch.manual_seed(0)
    return Net(stage)


def batch(number: int, rank: int, world: int, micro: int):
    gen = torch.Generator().manual_seed(number)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)
    return x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]


def config(stage: int, dtype: str, world: int) -> dict:
    found = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5}},  # fmt: skip
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        found["bf16"] = {"enabled": True}
    return found


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"stage{c[0]}-{c[1]}-ds{c[2]}")
def deepspeed_run(request, tmp_path_factory):
    """DeepSpeed's checkpoint and its own resume, in a subprocess (its ranks under torchrun)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install -e '.[test]' installs it)")
    stage, dtype, world = request.param
    folder = tmp_path_factory.mktemp(f"ds-stage{stage}-{dtype}-{world}")
    script = [str(ROOT / "tests" / "checkpoint" / "deepspeed_run.py"), json.dumps(config(stage, dtype, world)),
              str(folder)]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if world == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(29000 + os.getpid() % 1000))  # fmt: skip
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_port=0",
                   "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", *script]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"DeepSpeed's run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    resumed = torch.load(folder / "deepspeed-resumed.pt", weights_only=True)
    return request.param, folder, resumed


def _resume(*, rank: int, world_size: int, case, converted: str) -> dict:
    stage, dtype, _ = case
    cfg = config(stage, dtype, world_size)
    engine, *_ = infinity.initialize(model=build(stage), config=cfg)
    _, client_state = engine.load_checkpoint(converted)
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    losses = []
    for number in range(2, 4):
        x, y = batch(number, rank, world_size, cfg["train_micro_batch_size_per_gpu"])
        loss = (engine(x.to(compute)).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world_size > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        frozen = engine.module.frozen.weight.detach().float().clone()
    result = {"losses": losses, "masters": masters, "client_state": client_state, "frozen": frozen,
              "steps": engine.global_steps, "lr": engine.get_lr()}  # fmt: skip
    engine.destroy()
    return result


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_converted_checkpoint_resumes_as_deepspeeds_own_resume(deepspeed_run, world_size, tmp_path):
    case, folder, want = deepspeed_run
    converted = tmp_path / "converted"
    from_deepspeed(folder / "deepspeed", converted)
    got = run_distributed(_resume, world_size, tmp_path, timeout_s=120, case=case, converted=str(converted))[0]
    tolerance = {"rel": 1e-5} if case[1] == "fp32" else {"rel": 2e-2}
    assert got["losses"] == pytest.approx(want["losses"], **tolerance)
    for name, value in want["masters"].items():
        if value is None:  # DeepSpeed keeps no master of a zero-element parameter
            assert got["masters"][name].numel() == 0
            continue
        atol = 1e-6 if case[1] == "fp32" else 1e-2
        torch.testing.assert_close(got["masters"][name], value.float(), rtol=tolerance["rel"], atol=atol, msg=name)
    assert got["client_state"] == {"epoch": 3}
    assert got["steps"] == 4
    torch.testing.assert_close(got["frozen"], build(case[0]).frozen.weight.detach().to(got["frozen"].dtype).float(),
                               rtol=0, atol=1e-2 if case[1] == "bf16" else 0)  # fmt: skip


def test_the_converter_runs_no_code_and_needs_no_deepspeed(deepspeed_run, tmp_path):
    """DeepSpeed made unimportable in a fresh interpreter: the conversion reads its files all the same."""
    _, folder, _ = deepspeed_run
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from infinity.checkpoint.from_deepspeed import from_deepspeed\n"
            f"print(from_deepspeed({str(folder / 'deepspeed')!r}, {str(tmp_path / 'out')!r}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "latest").read_text().strip() == "global_step2"


class Payload:
    """Unpickling this runs a command: a crafted checkpoint file."""

    def __reduce__(self):
        return (os.system, ("touch ran-code",))


def test_the_source_is_never_overwritten_and_stray_rank_files_are_refused(deepspeed_run, tmp_path):
    case, folder, _ = deepspeed_run
    copy = tmp_path / "copy"
    shutil.copytree(folder / "deepspeed", copy)
    with pytest.raises(CheckpointError, match="is not an infinity checkpoint .*convert into another folder"):
        from_deepspeed(copy, copy)
    tag = copy / (copy / "latest").read_text().strip()
    stray = sorted(tag.glob("*optim_states.pt"))[-1]
    shutil.copy(stray, str(stray).replace(f"zero_pp_rank_{case[2] - 1}_", f"zero_pp_rank_{case[2]}_"))
    with pytest.raises(CheckpointError, match=f"saved by {case[2]} ranks but holds {case[2] + 1}"):
        from_deepspeed(copy, tmp_path / "out")


def test_what_is_not_a_deepspeed_checkpoint_is_a_clear_error_and_nothing_runs(tmp_path, monkeypatch):
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match="no DeepSpeed ZeRO optimizer files"):
        from_deepspeed(tmp_path, tmp_path / "out")
    with pytest.raises(CheckpointError, match="has no `latest` file"):
        from_deepspeed(tmp_path / "global_step1", tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    crafted = tmp_path / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload()}, crafted)
    with pytest.raises(CheckpointError, match="without running code"):
        from_deepspeed(tmp_path, tmp_path / "out")
    assert not (tmp_path / "ran-code").exists()
