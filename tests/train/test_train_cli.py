"""`infinity train` as a user runs it: end to end with NVMe offload (real swap files on the real disk), a save and
an exact resume, Ctrl-C, torchrun with two processes, and bad input (one line, exit code 2, no traceback)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infinity.memory import plan as memory_plan
from infinity.train.disk import stat_path
from infinity.train.main import main as train_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVME_CONFIG = os.path.join(REPO, "configs", "zero3-nvme.json")
SMALL = ["--model", "gpt2-tiny", "--seq-len", "32", "--micro-batch", "2"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _train(args: list[str], *, launcher: list[str] | None = None, timeout: float = 240,
           env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    command = (launcher or [sys.executable, "-m", "infinity"]) + ["train", "--config", NVME_CONFIG, *SMALL, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})},
                          cwd=REPO)  # fmt: skip


def _swap_left(folder: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]


def test_trains_saves_and_resumes_exactly(tmp_path, capsys):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    whole = _train(["--steps", "4", "--nvme-path", str(swap), "--save", str(ckpt), "--save-every", "2",
                    "--summary-json", str(tmp_path / "whole.json")])  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = whole.stdout
    assert "infinity train: done. gpt2-tiny" in out
    for line in ("loss ", "peak RSS", "NVMe traffic", "swap files", "I/O waits", "minor faults a step (",
                 f"checkpoint    {ckpt}"):
        assert line in out, out
    assert "optimizer read" in out and "parameters read" in out  # both on NVMe, as configs/zero3-nvme.json says
    assert _swap_left(str(swap)) == [], "the swap files outlived the run"
    whole_summary = json.loads((tmp_path / "whole.json").read_text())
    losses = whole_summary["losses"]
    if stat_path(str(tmp_path)) is not None:  # a folder on a block device (not tmpfs): its disk's phases
        assert "disk phases   forward" in out, out
        phases = whole_summary["disk_phases"]
        assert phases["forward"]["wall_s"] > 0 and phases["backward"]["wall_s"] > 0, phases
    else:  # tmpfs, overlay: no device counters, no line
        assert whole_summary["disk_phases"] is None and "disk phases" not in out, out
    assert len(losses) == 4 and abs(losses[0] - math.log(512)) < 0.5  # an untrained model: about ln(vocabulary)
    assert (ckpt / "latest").read_text().strip() == "global_step4" and os.path.isdir(ckpt / "global_step2")
    _estimate_within_15_percent(json.loads((tmp_path / "whole.json").read_text()))

    _converts_for_from_pretrained(ckpt, tmp_path / "fp32")

    resumed = _train(["--steps", "4", "--nvme-path", str(swap), "--resume", str(ckpt / "global_step2"),
                      "--summary-json", str(tmp_path / "resumed.json")])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((tmp_path / "resumed.json").read_text())
    assert after["first_step"] == 2
    assert after["losses"] == losses[2:]  # the same batches and states: the same losses, bit for bit
    assert _swap_left(str(swap)) == []
    # --steps the checkpoint has reached: refused before anything is built, not a summary of no steps
    capsys.readouterr()  # from_pretrained's progress bar
    message = _bad(capsys, "--config", NVME_CONFIG, *SMALL, "--steps", "4", "--nvme-path", str(swap), "--resume",
                   str(ckpt))  # fmt: skip
    assert "already at step 4" in message and "raise --steps above 4" in message, message


def _converts_for_from_pretrained(ckpt: Path, out: Path) -> None:
    """`infinity ckpt to-fp32` of a --save folder gives a folder from_pretrained loads: the weights and the model's
    config.json, which --save keeps beside the tags."""
    from transformers import AutoModelForCausalLM

    from infinity.checkpoint.consolidate import to_fp32

    written = to_fp32(ckpt, out)
    assert str(out / "config.json") in written
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_layer == 4 and model.config.use_cache


@functools.cache
def _runtime_bytes(raw_json: str) -> int:
    """The runtime's own RSS, measured once per config for this module's runs (a fresh process each time)."""
    from infinity.estimate import runtime_bytes
    from infinity.train import models

    runtime = runtime_bytes(models.CATALOG["gpt2-tiny"], json.loads(raw_json))
    assert runtime is not None
    return runtime


def _estimate_within_15_percent(measured: dict, *, world_size: int = 1, host_memory: int | None = None) -> None:
    """infinity estimate's host RSS and swap bytes for the run above, against that run's own summary: the node's
    peak RSS (every rank's peak added up), the bytes of its swap files. ``host_memory``: what the run was told the
    node has (INFINITY_HOST_MEMORY_BYTES), which the plan divides among its ranks, as the estimate must."""
    import argparse

    from infinity.budget import Where
    from infinity.estimate import plan_estimate
    from infinity.train import models
    from infinity.train.options import apply_dtype

    raw = json.loads(Path(NVME_CONFIG).read_text())
    raw["train_micro_batch_size_per_gpu"] = 2
    apply_dtype(raw, "auto", [])
    shape = models.CATALOG["gpt2-tiny"]
    args = argparse.Namespace(world_size=world_size, seq_len=32)
    result, _ = plan_estimate(shape, raw, args, available=host_memory)
    if host_memory is not None:
        assert result.plan.host_share == host_memory // world_size  # each rank plans with its share of the node
    runtime = _runtime_bytes(json.dumps(raw, sort_keys=True))
    predicted_rss = (result.host_bytes(cuda=False) + runtime) * world_size
    node_rss = measured["peak_rss_sum"]
    print(f"node peak RSS {node_rss / 2**20:.0f} MiB, estimated {predicted_rss / 2**20:.0f} MiB")
    assert abs(predicted_rss - node_rss) <= 0.15 * node_rss, (predicted_rss, measured)
    held = measured["io"]["held_nvme"]  # summed over ranks
    assert abs(result.total(Where.NVME) * world_size - held) <= 0.15 * held, (result.total(Where.NVME), held)
    # The model-dependent host part, on its own (at this size the runtime dominates the RSS): the staging rings
    # the estimate sizes from the units and tiles against the ones the engine allocated.
    rings = sum(row.nbytes for row in result.rows if "staging ring" in row.what) * world_size
    staging = measured["io"]["staging"]  # summed over ranks
    assert abs(rings - staging) <= 0.15 * staging, (rings, staging)


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_cleanly(tmp_path, signum, code):
    """The signal lands inside the training loop (a step line is out: the swap files exist, whichever tiers the
    plan chose) and the run stops with the shell's code, a message and no swap files left behind."""
    swap, log = tmp_path / "swap", tmp_path / "stderr.log"
    command = [sys.executable, "-m", "infinity", "train", "--config", NVME_CONFIG, *SMALL, "--steps", "100000",
               "--nvme-path", str(swap)]  # fmt: skip
    with open(log, "w") as stderr:  # a file, not a pipe: nothing blocks the run while the test waits
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=_env())
        deadline = time.monotonic() + 180
        while not re.search(r"\] step \d+: loss", log.read_text()):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                pytest.fail(f"the run never started training: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        assert _swap_left(str(swap)), "training without its swap files"
        process.send_signal(signum)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail(f"the run did not stop within 60 s of the signal: {log.read_text()[-3000:]}")
    err = log.read_text()
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err and "interrupted after" in err, err[-3000:]
    assert _swap_left(str(swap)) == []


def test_torchrun_two_processes_one_summary(tmp_path):
    """Two ranks on one node told it has 1 GiB of host memory: each plans with half (the summary's node RSS
    against the estimate's for two ranks sharing that node)."""
    swap = tmp_path / "swap"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "-m", "infinity"]  # fmt: skip
    node = 1 << 30
    run = _train(["--steps", "2", "--nvme-path", str(swap), "--summary-json", str(tmp_path / "summary.json")],
                 launcher=launcher, env={memory_plan.HOST_MEMORY_ENV: str(node)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("infinity train: done.") == 1  # rank 0 speaks for the run
    assert "world size 2" in run.stdout
    assert _swap_left(str(swap)) == []
    _estimate_within_15_percent(json.loads((tmp_path / "summary.json").read_text()), world_size=2, host_memory=node)


def _bad(capsys, *argv: str) -> str:
    code = train_main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from infinity.train import models

    unknown = _bad(capsys, "--config", NVME_CONFIG, "--model", "gpt5")
    assert "--model 'gpt5'" in unknown and all(f"{name} (" in unknown for name in models.CATALOG), unknown
    t5 = tmp_path / "t5.json"  # a transformers config, but not of a causal LM: one short line, not every class
    t5.write_text(json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 1, "num_heads": 2, "d_ff": 128}))
    message = _bad(capsys, "--config", NVME_CONFIG, "--model", str(t5))
    assert "model type 't5' is not a causal language model" in message and len(message) < 300, message
    assert "no `latest` file" in _bad(capsys, "--config", NVME_CONFIG, "--resume", str(tmp_path),
                                      "--nvme-path", str(tmp_path / "swap"))  # fmt: skip
    assert "does not exist" in _bad(capsys, "--config", str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimzer": {"type": "AdamW"}}))
    assert "did you mean optimizer" in _bad(capsys, "--config", str(broken))
    broken.write_text("{not json")
    assert "not valid JSON" in _bad(capsys, "--config", str(broken))
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "--nvme-path" in _bad(capsys, "--config", NVME_CONFIG, "--nvme-path", str(a_file / "sub"))
    assert "--steps 0" in _bad(capsys, "--config", NVME_CONFIG, "--steps", "0", "--nvme-path", str(tmp_path))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert "--data" in _bad(capsys, "--config", NVME_CONFIG, "--data", str(short), "--nvme-path", str(tmp_path))
    assert "--nvme-path is empty" in _bad(capsys, "--config", NVME_CONFIG, "--nvme-path", "")
    elsewhere = tmp_path / "elsewhere.json"
    config = json.loads(Path(NVME_CONFIG).read_text())
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["nvme_path"] = str(tmp_path / "no" / "such")
    elsewhere.write_text(json.dumps(config))
    assert "does not exist" in _bad(capsys, "--config", str(elsewhere))  # the config's own nvme_path is not made
    assert not (tmp_path / "no").exists()
    broken.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": 3}))
    assert "zero_optimization must be a JSON object" in _bad(capsys, "--config", str(broken))
    assert "--seed" in _bad(capsys, "--config", NVME_CONFIG, "--seed", str(2**40), "--nvme-path", str(tmp_path))
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD"},
                                 "zero_optimization": {"stage": 1}}))  # fmt: skip
    assert "not divisible" in _bad(capsys, "--config", str(batch), "--micro-batch", "3")
    autos = tmp_path / "autos.json"  # every "auto" nothing fills, in one line, as what to pass or set
    optimizer = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}
    autos.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": "auto"},
                                 "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "optimizer": optimizer}))
    err = _bad(capsys, "--config", str(autos))
    assert ("pass --micro-batch N for train_micro_batch_size_per_gpu; pass --dtype (fp32, bf16 or fp16) for "
            "fp16.enabled and bf16.enabled; set gradient_clipping (0 disables clipping") in err, err
    assert "optimizer.params.lr, optimizer.params.betas in the config" in err and "initialize()" not in err, err


