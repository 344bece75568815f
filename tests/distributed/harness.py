"""Run a function in N real processes over gloo, with a hard timeout, and collect what each returns.

Processes start from a fork server (an interpreter that preloaded torch and the engine), rendezvous through a
file, and return results through files: no mocked collectives. A run that exceeds its timeout is killed and
fails the test (a hang is a bug).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Children fork from a server that has already imported torch and the engine: each run saves the ~1-2 s a
# spawned interpreter spends importing them (the suite starts hundreds). torch._dynamo too: torch.optim imports
# it when a process builds its first optimizer (measured: 0.56 s instead of 6.3 s for a child's first engine on
# the 2 loaded cores). The server itself never initializes a process group or a thread pool (nor does that import
# start a thread), so what the children inherit is only the imported modules.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "infinity.engine", "tests.distributed.harness"]
mp.set_forkserver_preload(FORKSERVER_PRELOAD)


def _entry(rank: int, world_size: int, workdir: str, fn, kwargs: dict, environ: dict | None = None) -> None:
    if environ is not None:  # the test's environment now, not the fork server's from when it started
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    result_path = os.path.join(workdir, f"result-{rank}.pkl")
    try:
        if world_size > 1:
            dist.init_process_group(
                "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size
            )
        result = fn(rank=rank, world_size=world_size, **kwargs)
        if dist.is_initialized():
            # Nobody tears gloo down while a peer still uses the connection: gloo aborts (SIGABRT) on a
            # pair closed under it. Only on success: after an error the peer may never arrive.
            dist.barrier()
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - report anything to the parent
        payload = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(result_path, "wb") as f:
        pickle.dump(payload, f)


def run_distributed(fn, world_size: int, workdir, *, timeout_s: float = 300.0, **kwargs) -> list:
    """fn(rank=, world_size=, **kwargs) in each process; returns the per-rank results."""
    workdir = str(workdir)
    args = (world_size, workdir, fn, kwargs, dict(os.environ))
    context = mp.start_processes(_entry, args=args, nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"distributed run did not finish in {timeout_s:.0f} s (a hang?)")
    results = []
    for rank in range(world_size):
        with open(os.path.join(workdir, f"result-{rank}.pkl"), "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results.append(value)
    return results


# [Note: teardown] in infinity/distributed.py: a script's first lines, so that its atexit hook runs last and prints
# how many threads still run as the interpreter finalizes (one write: the ranks share the pipe); the script sets
# START once torch is imported. A joined thread can stay listed a moment: up to 1 s for the count to fall.
THREADS_AT_EXIT = """
import atexit, os, time
threads = lambda: len(os.listdir("/proc/self/task"))
def settled():
    for _ in range(100):
        if threads() <= START:
            break
        time.sleep(0.01)
    return threads()
atexit.register(lambda: os.write(1, f"threads at exit {settled()} of {START}\\n".encode()))
"""


def assert_no_thread_outlives(stdout: str, ranks: int) -> None:
    """Every rank ended with no more threads than it had before the engine (THREADS_AT_EXIT)."""
    at_exit = [line.split() for line in stdout.splitlines() if line.startswith("threads at exit")]
    assert len(at_exit) == ranks and all(int(words[3]) <= int(words[5]) for words in at_exit), stdout
