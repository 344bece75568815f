"""`infinity report`, `infinity --version` and `python -m infinity`: every promised line, the exit code, and
the broken cases naming what is broken."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinity import report
from infinity.cli import main as cli_main
from infinity.errors import AioError
from infinity.mounts import Mount, find_mount

REPO = Path(__file__).resolve().parents[2]
NAMES = [
    "python", "torch", "transformers", "infinity", "CUDA", "distributed", "I/O core", "kernel AIO", "nvme path",
    "O_DIRECT", "buffered I/O", "free space", "memlock limit", "pinned memory", "THP enabled", "THP defrag",
    "CPUs", "RAM",
]  # fmt: skip


def run_report(capsys, *argv: str) -> tuple[int, list[str]]:
    code = cli_main(["report", *argv])
    return code, capsys.readouterr().out.splitlines()


def line(lines: list[str], name: str) -> str:
    found = [x for x in lines if x[2:].startswith(name + ":")]
    assert len(found) == 1, (name, lines)
    return found[0]


def test_prints_every_item_and_exits_0_on_a_writable_folder(tmp_path, capsys):
    code, lines = run_report(capsys, "--nvme-path", str(tmp_path))
    assert code == 0, "\n".join(lines)
    for name in NAMES:
        line(lines, name)
    assert torch.__version__ in line(lines, "torch")
    assert importlib.metadata.version("infinity") in line(lines, "infinity")
    assert "linux-native-aio" in line(lines, "I/O core")
    assert str(tmp_path) in line(lines, "nvme path") and "filesystem" in line(lines, "nvme path")
    assert any(w in line(lines, "O_DIRECT") for w in ("works", "refused"))
    assert "free of" in line(lines, "free space")
    assert "unlimited" in line(lines, "memlock limit") or "bytes" in line(lines, "memlock limit")
    assert "usable" in line(lines, "CPUs") and "total" in line(lines, "RAM")
    assert lines[-1].startswith("ok: everything needed works")
    assert os.listdir(tmp_path) == []  # the probes are removed


def test_every_line_is_aligned_and_each_warning_says_what_to_do(tmp_path, capsys):
    _, lines = run_report(capsys, "--nvme-path", str(tmp_path))
    rows = [x for x in lines[:-1] if not x.lstrip().startswith("fix:")]
    starts = {len(x) - len(x[x.index(":") + 1 :].lstrip()) for x in rows}  # where each value begins
    assert len(starts) == 1, rows
    for i, x in enumerate(lines[:-1]):
        if x.startswith("!"):
            assert lines[i + 1].lstrip().startswith("fix:"), x


def test_missing_nvme_path_is_broken_and_named_not_created(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, lines = run_report(capsys, "--nvme-path", str(missing))
    assert code == 1
    assert lines[-1].startswith("broken: nvme path: ") and str(missing) in lines[-1]
    assert "does not exist" in lines[-1]
    assert "mkdir -p" in "\n".join(lines)
    assert not missing.exists()


def test_nvme_path_under_a_regular_file_is_broken(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "sub"
    code, lines = run_report(capsys, "--nvme-path", str(path))
    assert code == 1 and str(path) in lines[-1], lines[-1]


def test_unwritable_nvme_path_is_broken(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a read-only mode does not stop root from writing")
        code, lines = run_report(capsys, "--nvme-path", str(folder))
    finally:
        folder.chmod(0o755)
    assert code == 1
    assert "not writable" in lines[-1] and str(folder) in lines[-1]


def test_a_file_as_nvme_path_is_broken(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    code, lines = run_report(capsys, "--nvme-path", str(path))
    assert code == 1 and "is not a folder" in lines[-1] and str(path) in lines[-1]


def test_io_core_not_importable_is_broken(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "infinity._aio", None)  # import raises ImportError
    code, lines = run_report(capsys, "--nvme-path", str(tmp_path))
    assert code == 1
    assert lines[-1].startswith("broken: I/O core: infinity._aio cannot be loaded"), lines[-1]
    assert "rebuild" in "\n".join(lines)


def test_kernel_aio_refused_is_broken(tmp_path, capsys, monkeypatch):
    from infinity.aio import core

    def refuse(max_events):
        raise AioError(op="io_setup(1)", path="<aio context>", offset=0, errno=11, detail="fs.aio-max-nr exhausted")

    monkeypatch.setattr(core, "AioContext", refuse)
    code, lines = run_report(capsys, "--nvme-path", str(tmp_path))
    assert code == 1 and "kernel AIO: io_setup refused (EAGAIN)" in lines[-1], lines[-1]
    assert "fs.aio-max-nr" in "\n".join(lines)


def test_o_direct_refused_is_a_warning_not_breakage(tmp_path, capsys, monkeypatch):
    from infinity.aio import files

    real_open_file = files.open_file
    monkeypatch.setattr(files, "open_file", lambda path, **kw: real_open_file(path, **{**kw, "direct": False}))
    code, lines = run_report(capsys, "--nvme-path", str(tmp_path))
    assert code == 0
    assert line(lines, "O_DIRECT").startswith("! O_DIRECT:") and "buffered" in line(lines, "O_DIRECT")
    assert "works" in line(lines, "buffered I/O")


def test_thp_never_is_a_warning(tmp_path, monkeypatch):
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    (tmp_path / "defrag").write_text("always defer defer+madvise [madvise] never\n")
    monkeypatch.setattr(report, "THP_DIR", str(tmp_path))
    enabled, defrag = report.check_thp()
    assert (enabled.value, enabled.level) == ("never", report.Level.WARN) and "madvise" in enabled.fix
    assert (defrag.value, defrag.level) == ("madvise", report.Level.OK)


def test_find_mount_takes_the_longest_mount_point():
    mountinfo = "\n".join(
        [
            "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
            "23 22 0:5 / /mnt/fast rw shared:2 - xfs /dev/nvme0n1 rw",
            "24 22 0:6 / /mnt/fast\\040disk rw - tmpfs tmpfs rw",
        ]
    )
    assert find_mount("/mnt/fast/swap", mountinfo) == Mount("/mnt/fast", "xfs", "/dev/nvme0n1")
    assert find_mount("/mnt/fast disk/x", mountinfo).fstype == "tmpfs"
    assert find_mount("/mnt/faster", mountinfo).fstype == "ext4"


def test_small_parsers():
    assert report.bracketed("always [madvise] never") == "madvise"
    assert report.bracketed("") is None
    assert report.meminfo_bytes("MemTotal:  1024 kB\nMemAvailable: 512 kB\n", "MemAvailable") == 512 * 1024
    assert report.format_bytes(3 << 30) == "3.0 GiB"


def test_version_in_process(capsys):
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"infinity {importlib.metadata.version('infinity')}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def test_python_dash_m_version():
    done = subprocess.run(
        [sys.executable, "-m", "infinity", "--version"], capture_output=True, text=True, env=_env(), check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"infinity {importlib.metadata.version('infinity')}"


def test_python_dash_m_report(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "infinity", "report", "--nvme-path", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("ok:")
