"""DeepSpeed's estimators by its names (the figures DeepSpeed 0.19.8 prints for the same calls), and infinity's own
per-tier estimate of a module against what the engine really allocates."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import infinity
from infinity.budget import Where
from infinity.estimators import (
    estimate_memory,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_to_params,
)

# Printed by DeepSpeed 0.19.8 for the same calls (its options column in the form its documentation shows: the
# release itself prints the enum's repr there, "OffloadDeviceEnum.cpu").
ZERO3_T0_3B = """\
Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 8 GPUs per node.
SW: Model with 2851M total params, 32M largest layer params.
  per CPU  |  per GPU |   Options
   71.69GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1
  127.45GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0
   63.72GB |   0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=1
  127.45GB |   0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=0
    1.47GB |   6.10GB | offload_param=none, offload_optimizer=none, zero_init=1
  127.45GB |   6.10GB | offload_param=none, offload_optimizer=none, zero_init=0
"""
ZERO2_TWO_NODES = """\
Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 2 nodes, 8 GPUs per node.
SW: Model with 2851M total params.
  per CPU  |  per GPU |   Options
  254.90GB |   5.31GB | offload_optimizer=cpu
  127.45GB |   8.30GB | offload_optimizer=none
"""
ZERO3_GPT2_SMALL = """\
Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 1 GPU per node.
SW: Model with 124M total params, 38M largest layer params.
  per CPU  |  per GPU |   Options
    3.13GB |   0.14GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1
    3.13GB |   0.14GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0
    2.78GB |   0.38GB | offload_param=none, offload_optimizer=cpu , zero_init=1
    2.78GB |   0.38GB | offload_param=none, offload_optimizer=cpu , zero_init=0
    0.22GB |   2.23GB | offload_param=none, offload_optimizer=none, zero_init=1
    0.70GB |   2.23GB | offload_param=none, offload_optimizer=none, zero_init=0
"""


def test_the_cold_tables_print_deepspeeds_figures(capsys):
    estimate_zero3_model_states_mem_needs_all_cold(total_params=2851000000, largest_layer_params=32900000,
                                                   num_gpus_per_node=8, num_nodes=1)  # fmt: skip
    assert capsys.readouterr().out == ZERO3_T0_3B
    estimate_zero2_model_states_mem_needs_all_cold(total_params=2851000000, num_gpus_per_node=8, num_nodes=2)
    assert capsys.readouterr().out == ZERO2_TWO_NODES


class Tied(nn.Module):
    """GPT-2 small's parameter counts in miniature: a tied embedding counted once, one largest module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50257, 768)
        self.blocks = nn.Sequential(*[nn.Linear(768, 768) for _ in range(4)])
        self.head = nn.Linear(768, 50257, bias=False)
        self.head.weight = self.embed.weight


def test_the_live_tables_count_the_models_own_parameters(capsys):
    with torch.device("meta"):
        model = Tied()
    total, largest = model_to_params(model)
    assert total == 50257 * 768 + 4 * (768 * 768 + 768) and largest == 50257 * 768
    estimate_zero3_model_states_mem_needs_all_live(model)
    live = capsys.readouterr().out
    estimate_zero3_model_states_mem_needs_all_cold(total_params=total, largest_layer_params=largest)
    assert live == capsys.readouterr().out
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    assert "1 node, 2 GPUs per node" in capsys.readouterr().out
    # GPT-2 small's own counts (124,439,808; its embedding 38,597,376), as DeepSpeed prints them
    estimate_zero3_model_states_mem_needs_all_cold(total_params=124439808, largest_layer_params=38597376)
    assert capsys.readouterr().out == ZERO3_GPT2_SMALL


def _file_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def test_estimate_memory_of_a_module_matches_the_engines_swap_files(tmp_path):
    """infinity's own estimate for an nn.Module: its NVMe bytes are the swap files the engine then opens (their
    sizes on disk, which the estimate bounds), and its host rows what the engine keeps there (max_in_cpu)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}  # fmt: skip
    estimate = estimate_memory(model, config)
    rows = {row.what: row for row in estimate.rows}
    assert estimate.numel == 6 * (256 * 256 + 256)
    assert any(row.where is Where.NVME for row in rows.values())
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        on_disk = _file_bytes(tmp_path)  # the estimate reserves each segment rounded up: at most 2% above
        assert 0 < on_disk <= estimate.total(Where.NVME) <= 1.02 * on_disk, (estimate.total(Where.NVME), on_disk)
        kept = rows["parameter pieces kept in host memory (max_in_cpu)"].nbytes
        assert kept == engine.tier_stats()["parameters"]["held_bytes"]["host"]
    finally:
        engine.destroy()
