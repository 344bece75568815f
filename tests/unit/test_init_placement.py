"""zero.Init puts each piece in its home tier as the module is built ([Note: zero.Init]): NVMe, host memory or the
compute device, from remote_device or else the config's offload_param, as DeepSpeed does. Here the host is the
compute device, so what is checked is the choice; tests/gpu checks the device's peak while a model is built."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity.zero
from infinity.zero.init import init_shard


@pytest.mark.parametrize(
    "config_device,remote_device,home",
    [("none", None, "device"), ("cpu", None, "host"), ("nvme", None, "nvme"), (None, None, "device"),
     (None, "cpu", "host"), ("none", "cpu", "host"), ("nvme", "cpu", "host"), ("cpu", "none", "device"),
     ("cpu", "nvme", "nvme")],
)  # fmt: skip
def test_pieces_go_where_remote_device_or_offload_param_says(tmp_path, config_device, remote_device, home):
    config = None
    if config_device is not None:
        config = {"zero_optimization": {"stage": 3, "offload_param": {"device": config_device,
                                                                      "nvme_path": str(tmp_path)}}}  # fmt: skip
    init = infinity.zero.Init(config=config, remote_device=remote_device)
    assert ("nvme" if init._nvme is not None else "host" if init._host else "device") == home
    if home == "host":
        torch.manual_seed(0)
        plain = nn.Linear(8, 4)
        torch.manual_seed(0)
        with init:
            layer = nn.Linear(8, 4)
        shard = init_shard(layer.weight)
        assert shard.piece.device.type == "cpu" and shard.local().device == shard.device  # gathered on the device
        with infinity.zero.GatheredParameters([layer.weight, layer.bias]):
            assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)


@pytest.mark.parametrize("device", ["nvme", "cpu", "none"])
def test_a_value_of_another_dtype_set_while_gathered_is_kept_in_the_pieces_dtype(tmp_path, device):
    """A modifier that sets a gathered fp16 weight to a bf16 tensor: the pieces keep fp16 and the value (1.5
    is exact in both), wherever they live; on NVMe the bytes written were once the bf16 ones, read back as fp16."""
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": device, "nvme_path": str(tmp_path)}}}
    with infinity.zero.Init(config=config, dtype=torch.float16):
        layer = nn.Linear(64, 64)
    with infinity.zero.GatheredParameters([layer.weight], modifier_rank=0):
        layer.weight.data = torch.full((64, 64), 1.5, dtype=torch.bfloat16)
    whole = init_shard(layer.weight).gather()
    assert whole.dtype == torch.float16 and torch.equal(whole, torch.full((64, 64), 1.5, dtype=torch.float16))
