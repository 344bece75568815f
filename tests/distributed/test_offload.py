"""Optimizer offload (cpu and nvme, stages 1-3) gives bitwise the results of the same run without offload.

[Note: tiles] in infinity/zero/tiles.py promises that the offloaded step is torch's own update on contiguous
pieces of the shard, cut where SIMD lanes do not care, so the results are those of the unoffloaded step bit for
bit. This checks it with ``torch.equal`` at world size 1 and 2 (real processes over gloo, one spawn per world size
computing every run; the asserts are cheap): the fp32 losses, the global gradient norms, the final parameters as
GatheredParameters shows them, each rank's own fp32 master pieces (training.own_pieces, through
``fp32_shards``), and at stage 3 each rank's compute-dtype shard pieces. Each offloaded run is compared with the
same configuration without offload_optimizer on the same rank. Swap files live under pytest's tmp_path (the
real disk); none may be left once the runs end.

Covered (4 steps, gradient accumulation 2, clipping 1.0 unless said): the transformer at stages 1-3 with cpu and
nvme, GPT-2 at stages 1-3 with nvme (AdamW from the config), the MLP at stages 1-3 with nvme; bf16 (transformer
stage 2, GPT-2 stage 3, nvme); fp16 with overflow-skipped steps (stages 2 and 3: stage 3 on NVMe with its gradient there
too, [Note: swapped gradients], forced in every stage-3 NVMe run but two, which keep it where the plan puts these
models' gradients: in host memory); many tiles per group (sub_group_size 64 and 100) with and without pipelined
reads and writes, which must also equal the one-tile run; torch.optim.SGD (momentum, dampening) and torch.optim.Adam
(weight decay, amsgrad) passed to initialize(); two param groups (decay / no decay) so that stage 3's runs split by
group; a WarmupLR scheduler, which must act on the offloaded run as on the plain one; GPT-2 at stage 3 without
clipping; parameters on NVMe with offload_param.max_in_cpu 0 (every piece on NVMe) and 4000 (some kept in host
memory), and with offload_param.buffer_size 500 (the pieces larger than a staging buffer read on demand).

Stage 3 steps the same tiles in device memory when nothing is offloaded, so the gradient norm (and with it the
clip coefficient) is summed over the same layout either way (test_stage3_grad_norm_is_the_same_with_offload).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import infinity
import infinity.zero
from infinity.zero.shards import host_kept
from tests.distributed.harness import run_distributed
from tests.distributed.training import (
    WEIGHT_DECAY,
    build,
    engine_config,
    global_batch,
    gradients_on_nvme,
    loss_fn,
    own_pieces,
)

STEPS, BATCH = 4, 8
# GPT-2 at lr 1e-2 is chaotic under Adam (see test_stage3.py): any rounding difference grows to percents in a few
# steps. Bitwise checks do not care, but the figures printed for a failure are more telling at 1e-3.
LR = {"mlp": 1e-2, "transformer": 1e-2, "gpt2": 1e-3}


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    stage: int
    device: str = "none"  # offload_optimizer.device
    precision: str = "fp32"
    optimizer: str = "config"  # config (AdamW from the config) | sgd | adam-amsgrad (passed to initialize)
    groups: int = 1  # 2: decay / no-decay param groups passed as model_parameters
    sub_group_size: int | None = None
    pipeline: bool = False  # pipeline_read and pipeline_write, buffer_count 3 (the smallest ring)
    scheduler: bool = False
    clip: float = 1.0
    param_device: str = "none"  # offload_param.device (stage 3)
    max_in_cpu: int = 0  # offload_param.max_in_cpu (nvme): 0 puts every piece on NVMe
    buffer_size: int | None = None  # offload_param.buffer_size (elements): pieces larger are read on demand
    gradients: str = "nvme"  # stage 3 with the optimizer on NVMe: "nvme" forces the gradient there too (the
    # swapped path), "plan" leaves it where the plan puts it (host memory: these models' gradients fit)

    @property
    def swapped_gradients(self) -> bool:
        return self.stage == 3 and self.device == "nvme" and self.gradients == "nvme"

    @property
    def key(self) -> str:
        parts = [self.model, f"stage{self.stage}", self.device, self.precision]
        if self.param_device != "none":
            parts.insert(3, f"params-{self.param_device}")
        if self.optimizer != "config":
            parts.append(self.optimizer)
        if self.groups != 1:
            parts.append(f"{self.groups}groups")
        if self.sub_group_size is not None:
            parts.append(f"sub{self.sub_group_size}")
        if self.pipeline:
            parts.append("pipelined")
        if self.scheduler:
            parts.append("warmuplr")
        if self.clip != 1.0:
            parts.append(f"clip{self.clip:g}")
        if self.max_in_cpu:
            parts.append(f"max_in_cpu{self.max_in_cpu}")
        if self.buffer_size is not None:
            parts.append(f"buffer{self.buffer_size}")
        if self.stage == 3 and self.device == "nvme" and self.gradients != "nvme":
            parts.append("grads-in-memory")
        return "-".join(parts)

    def without_offload(self) -> Run:
        return dataclasses.replace(
            self, device="none", param_device="none", sub_group_size=None, pipeline=False, max_in_cpu=0,
            buffer_size=None, gradients="nvme",
        )

    def config(self, world_size: int, nvme_path: str) -> dict:
        micro = BATCH // (2 * world_size)
        config = engine_config(
            stage=self.stage, micro=micro, accumulation=2, lr=LR[self.model], clip=self.clip, precision=self.precision
        )
        zero = config["zero_optimization"]
        if self.optimizer != "config":
            del config["optimizer"]
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = 64  # partition even these small parameters
        if self.device != "none":
            zero["offload_optimizer"] = {"device": self.device}
            if self.device == "nvme":
                zero["offload_optimizer"]["nvme_path"] = nvme_path
            if self.pipeline:
                zero["offload_optimizer"].update(pipeline_read=True, pipeline_write=True, buffer_count=3)
            else:  # both are on by default: the others run each tile's read and write to completion
                zero["offload_optimizer"].update(pipeline_read=False, pipeline_write=False)
        if self.param_device != "none":
            zero["offload_param"] = {"device": self.param_device, "nvme_path": nvme_path}
            if self.param_device == "nvme":
                zero["offload_param"]["max_in_cpu"] = self.max_in_cpu  # the default (1e9) keeps these models in memory
            if self.pipeline:
                zero["offload_param"]["buffer_count"] = 2
            if self.buffer_size is not None:
                zero["offload_param"]["buffer_size"] = self.buffer_size
        if self.sub_group_size is not None:
            zero["sub_group_size"] = self.sub_group_size
        if self.precision == "fp16":
            config["fp16"] = {"enabled": True, "initial_scale_power": 20, "hysteresis": 1}
        if self.scheduler:
            config["scheduler"] = {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR[self.model], "warmup_num_steps": 5},
            }
        return config


OFFLOADED = (
    # every stage with each device on the transformer, with nvme on GPT-2 (AdamW from the config, accumulation 2,
    # clipping 1.0)
    [Run("transformer", stage, device) for stage in (1, 2, 3) for device in ("cpu", "nvme")]
    + [Run("gpt2", stage, "nvme") for stage in (1, 2, 3)]
    # the MLP (a Linear with a tiny bias: pieces of many sizes) with both on NVMe and the optimizer alone
    + [Run("mlp", stage, "nvme") for stage in (1, 2)] + [Run("mlp", 3, "nvme", param_device="nvme")]
    + [Run("transformer", 2, "nvme", "bf16"), Run("gpt2", 3, "nvme", "bf16")]
    # fp16 from a high loss scale: the first steps overflow and are skipped, with reads ahead in the ring
    + [Run("transformer", 2, "nvme", "fp16", sub_group_size=64, pipeline=True),
       Run("transformer", 3, "nvme", "fp16", sub_group_size=64, pipeline=True)]
    # many tiles per group (sub_group_size is rounded down to a multiple of 64 elements), with and without the ring
    + [Run("transformer", 2, "nvme", sub_group_size=100), Run("gpt2", 2, "nvme", sub_group_size=64, pipeline=True),
       Run("transformer", 3, "nvme", sub_group_size=64, pipeline=True)]
    # the user's own torch optimizers, passed to initialize()
    + [Run("transformer", 2, "nvme", optimizer="sgd"), Run("transformer", 3, "nvme", optimizer="sgd"),
       Run("transformer", 1, "nvme", optimizer="adam-amsgrad"), Run("transformer", 3, "nvme", optimizer="adam-amsgrad"),
       Run("transformer", 1, "nvme", optimizer="adam-amsgrad", sub_group_size=64, pipeline=True)]
    # two param groups: at stage 3 a unit's piece is cut into runs by group
    + [Run("transformer", 3, "nvme", groups=2), Run("gpt2", 3, "nvme", groups=2)]
    + [Run("transformer", 2, "nvme", scheduler=True)]
    # stage 3 without clipping (see test_stage3_grad_norm_is_the_same_with_offload)
    + [Run("gpt2", 3, "nvme", clip=0.0)]
    # parameter offload: every optimizer placement with parameters in host memory or on NVMe; GPT-2 in fp32 and
    # bf16, the fp32 one with staging buffers of 500 elements (offload_param.buffer_size), so that its larger pieces
    # (the tied embedding, the MLP's) are read on demand straight into their gathered buffers; a ring of 2 staging
    # buffers with small tiles
    + [Run("transformer", 3, device, param_device=params) for params in ("cpu", "nvme")
       for device in ("none", "cpu", "nvme")]
    + [Run("gpt2", 3, "nvme", param_device="nvme", buffer_size=500),
       Run("gpt2", 3, "nvme", "bf16", param_device="nvme"),
       Run("transformer", 3, "nvme", param_device="nvme", sub_group_size=64, pipeline=True)]
    # max_in_cpu 4000: the first pieces within 4000 elements stay in host memory, the others on NVMe (some of each
    # at either world size); GPT-2 (its tied embedding kept), the transformer with the 2-buffer ring
    + [Run("gpt2", 3, "nvme", param_device="nvme", max_in_cpu=4000),
       Run("transformer", 3, "nvme", param_device="nvme", sub_group_size=64, pipeline=True, max_in_cpu=4000)]
    # the runs above force stage 3's gradient onto NVMe with the tiles; where the plan leaves it (host memory,
    # [Note: swapped gradients]): fp16's skipped steps with many pipelined tiles, and everything else on NVMe
    + [Run("transformer", 3, "nvme", "fp16", sub_group_size=64, pipeline=True, gradients="plan"),
       Run("gpt2", 3, "nvme", "bf16", param_device="nvme", gradients="plan")]
)  # fmt: skip
RUNS = {run.key: run for run in OFFLOADED}
RUNS.update({run.without_offload().key: run.without_offload() for run in OFFLOADED})
UNSCHEDULED = Run("transformer", 2, "nvme").key  # in the matrix already


def make_optimizer(kind: str, params, lr: float):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.1, weight_decay=WEIGHT_DECAY)
    if kind == "adam-amsgrad":
        return torch.optim.Adam(params, lr=lr, weight_decay=WEIGHT_DECAY, amsgrad=True)
    return None


def param_groups(model: torch.nn.Module, groups: int):
    if groups == 1:
        return list(model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


def train(run: Run, *, rank: int, world_size: int, nvme_path: str) -> dict:
    """training.train_engine, with the optimizer and param groups of ``run``; also records the gradient norm and
    learning rate of every step and how many tiles the offloaded optimizer has."""
    model = build(run.model)
    params = param_groups(model, run.groups)
    optimizer = make_optimizer(run.optimizer, params, LR[run.model])
    with gradients_on_nvme() if run.swapped_gradients else contextlib.nullcontext():
        engine, *_ = infinity.initialize(
            model=model, config=run.config(world_size, nvme_path), optimizer=optimizer, model_parameters=params
        )
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses, norms, lrs = [], [], []
    for step in range(STEPS):
        inputs, target = global_batch(run.model, step, micro * accumulation * world_size)
        step_loss = torch.zeros(())
        for k in range(accumulation):
            start = k * micro * world_size + rank * micro
            loss = loss_fn(run.model, engine(inputs[start : start + micro]), target[start : start + micro])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / accumulation
        if world_size > 1:
            torch.distributed.all_reduce(step_loss)
            step_loss /= world_size
        losses.append(step_loss.item())
        norms.append(engine.last_grad_norm)
        lrs.append(engine.get_lr())
    tiled = engine.zero_optimizer.tiled
    result = {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "pieces": own_pieces(engine),
        "compute_pieces": own_pieces(engine, masters=False) if engine.stage3 is not None else None,
        "skipped": engine.skipped_steps,
        "tiles": None if tiled is None else len(tiled.tiles),
        "runs": None if tiled is None else len({(t.group, t.piece) for t in tiled.tiles}),
        "home": None if tiled is None else tiled.manager.stats().held_bytes,
        "param_home": None if engine.stage3 is None else engine.stage3.table.shards.home.value,
        "param_split": param_split(engine),
        "gradients_swapped": getattr(engine.zero_optimizer, "gradients", None) is not None,
    }
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        result["params"] = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return result


def param_split(engine) -> dict | None:
    """Parameters on NVMe: which pieces max_in_cpu kept in host memory, which the swap store holds, tier stats."""
    if engine.stage3 is None or engine.stage3.table.shards.home.value != "nvme":
        return None
    shards = engine.stage3.table.shards
    return {
        "kept": sorted(shards.kept),
        "on_nvme": list(shards.on_nvme),
        "pieces": {bucket.index: bucket.piece_numel for bucket in shards.layout.buckets},
        "swapped": [segment.name for segment in shards.manager.store.layout],
        "held": engine.tier_stats()["parameters"]["held_bytes"],
        "outsized_reads": engine.tier_stats()["parameters"]["outsized"]["nvme_read"]["requests"],
        "ring_fits": [index for index in shards.on_nvme if shards.manager.fits(f"unit{index}")],
        "itemsize": shards.dtype.itemsize,
    }


def _worker(*, rank: int, world_size: int, nvme_path: str) -> dict:
    torch.manual_seed(0)
    return {key: train(run, rank=rank, world_size=world_size, nvme_path=nvme_path) for key, run in RUNS.items()}


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    world_size = request.param
    workdir = tmp_path_factory.mktemp(f"offload-w{world_size}")
    nvme = workdir / "nvme"
    nvme.mkdir()
    per_rank = run_distributed(_worker, world_size, workdir, timeout_s=300, nvme_path=str(nvme))
    leftovers = sorted(str(p.relative_to(nvme)) for p in nvme.rglob("*"))
    return world_size, per_rank, leftovers


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if a.numel() else 0.0


def differences(got: dict, want: dict) -> dict[str, str]:
    """Each check that is not bitwise equal -> how far apart (relative: max |a - b| / max |b| per tensor)."""
    found = {}
    if got["losses"] != want["losses"]:
        pairs = zip(got["losses"], want["losses"], strict=True)
        found["losses"] = f"{max(abs(a - b) / abs(b) for a, b in pairs):.1e}"
    if got["norms"] != want["norms"]:
        steps = [i for i, (a, b) in enumerate(zip(got["norms"], want["norms"], strict=True)) if a != b]
        first = steps[0]
        found["grad norms"] = (
            f"steps {steps}; first at step {first}: {got['norms'][first]!r} vs {want['norms'][first]!r}"
        )
    if got["lrs"] != want["lrs"]:
        found["lrs"] = f"{got['lrs']} vs {want['lrs']}"
    unequal = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
    if unequal:
        worst = max(_relative(got["params"][n], want["params"][n]) for n in unequal)
        found["gathered params"] = f"{len(unequal)} tensors, up to {worst:.1e}"
    for which in ("pieces", "compute_pieces"):
        if want[which] is None:
            continue
        unequal, worst = [], 0.0
        for name, pieces in want[which].items():
            mine = got[which][name]
            if [first for first, _ in mine] != [first for first, _ in pieces]:
                unequal.append(name)
                worst = float("inf")
                continue
            for (_, a), (_, b) in zip(mine, pieces, strict=True):
                if not torch.equal(a, b):
                    unequal.append(name)
                    worst = max(worst, _relative(a, b))
        if unequal:
            found[which] = f"{len(set(unequal))} tensors, up to {worst:.1e}"
    return found


def test_no_swap_files_are_left(results):
    _world_size, _per_rank, leftovers = results
    assert leftovers == []


@pytest.mark.parametrize("key", [run.key for run in OFFLOADED])
def test_offload_is_bitwise_equal_to_no_offload(results, key):
    world_size, per_rank, _ = results
    run = RUNS[key]
    for rank, rank_results in enumerate(per_rank):
        got, want = rank_results[key], rank_results[run.without_offload().key]
        # Stage 3 steps tiles in device memory without offload too (the same tiles, so the same results).
        assert got["tiles"] is not None and (want["tiles"] is None or set(want["home"]) == {"device"})
        assert set(got["home"]) == {{"none": "device", "cpu": "host", "nvme": "nvme"}[run.device]}
        if run.stage == 3:
            assert got["param_home"] == {"none": "device", "cpu": "host", "nvme": "nvme"}[run.param_device]
        assert got["gradients_swapped"] == run.swapped_gradients
        if run.sub_group_size is not None:
            assert got["tiles"] >= got["runs"] + 10, f"sub_group_size {run.sub_group_size}: only {got['tiles']} tiles"
        else:
            assert got["tiles"] == got["runs"], "the default sub_group_size makes one tile per run"
        found = differences(got, want)
        print(f"world {world_size} rank {rank} {key}: {found or 'bitwise equal'}")
        assert not found, f"world {world_size} rank {rank}: {key} differs from {run.without_offload().key}: {found}"


@pytest.mark.parametrize("key", [run.key for run in OFFLOADED if run.param_device == "nvme"])
def test_max_in_cpu_keeps_pieces_in_host_memory_and_the_rest_on_nvme(results, key):
    """Parameters on NVMe: the pieces max_in_cpu keeps are host_kept's choice along the units' order (the host
    budget is far above 4000 elements), counted as host bytes in the tier stats; the swap store holds exactly the
    others. max_in_cpu 0: every piece on NVMe."""
    world_size, per_rank, _ = results
    run = RUNS[key]
    for rank, rank_results in enumerate(per_rank):
        split = rank_results[key]["param_split"]
        pieces, kept, on_nvme = split["pieces"], split["kept"], split["on_nvme"]
        movable = sorted(kept + on_nvme)
        assert kept == sorted(host_kept([(index, pieces[index]) for index in movable], run.max_in_cpu))
        if run.max_in_cpu:
            assert kept and on_nvme, f"world {world_size} rank {rank}: {kept} kept, {on_nvme} on NVMe"
        else:
            assert kept == []
        assert split["swapped"] == [f"unit{index}" for index in on_nvme]
        nbytes = {where: sum(pieces[index] for index in units) * split["itemsize"]
                  for where, units in (("host", kept), ("nvme", on_nvme)) if units}  # fmt: skip
        assert split["held"] == nbytes


def test_outsized_pieces_are_read_on_demand(results):
    """offload_param.buffer_size 500: the pieces larger than a staging buffer are read on demand (counted apart in
    the tier stats), the others through the ring; the run still equals the one without offload (checked above). The
    default buffer_size fits every piece of these models: no read on demand."""
    world_size, per_rank, _ = results
    small = Run("gpt2", 3, "nvme", param_device="nvme", buffer_size=500).key
    for rank, rank_results in enumerate(per_rank):
        split = rank_results[small]["param_split"]
        outsized = [index for index in split["on_nvme"] if index not in split["ring_fits"]]
        assert outsized and split["ring_fits"], f"world {world_size} rank {rank}: {split}"
        assert split["outsized_reads"] > 0, f"world {world_size} rank {rank}: no piece was read on demand"
        default = rank_results[Run("gpt2", 3, "nvme", "bf16", param_device="nvme").key]["param_split"]
        assert default["outsized_reads"] == 0 and default["ring_fits"] == default["on_nvme"]


def one_tile(run: Run) -> Run:
    return dataclasses.replace(run, sub_group_size=None, pipeline=False)


@pytest.mark.parametrize(
    "key", [run.key for run in OFFLOADED if run.sub_group_size is not None and one_tile(run).key in RUNS]
)
def test_many_tiles_equal_one_tile(results, key):
    """sub_group_size of 64 or 100 elements (dozens of tiles per group) against the default (one tile per run),
    both offloaded: at stage 3 too, so the tiles themselves are exact there."""
    world_size, per_rank, _ = results
    run = RUNS[key]
    for rank, rank_results in enumerate(per_rank):
        found = differences(rank_results[key], rank_results[one_tile(run).key])
        assert not found, f"world {world_size} rank {rank}: {key} differs from {one_tile(run).key}: {found}"


def test_scheduler_acts_with_offload(results):
    """WarmupLR moves the learning rate of the offloaded optimizer (the tiles read it from the param groups at
    every step): the lr rises over the warmup, the result equals the plain run with the same scheduler (checked
    above) and differs from the offloaded run without a scheduler."""
    _world_size, per_rank, _ = results
    for rank_results in per_rank:
        scheduled = rank_results[Run("transformer", 2, "nvme", scheduler=True).key]
        lrs = [lr[0] for lr in scheduled["lrs"]]
        assert lrs[0] < lrs[1] < lrs[2] < lrs[-1] == LR["transformer"], lrs
        unscheduled = rank_results[UNSCHEDULED]
        assert {lr[0] for lr in unscheduled["lrs"]} == {LR["transformer"]}
        assert scheduled["losses"][0] == unscheduled["losses"][0]  # the same start
        assert scheduled["losses"][1:] != unscheduled["losses"][1:]
        assert not torch.equal(scheduled["params"]["head.weight"], unscheduled["params"]["head.weight"])


@pytest.mark.parametrize("model", ["transformer", "gpt2"])
def test_stage3_grad_norm_is_the_same_with_offload(results, model):
    """The global gradient norm (what clipping scales by, and what engine.last_grad_norm reports) must not depend
    on where the optimizer states live: every step's norm bitwise equal with and without offload at stage 3, as it
    is at stages 1-2 (checked in test_offload_is_bitwise_equal_to_no_offload).

    Where clipping acts (GPT-2 here), a norm off in its last bit changes the clip coefficient and so every weight
    (measured when the unoffloaded stage 3 summed it over per-group gathers instead of the flat shard: GPT-2 fp32
    weights 5.6e-7 relative apart after 6 steps, bf16 weights 2.6e-5)."""
    world_size, per_rank, _ = results
    key = Run(model, 3, "nvme").key
    for rank, rank_results in enumerate(per_rank):
        got, want = rank_results[key]["norms"], rank_results[Run(model, 3).key]["norms"]
        differing = [(step, a, b) for step, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        assert not differing, f"world {world_size} rank {rank}: (step, with offload, without): {differing}"


def test_the_runs_exercise_what_they_claim(results):
    """Sanity of the matrix itself: clipping acts in the GPT-2 runs (a norm above 1.0), so a difference in the norm
    reaches the weights there (the transformer's norms stay below 1.0: clipping is a no-op for it); fp16 skips
    its first steps; bf16 and the user's optimizers change the results (they are not ignored)."""
    _world_size, per_rank, _ = results
    for rank_results in per_rank:
        assert max(rank_results[Run("gpt2", 3).key]["norms"]) > 1.0
        assert max(rank_results[Run("transformer", 3).key]["norms"]) < 1.0
        for stage in (2, 3):
            fp16 = Run("transformer", stage, "nvme", "fp16", sub_group_size=64, pipeline=True)
            assert 0 < rank_results[fp16.key]["skipped"] < STEPS
            assert rank_results[fp16.key]["skipped"] == rank_results[fp16.without_offload().key]["skipped"]
        fp32, bf16 = rank_results[Run("gpt2", 3).key], rank_results[Run("gpt2", 3, precision="bf16").key]
        assert fp32["losses"] != bf16["losses"]
        for stage, optimizer in ((2, "sgd"), (1, "adam-amsgrad")):
            mine = rank_results[Run("transformer", stage, optimizer=optimizer).key]["losses"]
            assert mine != rank_results[Run("transformer", stage).key]["losses"], optimizer
