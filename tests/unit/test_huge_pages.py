"""torch's host tensors on huge pages ([Note: huge pages] in infinity/memory/host.py): `import infinity` leaves
torch's THP_MEM_ALLOC_ENABLE alone (measured: it cost step time here), a user's own setting stands, and an engine
started where the user's setting came too late says once how to get it. Each case in a fresh interpreter: torch
reads the setting once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infinity.memory.host import kernel_huge_pages

PROBE = "from infinity.memory.host import huge_pages; print(huge_pages())"


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ,
                          check=True)  # fmt: skip


def _kernel_gives_all_memory_huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[always]" in setting.read()
    except OSError:
        return False


@pytest.mark.skipif(_kernel_gives_all_memory_huge_pages(), reason="the kernel's THP is 'always': every block huge")
def test_import_infinity_leaves_torchs_default():
    assert run("import torch, infinity\n" + PROBE).stdout.split() == ["False"]


@pytest.mark.skipif(not kernel_huge_pages(), reason="the kernel has transparent huge pages off")
def test_the_users_setting_stands():
    assert run("import infinity\n" + PROBE, THP_MEM_ALLOC_ENABLE="1").stdout.split() == ["True"]
    if not _kernel_gives_all_memory_huge_pages():
        assert run("import infinity\n" + PROBE, THP_MEM_ALLOC_ENABLE="0").stdout.split() == ["False"]


@pytest.mark.skipif(not kernel_huge_pages(), reason="the kernel has transparent huge pages off")
def test_an_engine_started_too_late_for_them_says_how_to_get_them():
    code = """
import os
import torch
model = torch.nn.Linear(4, 4)  # torch's first tensors, before the user asks for huge pages
os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
import infinity
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
for _ in range(2):
    engine, *_ = infinity.initialize(model=torch.nn.Linear(4, 4), config=config)
    engine.destroy()
"""
    said = [line for line in run(code).stderr.splitlines() if "THP_MEM_ALLOC_ENABLE=1" in line]
    assert len(said) == 1, said
