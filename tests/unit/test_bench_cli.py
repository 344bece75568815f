"""`infinity aio-bench`: option parsing, a small real run, tune output, refusals."""

import io
import json
import os
import re
import signal
import sys

import pytest

from infinity.aio import bench
from infinity.cli import main as cli_main
from infinity.config import parse_aio


@pytest.mark.parametrize(
    "text,value", [("4G", 4 << 30), ("512K", 512 << 10), ("1m", 1 << 20), ("4096", 4096), ("2GiB", 2 << 30)]
)
def test_size_suffixes(text, value):
    assert bench.parse_size(text) == value


@pytest.mark.parametrize("text", ["3X", "-1", "1.5G", "", "0"])
def test_bad_sizes(text):
    with pytest.raises(Exception, match="size"):
        bench.parse_size(text)


def test_lists_expand_into_a_sweep():
    args = bench.build_parser().parse_args(
        ["--block-size", "1M,4M", "--queue-depth", "8,32", "--intra-op-parallelism", "1,2", "--both"]
    )
    cases = bench.expand_cases(args)
    assert len(cases) == 16
    assert {(c.block_size, c.queue_depth, c.intra_op_parallelism) for c in cases} == {
        (bs, qd, t) for bs in (1 << 20, 4 << 20) for qd in (8, 32) for t in (1, 2)
    }
    assert {c.op for c in cases} == {"read", "write"}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--block-size", "3"], "multiple of 4096"),
        (["--block-size", "1M,5000"], "5000 is not a multiple of 4096"),
        (["--queue-depth", "-1"], "must be >= 1"),
        (["--queue-depth", "0"], "must be >= 1"),
        (["--intra-op-parallelism", "two"], "not a whole number"),
        (["--io-size=-4G"], "not a size"),
        (["--loops", "0"], "must be >= 1"),
        (["--warmup", "-2"], "--warmup"),
    ],
)
def test_bad_values_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_small_real_run_writes_table_and_json_and_removes_its_file(tmp_path, capsys):
    folder = tmp_path / "disk"
    folder.mkdir()
    json_path, plot_path = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["aio-bench", "--folder", str(folder), "--io-size", "64M", "--json", str(json_path)]
    assert cli_main(argv + ["--plot", str(plot_path), "--loops", "2"]) == 0
    out = capsys.readouterr().out
    assert "GB/s (1 GB = 1e9 bytes)" in out and "write bs=1M qd=8" in out and "read bs=1M qd=8" in out
    result = json.loads(json_path.read_text())
    assert [r["op"] for r in result["rows"]] == ["write", "read"]
    for row in result["rows"]:
        assert len(row["gbps"]) == 2 and row["median_gbps"] > 0
    assert result["location"]["direct_io"] is True
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(folder) == []  # the test file and its folder are gone


def test_streaming_through_a_small_buffer(tmp_path, capsys):
    argv = ["--folder", str(tmp_path), "--io-size", "32M", "--buffer-size", "8M", "--loops", "1", "--warmup", "0"]
    assert bench.main(argv) == 0
    assert "host buffer 8M" in capsys.readouterr().out


