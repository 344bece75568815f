"""The examples run as a user runs them: each for 3 steps as one process, and the MLP one under torchrun with 2
processes (the transformers one under torchrun is what tests/train's torchrun run covers). Each must exit 0 and
print a final ``loss A -> B`` with B < A (the examples are seeded and their
learning rates are large enough that 3 steps lower the loss every time)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FINAL = re.compile(r"loss (\S+) -> (\S+)\s*$")


def run(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    # One thread per process: the suite shares a few cores. PYTHONPATH: the examples import this checkout.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def assert_loss_fell(done: subprocess.CompletedProcess) -> None:
    stdout = done.stdout
    lines = stdout.strip().splitlines()
    match = FINAL.search(lines[-1]) if lines else None
    assert match, f"no final 'loss A -> B' line in:\n{stdout[-3000:]}"
    first, last = float(match[1]), float(match[2])
    assert math.isfinite(first) and math.isfinite(last), lines[-1]
    assert last < first, lines[-1]


@pytest.mark.parametrize("script", ["train_mlp.py", "hf_causal_lm.py", "hf_trainer.py"])
def test_example_single_process(script, tmp_path):
    if script.startswith("hf_"):
        pytest.importorskip("transformers")
    if script == "hf_trainer.py":
        pytest.importorskip("accelerate")
    extra = []
    if script == "hf_trainer.py":  # the engine's line every step, to compare with the Trainer's log
        config = json.loads((ROOT / "configs" / "zero3.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "steps_per_print": 1}))
        extra = ["--output-dir", str(tmp_path / "out"), "--config", str(tmp_path / "config.json")]
    done = run([sys.executable, str(EXAMPLES / script), "--steps", "3", *extra], cwd=tmp_path, timeout=120)
    assert_loss_fell(done)
    if script == "hf_trainer.py":  # save_model wrote a folder from_pretrained loads, and the example says where
        assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "config.json").is_file()
        assert f"model saved in {tmp_path / 'out'} " in done.stdout, done.stdout[-3000:]
        # the engine reports the loss the Trainer logs (4 significant digits), not the loss / accumulation steps
        trainer = [float(x) for x in re.findall(r"'loss': '?([0-9.]+)", done.stdout)]
        engine = [float(x) for x in re.findall(r"^\[infinity\] step \d+: loss (\S+)", done.stderr, re.M)]
        assert len(trainer) == 3 and engine == pytest.approx(trainer, rel=1e-3), (trainer, engine)
    if script == "hf_causal_lm.py":  # steps_per_print 1: the engine's line, with no logging configured
        assert re.search(r"^\[infinity\] step 3: loss \d", done.stderr, re.M), done.stderr[-3000:]


def test_hf_trainer_without_the_hf_extra_says_what_to_install(tmp_path):
    """Without transformers (as without accelerate): one line naming the extra, no traceback."""
    script = EXAMPLES / "hf_trainer.py"
    code = ("import runpy, sys; sys.modules['transformers'] = None; sys.argv = [sys.argv[1], '--steps', '1']; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and 'pip install -e ".[hf]"' in done.stderr, (
        done.stderr[-3000:]
    )


def test_mlp_example_under_torchrun(tmp_path):
    # Port 0 for the rendezvous and the master: the OS picks free ones, so parallel runs never collide.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]  # fmt: skip
    assert_loss_fell(run([*launcher, str(EXAMPLES / "train_mlp.py"), "--steps", "3"], cwd=tmp_path, timeout=180))


def test_a_deepspeed_script_runs_after_changing_its_import(tmp_path):
    """examples/deepspeed_zero3.py is written for DeepSpeed (``import deepspeed``) and checks each call against
    DeepSpeed's documented result; with ``import infinity as deepspeed`` instead, it runs at stage 3 with
    parameters and optimizer states on NVMe, under torchrun with two processes."""
    source = (EXAMPLES / "deepspeed_zero3.py").read_text()
    assert source.count("\nimport deepspeed\n") == 1
    script = tmp_path / "script.py"
    script.write_text(source.replace("\nimport deepspeed\n", "\nimport infinity as deepspeed\n"))
    (tmp_path / "nvme").mkdir()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]  # fmt: skip
    done = run([*launcher, str(script), "--nvme", str(tmp_path / "nvme")], cwd=tmp_path, timeout=180)
    assert_loss_fell(done)
    assert "Estimated memory needed for params, optim states and gradients" in done.stdout, done.stdout[-3000:]
    assert list((tmp_path / "nvme").iterdir()) == []


@pytest.mark.parametrize("script", ["finetune_lora_sft.py", "finetune_dpo.py"])
def test_fine_tuning_example_on_nvme(script, tmp_path):
    """The fine-tuning recipes (TRL's SFT with LoRA, DPO with a reference model), ZeRO-3 with the weights on
    NVMe under the given folder: the loss falls in 3 steps, the folder is left empty of swap files; the LoRA one
    saves PEFT's adapter files and reloads them to continue a prompt. The DPO one also under torchrun with 2
    processes."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    (tmp_path / "nvme").mkdir()
    extra = ["--output-dir", str(tmp_path / "out")] if script == "finetune_lora_sft.py" else []
    command = [str(EXAMPLES / script), "--steps", "3", "--nvme-path", str(tmp_path / "nvme"), *extra]
    done = run([sys.executable, *command], cwd=tmp_path, timeout=180)
    assert_loss_fell(done)
    if script == "finetune_lora_sft.py":
        saved = set(os.listdir(tmp_path / "out"))
        assert {"adapter_config.json", "adapter_model.safetensors"} <= saved and "model.safetensors" not in saved
        assert "'c d e' continues as" in done.stdout, done.stdout[-3000:]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                    "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]  # fmt: skip
        assert_loss_fell(run([*launcher, *command], cwd=tmp_path, timeout=180))
    assert [p for p in (tmp_path / "nvme").rglob("*") if p.is_file()] == []
