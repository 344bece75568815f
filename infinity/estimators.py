"""Memory estimators: DeepSpeed's, by its names and arithmetic, and infinity's own per-tier estimate of a module.

DeepSpeed's ``estimate_zero2_model_states_mem_needs_all_live`` / ``_all_cold`` and the ZeRO-3 forms print a table of
host ("per CPU") and device ("per GPU") bytes for the model states under each offload choice, from the parameter
count alone (and the largest layer's at stage 3), with DeepSpeed's multipliers: 18 bytes per parameter for the
fp16 parameter and gradient, fp32 gradient, master and Adam states, times an ``additional_buffer_factor`` on the
host. They are kept here so that a script written for DeepSpeed prints the same figures; they know nothing of
NVMe, activations or this engine's buffers. ``estimate_memory(model, config)`` is this engine's own arithmetic
(that of `infinity estimate`): bytes per rank on each tier, from the module's own parameters and the config.
"""

from __future__ import annotations

import torch.nn as nn

from infinity.budget import Architecture, Estimate, RunShape, estimate, owners_of, whole_numel
from infinity.config import AutoValues, parse_config
from infinity.memory.plan import host_memory_bytes

GIB = 2**30
OFFLOAD_CPU = "cpu "  # DeepSpeed pads the device name to four characters in its table


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """(all parameters, the largest module's own parameters), each shared parameter counted once (DeepSpeed
    dedupes by storage instead: two Parameters viewing one storage count twice here, once there; on the meta
    device or partitioned, where storages are empty, this count is the right one)."""
    total = sum(whole_numel(p) for p in model.parameters())
    largest = max((sum(whole_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


# ---- DeepSpeed's arithmetic ----
def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:  # fmt: skip
    """(host bytes, device bytes) per rank at stages 1-2, as DeepSpeed computes them."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        return (int(total_params * max(4 * gpus, 16) * additional_buffer_factor), int(2 * total_params))
    return (int(total_params * 4 * num_gpus_per_node * additional_buffer_factor),
            int(2 * total_params + int(18 * total_params / gpus)))  # fmt: skip


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:  # fmt: skip
    """(host bytes, device bytes, the largest layer's bytes) per rank at stage 3, as DeepSpeed computes them."""
    gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    factor = additional_buffer_factor
    if cpu_offload and cpu_offload_params:
        device = largest
        host = total_params * (18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)) * factor
    elif cpu_offload:
        device = largest + int(2 * total_params / gpus)
        host = total_params * (16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)) * factor
    else:
        device = largest + int(18 * total_params / gpus)
        host = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * factor
    return int(host), int(device), largest


def _heading(total_params: int, num_gpus_per_node: int, num_nodes: int, largest_layer_params: int | None) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    layer = "" if largest_layer_params is None else f", {int(largest_layer_params / 1e6)}M largest layer params"
    return ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
            f"SW: Model with {int(total_params / 1e6)}M total params{layer}.\n"
            "  per CPU  |  per GPU |   Options")  # fmt: skip


def _line(host: int, device: int, options: str) -> str:
    return f" {host / GIB:7.2f}GB | {device / GIB:6.2f}GB | {options}".rstrip()


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:  # fmt: skip
    """Prints DeepSpeed's stage-2 table for a model of ``total_params`` parameters (with and without the
    optimizer offloaded to the host)."""
    lines = [_heading(total_params, num_gpus_per_node, num_nodes, None)]
    for cpu_offload in (True, False):
        host, device = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload,
                                                             additional_buffer_factor)  # fmt: skip
        lines.append(_line(host, device, f"offload_optimizer={OFFLOAD_CPU if cpu_offload else 'none'}"))
    print("\n".join(lines))


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:  # fmt: skip
    """The stage-2 table for ``model``'s own parameter count."""
    total, _ = model_to_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:  # fmt: skip
    """Prints DeepSpeed's stage-3 table: parameters and optimizer offloaded to the host or not, with and without
    zero.Init."""
    lines = [_heading(total_params, num_gpus_per_node, num_nodes, largest_layer_params)]
    for cpu_offload, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            host, device, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload, offload_params,
                zero_init, additional_buffer_factor,
            )  # fmt: skip
            options = (f"offload_param={OFFLOAD_CPU if offload_params else 'none'}, "
                       f"offload_optimizer={OFFLOAD_CPU if cpu_offload else 'none'}, zero_init={int(zero_init)}")
            lines.append(_line(host, device, options))
    print("\n".join(lines))


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:  # fmt: skip
    """The stage-3 table for ``model``'s own parameter count and largest module."""
    total, largest = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)  # fmt: skip


# ---- infinity's own ----
def estimate_memory(model: nn.Module, config: dict, *, world_size: int = 1, seq_len: int = 0,
                    host_memory: int | None = None, cuda: bool | None = None) -> Estimate:  # fmt: skip
    """Bytes per rank on each tier (device, host pinned, host other, NVMe) for training ``model`` under
    ``config`` (a DeepSpeed-style dict) at ``world_size``: the arithmetic of `infinity estimate`, on the module's
    own parameters (stage 3's units as the engine cuts them). Activations are counted for a transformers model
    when ``seq_len`` is given. ``host_memory``: the node's, shared by ``world_size`` ranks on one node (default:
    this machine's available memory). ``Estimate.rows`` says what each figure is; ``total(Where)`` and
    ``host_bytes(cuda=)`` sum them."""
    import torch

    from infinity.estimate import momentum_states

    config_of_model = getattr(model, "config", None)  # a transformers model's: its dimensions, for activations
    arch = Architecture.of(config_of_model) if config_of_model is not None else Architecture()
    parsed = parse_config(config, world_size=world_size, auto=AutoValues(hidden_size=arch.hidden or None))
    width = 2 if (parsed.bf16.enabled or parsed.fp16.enabled) else 4
    owners = owners_of(model)
    run = RunShape(world_size=world_size, micro_batch=parsed.train_micro_batch_size_per_gpu, seq_len=seq_len,
                   dtype_bytes=width, local_ranks=world_size,
                   host_available=host_memory if host_memory is not None else host_memory_bytes())  # fmt: skip
    if not seq_len:
        arch = Architecture()  # no sequence length: no activation estimate
    return estimate(owners, arch, parsed, run, cuda=torch.cuda.is_available() if cuda is None else cuda,
                    momentum_states=momentum_states(config))  # fmt: skip