def test_a_run_the_disk_cannot_hold_fails_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """The whole run's need (every rank's swap files, zero.Init's copy beside them during initialize(), and each
    checkpoint --save keeps) against the free space, before the model is built: one line, exit code 2. The free
    space is read through infinity.memory.plan.disk_space, made small here (nothing is filled)."""
    swap, save = tmp_path / "swap", tmp_path / "save"

    def disks(*, swap_free: int, save_free: int):  # --save's folder on a disk of its own
        def space(path: str):
            path = os.path.abspath(path)
            on_save = path.startswith(str(save))
            return memory_plan.Disk(path, 2 if on_save else 1, save_free if on_save else swap_free, 200 << 30)

        return space

    monkeypatch.setattr(memory_plan, "disk_space", disks(swap_free=1 << 20, save_free=100 << 30))
    err = _bad(capsys, "--config", NVME_CONFIG, *SMALL, "--nvme-path", str(swap), "--steps", "1")
    assert "the run needs" in err and f"'{swap}'" in err and "zero.Init's copy" in err and "1.0 MiB free" in err
    assert list(swap.iterdir()) == []

    monkeypatch.setattr(memory_plan, "disk_space", disks(swap_free=100 << 30, save_free=1 << 20))
    err = _bad(capsys, "--config", NVME_CONFIG, *SMALL, "--nvme-path", str(swap), "--steps", "5", "--save",
               str(save), "--save-every", "2")  # fmt: skip
    assert f"'{save}'" in err and "--save: 3 checkpoint(s)" in err and "1.0 MiB free" in err, err
    assert list(swap.iterdir()) == [] and list(save.iterdir()) == []


