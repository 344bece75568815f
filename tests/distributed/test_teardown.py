"""Clean exits and no hangs: scripts that end without teardown, a rank that dies or stops mid-step, and a
collective API called on one rank only. Real processes (torchrun, or spawned over gloo)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import infinity
import infinity.zero
from infinity.errors import CollectiveUsageError
from tests.distributed.harness import THREADS_AT_EXIT, _entry, assert_no_thread_outlives, run_distributed

SCRIPT_WITHOUT_TEARDOWN = THREADS_AT_EXIT + textwrap.dedent(
    """
    import sys, torch, infinity
    torch.set_num_threads(1)
    START = threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if len(sys.argv) > 1:  # the optimizer on NVMe: the last step is still pending behind the forward at exit
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": sys.argv[1]}
    engine, *_ = infinity.initialize(model=model, config=config)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    print("trained", engine.global_rank, flush=True)
    # no destroy(), no barrier, no destroy_process_group(): the script just ends
    """
)


def run_script_without_teardown(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "no_teardown.py"
    script.write_text(SCRIPT_WITHOUT_TEARDOWN)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
               "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # no CUDA threads at exit
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)


def assert_clean_exit(done: subprocess.CompletedProcess, ranks: int = 2) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("trained") == ranks, done.stdout
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    # No thread the engine or its process groups started outlives the interpreter: gloo's, still running as it
    # finalizes, can abort the process ([Note: teardown]).
    assert_no_thread_outlives(done.stdout, ranks)


def test_a_script_that_ends_without_teardown_exits_cleanly(tmp_path):
    for _ in range(2):  # -m stress runs it 30 times
        assert_clean_exit(run_script_without_teardown(tmp_path))


def test_a_script_that_ends_with_a_step_behind_the_forward_exits_cleanly(tmp_path):
    """The optimizer on NVMe: the last engine.step() leaves its tiles to the next forward, which never comes. The
    script still exits cleanly, and the swap files go with it."""
    swap = tmp_path / "swap"
    swap.mkdir()
    assert_clean_exit(run_script_without_teardown(tmp_path, str(swap)))
    assert not [p for p in swap.rglob("*") if p.is_file()], "swap files left behind"


SCRIPT_DESTROYING_ITS_OWN_GROUP = THREADS_AT_EXIT + textwrap.dedent(
    """
    import infinity  # before the group, as scripts do: it loads nothing of torch.distributed yet
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    START = threads()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = infinity.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    engine.step()
    print("trained", flush=True)
    dist.destroy_process_group()  # the user's group, destroyed by the user; the engine is never destroyed
    """
)


def test_a_group_the_user_made_and_destroyed_is_let_go_of_before_exit(tmp_path):
    """The engine's Comms, and torch.distributed.nn.functional's default arguments (evaluated when the optimizer
    first imports it, after the group exists), no longer keep the destroyed group's gloo threads alive."""
    script = tmp_path / "own_group.py"
    script.write_text(SCRIPT_DESTROYING_ITS_OWN_GROUP)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # no CUDA threads at exit
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          check=False)  # fmt: skip
    assert_clean_exit(done, ranks=1)


@pytest.mark.stress
def test_thirty_runs_without_teardown_all_exit_cleanly(tmp_path):
    """Before the engine owned its teardown, 3-10% of such runs aborted with SIGABRT. Run with `-m stress`."""
    failures = []
    for attempt in range(30):
        done = run_script_without_teardown(tmp_path)
        if done.returncode != 0 or "terminate called" in done.stderr:
            failures.append((attempt, done.returncode, done.stderr[-500:]))
    assert not failures, failures


# ---- a rank that dies or stops ----

TIMEOUT_S = 6.0


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def stage3_config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "collective_timeout": TIMEOUT_S,
        **extra,
    }  # fmt: skip


def _rank_one_stops(rank: int, world_size: int, how: str, stage: int) -> None:
    config = stage3_config()
    config["zero_optimization"]["stage"] = stage
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    for step in range(4):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL if how == "dies" else signal.SIGSTOP)
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()


@pytest.mark.parametrize(("how", "stage", "group"), [("dies", 3, "ZeRO-3 fetch"), ("stops", 3, "ZeRO-3 fetch"),
                                                     ("stops", 2, "data-parallel")])  # fmt: skip
def test_a_rank_that_dies_or_stops_mid_step_fails_the_other_within_the_timeout(how, stage, group, tmp_path):
    """Rank 1 is killed (SIGKILL) or stopped (SIGSTOP) at the start of step 2. Rank 0 must raise an error naming
    the collective and the timeout, within the timeout (plus start-up), instead of waiting forever. The default
    group here is the test's own (gloo's 30-minute timeout): the engine reduces over a group of its own."""
    kwargs = {"how": how, "stage": stage}
    context = mp.start_processes(
        _entry, args=(2, str(tmp_path), _rank_one_stops, kwargs), nprocs=2, join=False, start_method="spawn"
    )
    result = tmp_path / "result-0.pkl"
    started = time.monotonic()
    rank0 = context.processes[0]
    try:
        rank0.join(timeout=120)  # it writes its result, then exits
        elapsed = time.monotonic() - started
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    assert elapsed < 120 and result.exists(), "rank 0 neither finished nor failed within 120 s: it hangs"
    with open(result, "rb") as f:
        status, value = pickle.load(f)
    assert status == "error", value
    assert "CollectiveError" in value and f"on the {group} group" in value, value[-2000:]
    assert "collective_timeout" in value and f"{TIMEOUT_S:g} s" in value, value[-2000:]
    assert elapsed < 60 + TIMEOUT_S, elapsed  # spawning two interpreters and building takes ~10-20 s here


# ---- collective APIs called on one rank ----


def _save_on_rank_zero_only(rank: int, world_size: int, out_dir: str, other: str) -> str:
    engine, *_ = infinity.initialize(model=mlp(), config=stage3_config())
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    engine.step()
    try:
        if rank == 0:
            engine.save_16bit_model(out_dir)
        elif other == "GatheredParameters":
            with infinity.zero.GatheredParameters(list(engine.module.parameters())):
                pass
        else:
            time.sleep(TIMEOUT_S + 2)  # busy elsewhere, longer than the timeout
        return "no error"
    except CollectiveUsageError as e:
        return str(e)


def test_save_16bit_model_on_one_rank_is_a_clear_error_after_the_timeout(tmp_path):
    message, other = run_distributed(_save_on_rank_zero_only, 2, tmp_path, timeout_s=120, other="nothing",
                                     out_dir=str(tmp_path))  # fmt: skip
    assert "save_16bit_model is a collective call" in message, message
    assert f"rank(s) [1] did not make this call within {TIMEOUT_S:g} s" in message, message
    assert other == "no error"


def test_different_collective_calls_on_two_ranks_name_each_other(tmp_path):
    message, other = run_distributed(_save_on_rank_zero_only, 2, tmp_path, timeout_s=120, other="GatheredParameters",
                                     out_dir=str(tmp_path))  # fmt: skip
    assert "save_16bit_model is a collective call" in message and "rank 1 called GatheredParameters" in message
    assert "GatheredParameters is a collective call" in other and "rank 0 called save_16bit_model" in other