def test_tune_prints_an_aio_block_the_config_parser_accepts(tmp_path, capsys):
    argv = ["--tune", "--folder", str(tmp_path), "--io-size", "16M", "--loops", "1", "--warmup", "0"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "best read:" in out and "best write:" in out
    block = json.loads(re.search(r'"aio": (\{.*?\})', out, re.S).group(1))
    settings = parse_aio(block)
    assert settings.block_size in (512 << 10, 1 << 20, 4 << 20) and settings.queue_depth in (8, 32)


def test_missing_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--folder", str(tmp_path / "nope"), "--io-size", "8M"])
    assert info.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_too_little_free_space_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--folder", str(tmp_path), "--io-size", "900T"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "GB free" in err and "--io-size" in err
    assert os.listdir(tmp_path) == []


def test_vs_fio_without_fio_says_so_and_carries_on(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    assert bench.main(["--vs-fio", "--folder", str(tmp_path), "--io-size", "8M", "--loops", "1"]) == 0
    assert "fio is not on PATH" in capsys.readouterr().out


def test_vs_fio_with_fio_reports_a_ratio(tmp_path, capsys):
    if not bench.shutil.which("fio"):
        pytest.skip("fio is not installed")
    json_path = tmp_path / "r.json"
    argv = ["--vs-fio", "--folder", str(tmp_path), "--io-size", "32M", "--loops", "1", "--json", str(json_path)]
    assert bench.main(argv) == 0
    rows = json.loads(json_path.read_text())["rows"]
    assert all(row["fio_gbps"]["malloc"] > 0 and row["ratio_vs_best_fio"] > 0 for row in rows)


def _tiny(folder, *extra):
    return ["--folder", str(folder), "--io-size", "4M", "--loops", "1", "--warmup", "0", *extra]


def _no_measuring(monkeypatch):
    def refuse(self, case):
        raise AssertionError("measured before the output paths were checked")

    monkeypatch.setattr(bench.Engine, "run", refuse)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_path_in_a_missing_folder_is_refused_before_measuring(option, tmp_path, capsys, monkeypatch):
    _no_measuring(monkeypatch)
    folder = tmp_path / "disk"
    folder.mkdir()
    target = tmp_path / "missing" / "out.file"
    with pytest.raises(SystemExit) as info:
        bench.main(_tiny(folder, option, str(target)))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{option} {str(target)!r}" in err and "does not exist" in err and "create it" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert os.listdir(folder) == []  # no test file, no work folder


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_path_that_is_a_folder_is_refused(option, tmp_path, capsys, monkeypatch):
    _no_measuring(monkeypatch)
    with pytest.raises(SystemExit) as info:
        bench.main(_tiny(tmp_path, option, str(tmp_path)))
    assert info.value.code == 2
    assert f"{option} {str(tmp_path)!r} is a directory" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_output_path_in_a_read_only_folder_is_refused_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    _no_measuring(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permission bits do not stop writes")
        with pytest.raises(SystemExit) as info:
            bench.main(_tiny(tmp_path, "--json", str(locked / "r.json")))
        assert info.value.code == 2
        assert "is not writable" in capsys.readouterr().err
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o700)


def test_plot_without_matplotlib_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    _no_measuring(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(SystemExit) as info:
        bench.main(_tiny(tmp_path, "--plot", str(tmp_path / "r.png")))
    assert info.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_help_gives_every_default_and_what_tune_sweeps_and_writes(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere there is a space
    for default in (
        "the default when none of --read, --write, --both is given",
        "1M or 1M,4M (default: 1M)",
        "8 or 8,32 (default: 8)",
        "1 or 1,2 (default: 1)",
        "(default: 4G)",
        "median, min and max (default: 3)",
        "before the timed ones (default: 1)",
        "(default: the current folder)",
        "(default: io-size, one tensor)",
    ):
        assert default in text
    assert f"sweep {bench.TUNE_SETTINGS} settings per op" in text and "512K,1M,4M" in text
    assert f"{bench.tune_write_bytes(4 << 30, 1, 3) / (1 << 30):g} GiB with the defaults" in text
    assert bench.tune_write_bytes(4 << 30, 1, 3) == (24 * 4 + 1) * (4 << 30)


def test_not_a_terminal_gets_one_line_per_case_and_no_redraws(tmp_path, capsys):
    assert bench.main(_tiny(tmp_path, "--block-size", "1M,4M")) == 0
    captured = capsys.readouterr()  # pytest's captured streams are not terminals
    assert "\r" not in captured.err and "\r" not in captured.out
    lines = captured.err.strip().splitlines()
    assert [line.split("]")[0] for line in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert "GB/s median" in lines[0]


def test_a_terminal_gets_a_bar_redrawn_in_place():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    case = bench.Case("write", 1 << 20, 8, 1, False, True, False)
    progress = bench.Progress(2, stream)
    for index in range(2):
        progress.start(index, case)
        progress.finish(index, bench.Row(case, [1.0]))
    progress.close()
    assert stream.getvalue().count("\r") == 3 and stream.getvalue().endswith("\n")
    assert stream.getvalue().count("\n") == 1


def test_write_cache_note_only_when_writes_beat_reads():
    def row(op, gbps):
        return bench.Row(bench.Case(op, 1 << 20, 8, 1, False, True, False), [gbps])

    note = bench.write_cache_note([row("write", 3.0), row("read", 2.0)])
    assert "write cache" in note and "reads are the honest figure" in note and "3.00 vs 2.00" in note
    assert bench.write_cache_note([row("write", 1.0), row("read", 2.0)]) is None
    assert bench.write_cache_note([row("write", 3.0)]) is None  # nothing to compare with


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupt_prints_the_rows_so_far_and_exits_130(how, tmp_path, capsys, monkeypatch):
    real_run, calls = bench.Engine.run, []

    def interrupt_the_read(self, case):  # real I/O until the read case, then the interrupt
        calls.append(case.op)
        if len(calls) == 3:  # 1: the untimed file for reads, 2: the write case, 3: the read case
            if how == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # main's handler turns it into KeyboardInterrupt
        return real_run(self, case)

    monkeypatch.setattr(bench.Engine, "run", interrupt_the_read)
    json_path = tmp_path / "r.json"
    folder = tmp_path / "disk"
    folder.mkdir()
    assert bench.main(_tiny(folder, "--json", str(json_path))) == 130
    captured = capsys.readouterr()
    assert "INTERRUPTED after 1 of 2 settings" in captured.out
    assert "write bs=1M qd=8 t=1" in captured.out and "read bs=1M" not in captured.out
    assert "Traceback" not in captured.err
    result = json.loads(json_path.read_text())
    assert result["interrupted"] is True and [r["op"] for r in result["rows"]] == ["write"]
    assert os.listdir(folder) == []


def test_the_measured_folder_is_named(tmp_path, capsys):
    json_path = tmp_path / "r.json"
    folder = tmp_path / "disk"
    folder.mkdir()
    assert bench.main(_tiny(folder, "--write", "--json", str(json_path))) == 0
    result = json.loads(json_path.read_text())
    filesystem = result["location"]["filesystem"]
    assert f"measured {os.path.realpath(folder)} ({filesystem} on" in capsys.readouterr().out
    assert result["measured_folder"] == os.path.realpath(folder)
