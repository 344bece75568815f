"""Every elementwise torch optimizer, and Lion, steps ZeRO's partitions and offloaded tiles with its own update
([Note: elementwise optimizers] in infinity/zero/elementwise.py).

At world size 1 and 2 (real processes over gloo), for each optimizer passed to initialize(): stage 3 with the
optimizer on NVMe in 64-element tiles (pipelined reads and writes) gives bitwise the parameters and losses of
stage 3 with nothing offloaded (where the optimizer steps the same pieces as its own parameters), and both match
plain PyTorch with the same optimizer on the unpartitioned model (same gradient sums: the engine's accumulation
order). Stage 2 with the optimizer in host memory likewise, for a few. A run saved after two steps and resumed
in a fresh engine continues bitwise as the uninterrupted run: the per-element states come back from the
checkpoint, and so do the scalar ones (NAdam's mu_product, ASGD's eta and mu, Adagrad's state made in __init__).
The config's optimizer names (Lion, Adagrad, a torch class's name) build the same classes.
"""

from __future__ import annotations

import pytest
import torch

import infinity
import infinity.zero
from infinity.errors import ConfigError
from infinity.optim import Lion
from tests.distributed.harness import run_distributed
from tests.distributed.training import (
    _accumulate_like_the_engine,
    build,
    engine_config,
    global_batch,
    loss_fn,
)

MODEL, STEPS, BATCH, ACCUMULATION = "transformer", 3, 8, 2
OPTIMIZERS = {
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "initial_accumulator_value": 0.1, "weight_decay": 0.01}),
    "adagrad-fused": (torch.optim.Adagrad, {"lr": 1e-2, "fused": True}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9, "centered": True}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2, "weight_decay": 0.01}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.01}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": 1.0}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-3}),
    "lion": (Lion, {"lr": 1e-3, "weight_decay": 0.1}),
}
STAGE2 = ("nadam", "asgd", "lion")
RESUMED = ("adagrad", "nadam", "asgd")


def make(name: str, params):
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **kwargs)


def config_for(stage: int, device: str, world_size: int, nvme_path: str) -> dict:
    config = engine_config(stage=stage, micro=BATCH // (ACCUMULATION * world_size), accumulation=ACCUMULATION,
                           lr=1e-3, clip=0.0)  # fmt: skip
    del config["optimizer"]
    zero = config["zero_optimization"]
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 64
    if device != "none":
        zero["offload_optimizer"] = {"device": device, "nvme_path": nvme_path, "pipeline_read": True,
                                     "pipeline_write": True, "buffer_count": 3}  # fmt: skip
        zero["sub_group_size"] = 64
    return config


def train(name: str, config: dict, *, rank: int, world_size: int, steps=range(STEPS), save=None, load=None):
    model = build(MODEL)
    engine, *_ = infinity.initialize(model=model, config=config, optimizer=make(name, model.parameters()))
    if load is not None:
        engine.load_checkpoint(load)
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in steps:
        inputs, target = global_batch(MODEL, step, micro * ACCUMULATION * world_size)
        for k in range(ACCUMULATION):
            start = k * micro * world_size + rank * micro
            loss = loss_fn(MODEL, engine(inputs[start : start + micro]), target[start : start + micro])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if save is not None and step == save[1]:
            engine.save_checkpoint(save[0])
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    tiles = None if engine.zero_optimizer.tiled is None else len(engine.zero_optimizer.tiled.tiles)
    engine.destroy()
    return {"losses": losses, "params": params, "tiles": tiles}


