"""`infinity aio-bench`: option parsing, a small real run, tune output, refusals."""

import json
import os
import re

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