def test_every_named_model_builds_on_meta_and_is_listed(capsys, monkeypatch):
    """--help and the README list exactly the names --model accepts, each with its parameter count."""
    from infinity.train import models

    for shape in models.CATALOG.values():
        assert models.count_parameters(shape) == shape.numel, shape.name
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: argparse wraps at hyphens
    with pytest.raises(SystemExit):
        train_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert models.named_models() in help_text, help_text
    readme = Path(REPO, "README.md").read_text()
    (line,) = [para for para in readme.split("\n- ") if para.startswith("`--model`:")]
    listed = re.findall(r"`([a-z0-9]+-[a-z0-9]+)`\s+\(([0-9.]+[MB])", line)
    assert listed == [(s.name, models._size(s.numel)) for s in models.CATALOG.values()], listed



def test_a_signal_whose_raise_python_drops_still_stops_the_run():
    """Python drops an exception raised inside a finalizer ("Exception ignored in ..."): a Ctrl-C that lands in
    one would be lost. The run's handler records the signal, and the loop's check raises it again."""
    code = (
        "import gc, os, signal, weakref\n"
        "from infinity.train import interrupt\n"
        "interrupt.install()\n"
        "class Held: pass\n"
        "held = Held()\n"
        "weakref.finalize(held, lambda: [os.kill(os.getpid(), signal.SIGINT)] + list(range(10000)))\n"
        "del held\n"
        "gc.collect()\n"
        "print('dropped', flush=True)\n"
        "interrupt.raise_if_requested()\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert done.stdout.strip() == "dropped" and "Exception ignored" in done.stderr, done.stderr[-2000:]
    # an uncaught KeyboardInterrupt: Python ends by the signal itself
    assert done.returncode == -signal.SIGINT and done.stderr.rstrip().endswith("KeyboardInterrupt"), done.stderr[-2000:]