def reference(name: str, world_size: int) -> dict:
    """Plain PyTorch, the optimizer on the whole model, gradients summed in the engine's order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build(MODEL)
        optimizer = make(name, model.parameters())
        micro = BATCH // (ACCUMULATION * world_size)
        for step in range(STEPS):
            inputs, target = global_batch(MODEL, step, BATCH)
            _, grads = _accumulate_like_the_engine(MODEL, model, inputs, target, micro, ACCUMULATION, world_size)
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
            optimizer.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _worker(*, rank: int, world_size: int, nvme_path: str) -> dict:
    results = {}
    for name in OPTIMIZERS:
        for stage, device in [(3, "nvme"), (3, "none")] + ([(2, "cpu"), (2, "none")] if name in STAGE2 else []):
            results[name, stage, device] = train(name, config_for(stage, device, world_size, nvme_path), rank=rank,
                                                 world_size=world_size)  # fmt: skip
        results[name, "reference"] = reference(name, world_size)
    for name in RESUMED:
        config = config_for(3, "nvme", world_size, nvme_path)
        folder = f"{nvme_path}/../ckpt-{name}"
        train(name, config, rank=rank, world_size=world_size, steps=range(2), save=(folder, 1))
        results[name, "resumed"] = train(name, config, rank=rank, world_size=world_size, steps=range(2, STEPS),
                                         load=folder)  # fmt: skip
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"elementwise-w{request.param}")
    (workdir / "nvme").mkdir()
    return run_distributed(_worker, request.param, workdir, timeout_s=300, nvme_path=str(workdir / "nvme"))


def _equal(a: dict, b: dict) -> list[str]:
    return [n for n in b if not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_tiles_are_bitwise_the_in_memory_step(results, name):
    for rank_results in results:
        tiled, whole = rank_results[name, 3, "nvme"], rank_results[name, 3, "none"]
        assert tiled["tiles"] > 20  # 64-element tiles: many per unit
        assert tiled["losses"] == whole["losses"]
        assert _equal(tiled["params"], whole["params"]) == []
        if name in STAGE2:
            assert rank_results[name, 2, "cpu"]["losses"] == rank_results[name, 2, "none"]["losses"]
            assert _equal(rank_results[name, 2, "cpu"]["params"], rank_results[name, 2, "none"]["params"]) == []


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_partitioned_steps_match_plain_pytorch(results, name):
    """Not bitwise: a parameter's pieces start where buckets and ranks cut it, so SIMD lanes fall elsewhere than
    on the whole tensor (fused kernels round an ulp apart)."""
    want = results[0][name, "reference"]
    for key in [(name, 3, "nvme"), *([(name, 2, "cpu")] if name in STAGE2 else [])]:
        got = results[0][key]["params"]
        for param in want:
            torch.testing.assert_close(got[param], want[param], rtol=1e-5, atol=1e-6, msg=f"{key} {param}")
        moved = max(float((got[p] - build(MODEL).state_dict()[p]).abs().max()) for p in want)
        assert moved > 1e-4  # the optimizer did step


@pytest.mark.parametrize("name", RESUMED)
def test_a_resumed_run_continues_bitwise(results, name):
    for rank_results in results:
        whole, resumed = rank_results[name, 3, "nvme"], rank_results[name, "resumed"]
        assert resumed["losses"] == whole["losses"][2 * ACCUMULATION :]
        assert _equal(resumed["params"], whole["params"]) == []


def test_config_names_build_the_classes(tmp_path):
    for name, cls in (("Lion", Lion), ("Adagrad", torch.optim.Adagrad), ("RMSprop", torch.optim.RMSprop),
                      ("nadam", torch.optim.NAdam)):  # fmt: skip
        config = config_for(3, "nvme", 1, str(tmp_path))
        config["optimizer"] = {"type": name, "params": {"lr": 1e-3}}
        engine, optimizer, *_ = infinity.initialize(model=build(MODEL), config=config)
        assert type(engine.zero_optimizer.optimizer) is cls
        engine.destroy()
    for name, why in (("Lamb", "trust ratio"), ("OneBitAdam", "compressed communication"), ("MuAdamW", "mup"),
                      ("Muon", "orthogonalizes"), ("Shampoo", "use Adam, AdamW, SGD, Adagrad, Lion")):  # fmt: skip
        config = config_for(2, "none", 1, str(tmp_path))
        config["optimizer"] = {"type": name, "params": {}}
        with pytest.raises(ConfigError, match=f"optimizer.type '{name}' is not supported.*{why}"):
            infinity.initialize(model=build(MODEL), config=config)


class GroupCountedSgd(torch.optim.Optimizer):
    """Keeps its step count in the param group (as some classes do) and steps by lr / sqrt(count)."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] / group["count"] ** 0.5)


class EagerAdagrad(torch.optim.Optimizer):
    """Builds its state in __init__, with no fallback for a parameter it has not seen."""

    def __init__(self, params, lr: float = 0.05, initial: float = 0.5) -> None:
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["sum"] = torch.full_like(param, initial)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    total = self.state[param]["sum"]
                    total.addcmul_(param.grad, param.grad)
                    param.addcdiv_(param.grad, total.sqrt(), value=-group["lr"])


@pytest.mark.parametrize("cls", [GroupCountedSgd, EagerAdagrad], ids=lambda c: c.__name__)
def test_a_users_own_elementwise_optimizer_at_every_stage_and_tier(cls, tmp_path):
    """In memory the class steps ZeRO's pieces as its parameters, offloaded its step runs per tile: either way
    the results are plain PyTorch's, its counter in the param group advances once per step, its state built in
    __init__ is there, and its step hooks run once per engine step."""
    torch.manual_seed(0)
    reference_model = build(MODEL)
    reference_optimizer = cls(reference_model.parameters())
    for step in range(3):
        inputs, target = global_batch(MODEL, step, BATCH)
        loss_fn(MODEL, reference_model(inputs), target).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    want = dict(reference_model.named_parameters())
    for stage, device in [(0, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "nvme")]:
        model = build(MODEL)
        optimizer = cls(model.parameters())
        hooked: list[int] = []
        optimizer.register_step_post_hook(lambda *args, calls=hooked: calls.append(1))
        config = engine_config(stage=stage, micro=BATCH, accumulation=1, lr=1e-3, clip=0.0)
        del config["optimizer"]
        if device != "none":
            config["zero_optimization"]["offload_optimizer"] = {"device": device, "nvme_path": str(tmp_path)}
            config["zero_optimization"]["sub_group_size"] = 64
        engine, *_ = infinity.initialize(model=model, config=config, optimizer=optimizer)
        for step in range(3):
            inputs, target = global_batch(MODEL, step, BATCH)
            engine.backward(loss_fn(MODEL, engine(inputs), target))
            engine.step()
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            for name, param in engine.module.named_parameters():
                torch.testing.assert_close(param.detach(), want[name].detach(), rtol=1e-5, atol=1e-6,
                                           msg=f"stage {stage} {device} {name}")  # fmt: skip
        assert len(hooked) == 3, (stage, device, len(hooked))
        if cls is GroupCountedSgd:
            assert [g["count"] for g in engine.zero_optimizer.param_groups] == [3], (stage, device)
        engine.destroy()
