"""`infinity estimate` prints what it promises: rows per tier, the totals, the host RSS with the runtime, and the
largest model of the family that fits; the arithmetic follows the engine's layout (against a real run: see
test_train_cli.py); bad input is one line and exit code 2."""

import os
import re
from unittest import mock

import pytest

from infinity import estimate as estimate_cli
from infinity.budget import Where

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prints_tiers_rss_and_the_largest_fitting_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(estimate_cli, "runtime_bytes", lambda shape, raw: 300 << 20)  # measured in the other test
    code = estimate_cli.main(["--model", "gpt2-small", "--config", os.path.join(REPO, "configs", "zero3-nvme.json"),
                              "--nvme-path", str(tmp_path), "--json", str(tmp_path / "e.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "gpt2-small: 124.4M parameters" in out
    rows = ("parameter pieces", "fp32 master weights", "optimizer states", "parameter staging ring", "gathered units",
            "activations", "host RSS", "0.293 GiB runtime", "for 1 rank(s): ")
    for row in rows:
        assert row in out, out
    assert re.search(r"largest gpt2 that fits: gpt2-\w+|no gpt2 fits", out), out  # depends on this machine
    assert (tmp_path / "e.json").exists()


def test_world_size_divides_the_states():
    import argparse
    import json
    from pathlib import Path

    from infinity.train import models

    raw = json.loads(Path(REPO, "configs", "zero3-nvme.json").read_text())
    raw["bf16"] = {"enabled": False}  # fp32 weights
    shape = models.CATALOG["gpt2-small"]
    described = estimate_cli.describe(shape)

    def at(world_size: int):
        args = argparse.Namespace(world_size=world_size, seq_len=128)
        return estimate_cli.plan_estimate(shape, raw, args, owners_arch=described)[0]

    one, two = at(1), at(2)
    assert two.total(Where.NVME) == pytest.approx(one.total(Where.NVME) / 2, rel=0.01)
    # 124.4M parameters x (4 bytes of weights + 12 of master and Adam states), on NVMe, and 4 of gradient: on NVMe
    # too where a quarter of the host share does not hold it (the plan's gradients_on_nvme), else in host memory
    (gradient,) = [row for row in one.rows if row.what.startswith("reduced fp32 gradient")]
    assert gradient.where in ({Where.NVME} if one.plan.gradients_on_nvme else {Where.HOST, Where.HOST_PINNED})
    assert gradient.nbytes == pytest.approx(124.4e6 * 4, rel=0.01)
    assert one.total(Where.NVME) == pytest.approx(124.4e6 * (16 + 4 * one.plan.gradients_on_nvme), rel=0.01)


def test_the_step_in_backward_holds_no_whole_gradient():
    """[Note: step in backward]: stage 3 with the optimizer in host memory and nothing that needs the whole gradient
    steps unit by unit in backward, so the estimate counts no reduced gradient; clipping (the shipped config's),
    the key false, accumulation, fp16, another optimizer class or split masters each bring back the rank's share
    (4 bytes an element). With CUDA what stays is the one host buffer the reduced pieces are copied into."""
    import argparse
    import json
    from pathlib import Path

    from infinity.train import models

    shape = models.CATALOG["gpt2-small"]
    described = estimate_cli.describe(shape)

    def gradient_bytes(cuda: bool = False, **changes) -> int:
        raw = json.loads(Path(REPO, "configs", "zero3-offload-cpu.json").read_text())
        raw.update(changes)
        args = argparse.Namespace(world_size=2, seq_len=128)
        with mock.patch("torch.cuda.is_available", return_value=cuda):  # the estimate's own question, asked here
            found = estimate_cli.plan_estimate(shape, raw, args, owners_arch=described)[0]
        (row,) = [row for row in found.rows if row.what.startswith("reduced fp32 gradient")]
        return row.nbytes

    assert gradient_bytes(gradient_clipping=0) == 0
    widest_piece = 38_597_376 // 2  # the tied embedding's unit, half a rank's (padded)
    assert gradient_bytes(cuda=True, gradient_clipping=0) == pytest.approx(widest_piece * 4, rel=0.01)
    share = 124.4e6 / 2 * 4
    assert gradient_bytes() == pytest.approx(share, rel=0.01)  # clips at 1.0
    for changes in ({"infinity": {"step_in_backward": False}}, {"gradient_accumulation_steps": 2},
                    {"fp16": {"enabled": True}, "bf16": {"enabled": False}}, {"optimizer": {"type": "Adagrad"}},
                    {"infinity": {"offloaded_master": "split"}}):
        assert gradient_bytes(gradient_clipping=0, **changes) == pytest.approx(share, rel=0.01), changes


@pytest.mark.parametrize("state_dtype,gradient_dtype", [("fp32", "fp32"), ("int8", "fp32"), ("int8", "bf16")])
def test_compact_states_and_the_gradient_ring(state_dtype, gradient_dtype):
    """With int8 states the tiles hold 4 + 2 x 1.0625 bytes an element instead of 12 (and one tile's states are
    decoded in host memory); with the gradient on NVMe (a host of 1 GiB) its staging ring is counted, whatever
    the states' dtype, and with a bf16 gradient it takes 2 bytes an element there (one tile's decoded in fp32)."""
    import argparse
    import json
    from pathlib import Path

    from infinity.train import models

    raw = json.loads(Path(REPO, "configs", "zero3-nvme.json").read_text())
    raw["bf16"] = {"enabled": False}
    raw["infinity"] = {"optimizer_state_dtype": state_dtype, "offloaded_gradient_dtype": gradient_dtype}
    shape = models.CATALOG["gpt2-small"]
    args = argparse.Namespace(world_size=1, seq_len=128)
    described = estimate_cli.describe(shape)
    result = estimate_cli.plan_estimate(shape, raw, args, available=1 << 30, owners_arch=described)[0]
    assert result.plan.gradients_on_nvme
    (states,) = [row for row in result.rows if row.what.startswith("fp32 master weights and optimizer states")]
    per_element = 4 + (2 * (1 + 4 / 64) if state_dtype == "int8" else 8)
    assert states.nbytes == pytest.approx(124.4e6 * per_element, rel=0.01)
    whats = [row.what for row in result.rows]
    assert "gradient staging ring" in whats
    assert any(w.startswith("decoded int8") for w in whats) == (state_dtype == "int8")
    (gradient,) = [row for row in result.rows if row.what.endswith("gradient (this rank's share)")]
    assert gradient.what.startswith(f"reduced {gradient_dtype} gradient")
    assert gradient.nbytes == pytest.approx(124.4e6 * (2 if gradient_dtype == "bf16" else 4), rel=0.01)
    assert ("decoded gradient of one tile" in whats) == (gradient_dtype == "bf16")


def test_split_masters_take_two_bytes_an_element():
    """bf16 weights with infinity.offloaded_master "split": the tiles hold the 2-byte residual and int8 states
    (2 + 2 x 1.0625 bytes an element), and one tile's joined master is counted in host memory."""
    import argparse
    import json
    from pathlib import Path

    from infinity.train import models

    raw = json.loads(Path(REPO, "configs", "zero3-nvme.json").read_text())
    raw["infinity"] = {"optimizer_state_dtype": "int8", "offloaded_master": "split"}
    shape = models.CATALOG["gpt2-small"]
    args = argparse.Namespace(world_size=1, seq_len=128)
    result = estimate_cli.plan_estimate(shape, raw, args, owners_arch=estimate_cli.describe(shape))[0]
    (states,) = [row for row in result.rows if row.what.startswith("split master weights (16 bits each) and")]
    assert states.where is Where.NVME
    assert states.nbytes == pytest.approx(124.4e6 * (2 + 2 * (1 + 4 / 64)), rel=0.01)
    (joined,) = [row for row in result.rows if row.what == "joined split master of one tile"]
    # a tile is the plan's tile_numel here (gpt2-small's embedding, 38.6M elements, is cut into such tiles):
    # fp32 master 4, int32 bits 4, a bf16 rounding 2 bytes an element
    assert result.plan.tile_numel < 38_597_376
    assert joined.where is Where.HOST and joined.nbytes == result.plan.tile_numel * 10


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt5"], "--model 'gpt5'"),
    (["--config", "missing.json"], "does not exist"),
    (["--world-size", "0"], "--world-size 0"),
])  # fmt: skip
def test_bad_input(argv, message, capsys):
    config = os.path.join(REPO, "configs", "zero2.json")
    args = ["--config", config, *argv] if "--config" not in argv else argv
    assert estimate_cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_config_that_is_not_a_causal_lm(tmp_path, capsys):
    t5 = tmp_path / "t5.json"
    t5.write_text('{"model_type": "t5", "d_model": 64, "num_layers": 1, "num_heads": 2, "d_ff": 128}')
    assert estimate_cli.main(["--config", os.path.join(REPO, "configs", "zero2.json"), "--model", str(t5)]) == 2
    err = capsys.readouterr().err.strip()
    assert "model type 't5' is not a causal language model" in err and len(err) < 300, err


def test_unfilled_auto_values_all_at_once_in_the_commands_terms(tmp_path, capsys):
    config = tmp_path / "auto.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto", "fp16": {"enabled": "auto"},'
                      ' "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2}}')
    assert estimate_cli.main(["--config", str(config), "--model", "gpt2-tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "initialize()" not in err, err
    for said in ("infinity estimate cannot fill", "pass --dtype", "fp16.enabled", "gradient_clipping", "lr"):
        assert said in err, err
