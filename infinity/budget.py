"""Memory estimate: bytes per rank on each tier for a model and a config, before anything runs.

Pure planning (no tensors, no processes): the model is described by its parameter owners (taken from a model
built on the meta device), and the engine's own layout math (partition.layout_from_runs: units, padding,
pieces) gives the stage-3 sizes, so the estimate follows the code. What it counts, per rank:
- model states: the compute-dtype parameters (whole at stages 0-2; the rank's pieces at stage 3, plus the
  persistent small ones whole), the fp32 masters (in fp32 without optimizer offload the weights themselves are
  the masters: no copy), the optimizer states (Adam 2, SGD with momentum 1 fp32 per element), the reduced fp32
  gradient (whole at stages 0-1, the rank's share at 2-3), each on the tier its offload section names (the
  gradient at stage 3 with the optimizer on NVMe: in host memory while a quarter of the host share holds it;
  with the optimizer in host memory and the step taken in backward, never held whole: zero/backward_step.py);
- buffers: gradient buckets in flight, stage 3's gathered units (stage3_max_live_parameters, or the model),
  the NVMe staging rings (buffer_count x the largest piece on NVMe within the staging budget; the optimizer's
  ring of tiles, at stage 3 as deep as the largest unit's tiles within LEAD_RING_BYTES, and the gradient's ring
  when the plan sends the gradient to NVMe with it), and the pieces too
  large for a ring buffer, kept from the step to the next forward within the same budget;
- every size a run decides (tiles, rings, the host cache of max_in_cpu, the swap files' segments) is the plan's
  (memory/plan.py, [Note: one plan]): the same functions the engine sizes its buffers with, so the estimate
  follows the engine; the node's host memory is shared by ``RunShape.local_ranks`` ranks, as the engine shares it;
- activations, an estimate for a transformer decoder: per layer and token h x (34 + 5 a s / h) bytes in
  16-bit (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"), scaled to the
  compute dtype and the MLP's width, plus the logits (compute dtype, the loss's fp32 copy and its gradient);
- the runtime: the resident bytes of a Python process that has imported torch and transformers, measured by the
  caller (not part of the model's budget, but part of what a run's peak RSS shows).

On a machine without CUDA the "device" is the host: device bytes are host RAM."""

from __future__ import annotations

import dataclasses
import enum

from infinity.config import Config, ZeroConfig
from infinity.memory.host import KEEP, KEPT_ACTIVATION_COPIES, policy_for
from infinity.memory.plan import (
    MAX_TILE_GATHERS,
    LayoutSizes,
    Plan,
    SwapNeed,
    make_plan,
    outsized_kept,
    outsized_spare_bytes,
    place_parameters,
    swap_need,
)
from infinity.memory.pool import gathered_units_numel, stage3_gradient_numel
from infinity.zero.backward_step import config_steps_in_backward
from infinity.zero.compact import STATE_BYTES
from infinity.zero.grads import GRADIENT_DTYPES
from infinity.zero.partition import layout_from_runs
from infinity.zero.partition import plan as partition_plan
from infinity.zero.split_master import MasterSplitter, master_width


class Where(enum.Enum):
    DEVICE = "device"
    HOST_PINNED = "host pinned"
    HOST = "host other"
    NVME = "nvme"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Owner:
    """One module's own parameters (a tied weight counted at its first owner): the grain of stage 3's units."""

    path: str
    numels: tuple[int, ...]
    trainable: tuple[bool, ...]


def whole_numel(param) -> int:
    """Elements of the whole parameter: a partitioned one (zero.Init, stage 3) has none and carries its count in
    ds_numel."""
    numel = getattr(param, "ds_numel", None)
    return numel if numel is not None and param.numel() == 0 else param.numel()


def owners_of(module) -> list[Owner]:
    """The module's parameter owners as stage 3 groups them (zero/units.py), whole counts, frozen ones marked."""
    from infinity.zero.units import parameter_owners

    return [Owner(path=path, numels=tuple(whole_numel(p) for p in params),
                  trainable=tuple(p.requires_grad for p in params))
            for path, _, params in parameter_owners(module) if params]  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """What the activation estimate needs; zeros where the model is not a transformer decoder."""

    hidden: int = 0
    layers: int = 0
    heads: int = 0
    vocab: int = 0
    intermediate: int = 0  # the MLP's width (4 h for GPT-2)

    @classmethod
    def of(cls, config) -> Architecture:
        """A transformers config's dimensions (GPT-2's names or Llama's); zeros where it has none."""

        def get(*names: str) -> int:
            return next((int(getattr(config, n)) for n in names if getattr(config, n, None) is not None), 0)

        hidden = get("hidden_size", "n_embd")
        return cls(hidden=hidden, layers=get("num_hidden_layers", "n_layer"),
                   heads=get("num_attention_heads", "n_head"), vocab=get("vocab_size"),
                   intermediate=get("intermediate_size", "n_inner") or 4 * hidden)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    world_size: int
    micro_batch: int
    seq_len: int
    dtype_bytes: int  # the compute dtype's
    host_available: int  # bytes of the node's host memory the run plans with ([Note: one plan] in memory/plan.py)
    local_ranks: int = 1  # the ranks that share it


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    category: str  # "model states" | "buffers" | "activations"
    what: str
    where: Where
    nbytes: int


@dataclasses.dataclass(kw_only=True)
class Estimate:
    rows: list[Row]
    numel: int
    trainable_numel: int
    plan: Plan
    swap: SwapNeed  # the rank's swap files, and zero.Init's copy, given back as initialize() fills them
    checkpoint_bytes: int = 0  # one checkpoint tag: fp32 masters and optimizer states, other parameters as they are

    @property
    def checkpoint_io_bytes(self) -> int:
        """What a save or load adds to host memory while it runs: its transfers in flight, the plan's bound."""
        return min(self.plan.checkpoint_io_bytes, self.checkpoint_bytes)

    @property
    def nvme_during_init(self) -> int:
        return self.swap.init

    def total(self, where: Where) -> int:
        return sum(row.nbytes for row in self.rows if row.where is where)

    def host_bytes(self, *, cuda: bool) -> int:
        """What the run adds to host RSS: both host tiers, and the device's too where the device is the host."""
        host = self.total(Where.HOST_PINNED) + self.total(Where.HOST)
        return host if cuda else host + self.total(Where.DEVICE)


def _home(device: str, pinned: bool, *, cuda: bool) -> Where:
    if device == "nvme":
        return Where.NVME
    if device == "cpu":
        return Where.HOST_PINNED if pinned and cuda else Where.HOST
    return Where.DEVICE


def stage3_units(owners: list[Owner], zero: ZeroConfig, world_size: int) -> tuple[int, list[tuple[int, int]]]:
    """(persistent unit's padded numel, [(unit numel, piece numel)] of the others) with the engine's rule and
    padding (zero/units.py build_units; the engine checks that they agree)."""
    persistent, per_module = [], []
    persistent_numel = 0
    for owner in owners:
        kept = []
        for numel in owner.numels:
            if (numel <= zero.stage3_param_persistence_threshold
                    and persistent_numel + numel <= zero.stage3_model_persistence_threshold):  # fmt: skip
                persistent.append(numel)
                persistent_numel += numel
            else:
                kept.append(numel)
        if kept:
            per_module.append(kept)
    groups = ([persistent] if persistent else []) + per_module
    numels, runs = [], []
    for group in groups:
        runs.append(list(range(len(numels), len(numels) + len(group))))
        numels += group
    layout = layout_from_runs(0, numels, runs, world_size=world_size)
    buckets = list(layout.buckets)
    persistent_bucket = buckets.pop(0) if persistent else None
    units = [(b.padded_numel, b.piece_numel) for b in buckets]
    return persistent_bucket.padded_numel if persistent_bucket else 0, units


def _stage3_gradient_buckets(owners: list[Owner], config: Config, world_size: int) -> Row:
    """Stage 3's fp32 gradient buckets and their pieces held at once (memory/pool.py stage3_gradient_numel)."""
    persistent, units = stage3_units(owners, config.zero, world_size)
    numel = stage3_gradient_numel(persistent=persistent, units=[numel for numel, _ in units],
                                  reduce_bucket_numel=config.zero.reduce_bucket_size,
                                  overlap_comm=config.zero.overlap_comm, world_size=world_size)  # fmt: skip
    return Row("buffers", "gradient buckets (the unit filling, those being reduced, their pieces)", Where.DEVICE,
               numel * 4)  # fmt: skip


def _init_pieces(owners: list[Owner], world_size: int) -> tuple[int, ...]:
    """zero.Init's piece of every parameter (each padded and cut on its own: zero/init.py)."""
    numels = [numel for owner in owners for numel in owner.numels]
    layout = layout_from_runs(0, numels, [[i] for i in range(len(numels))], world_size=world_size)
    return tuple(bucket.piece_numel for bucket in layout.buckets)


def _activations(arch: Architecture, shape: RunShape) -> list[Row]:
    if not arch.layers:
        return []
    s, b, h, a = shape.seq_len, shape.micro_batch, arch.hidden, arch.heads
    mlp = (arch.intermediate or 4 * h) / (4 * h)
    per_layer_16bit = s * b * h * (15 + 19 * mlp) + 5 * a * s * s * b  # 34 sbh + 5 a s^2 b at a 4h MLP
    layers = int(arch.layers * per_layer_16bit * shape.dtype_bytes / 2)
    logits = s * b * arch.vocab * (shape.dtype_bytes + 4 + 4)
    return [Row("activations", f"{arch.layers} layers x {b} x {s} tokens (estimate)", Where.DEVICE, layers),
            Row("activations", "logits, their fp32 copy for the loss and its gradient", Where.DEVICE, logits)]


def estimate(owners: list[Owner], arch: Architecture, config: Config, shape: RunShape, *, cuda: bool,
             momentum_states: int = 2) -> Estimate:  # fmt: skip
    """Bytes per rank on each tier. ``momentum_states``: fp32 optimizer states per element (Adam 2, SGD 1 or 0)."""
    zero, n, width = config.zero, shape.world_size, shape.dtype_bytes
    numel = sum(sum(o.numels) for o in owners)
    trainable = sum(x for o in owners for x, t in zip(o.numels, o.trainable, strict=True) if t)
    rows: list[Row] = []
    offload_opt, offload_param = zero.offload_optimizer, zero.offload_param
    opt_home = _home(offload_opt.device, offload_opt.pin_memory, cuda=cuda)
    share = trainable if zero.stage == 0 else -(-trainable // n)  # elements of the optimizer this rank holds
    # ---- the layout's sizes, as the engine lays it out ----
    if zero.stage == 3:
        persistent, units = stage3_units(owners, zero, n)
        first = 1 if persistent else 0
        movable = tuple((first + i, piece) for i, (_, piece) in enumerate(units))
        runs = ([persistent // n] if persistent else []) + [piece for _, piece in units]
        layout = LayoutSizes(units=movable, runs=tuple(runs), more_runs=sum(len(o.numels) for o in owners),
                             init_pieces=_init_pieces(owners, n))  # fmt: skip
    else:
        trained = [x for o in owners for x, t in zip(o.numels, o.trainable, strict=True) if t]
        buckets = partition_plan([trained], world_size=n if zero.stage else 1, bucket_numel=zero.reduce_bucket_size)
        layout = LayoutSizes(runs=tuple(b.piece_numel for b in buckets[0].buckets))
    state_dtype = config.infinity.optimizer_state_dtype  # [Note: compact states] in zero/compact.py
    state_bytes = STATE_BYTES[state_dtype]
    split = config.infinity.offloaded_master == "split"  # [Note: split masters] in zero/split_master.py
    master = master_width(config.infinity.offloaded_master)
    state_width = master + momentum_states * state_bytes / 4 if offload_opt.enabled else 0  # fp32 units
    plan = make_plan(zero, world_size=n, local_ranks=shape.local_ranks, state_width=state_width,
                     host_share=shape.host_available // shape.local_ranks,
                     gradient_bytes=sum(layout.runs) * 4 if zero.stage == 3 else 0,
                     gradient_itemsize=GRADIENT_DTYPES[config.infinity.offloaded_gradient_dtype].itemsize,
                     largest_unit_numel=max(layout.runs, default=0) if zero.stage == 3 else 0)  # fmt: skip
    grad_on_nvme = plan.gradients_on_nvme
    swap = swap_need(plan, zero, layout, state_width=state_width, param_itemsize=width)

    # ---- parameters ----
    if zero.stage == 3:
        param_home = _home(offload_param.device, offload_param.pin_memory, cuda=cuda)
        pieces = [piece for _, piece in units]
        if param_home is Where.NVME:
            placement = place_parameters(movable, itemsize=width, host_numel=plan.host_cache_numel(zero, width),
                                         staging_bytes=plan.staging_bytes, buffer_count=plan.param_buffers,
                                         max_piece_numel=offload_param.buffer_size)  # fmt: skip
            rows.append(Row("model states", "parameter pieces (this rank's share of every unit)", Where.NVME,
                            swap.parameters))  # fmt: skip
            piece_of = dict(movable)
            kept = sum(piece_of[index] for index in placement.kept)
            home = _home("cpu", offload_param.pin_memory, cuda=cuda)
            if kept:
                rows.append(Row("model states", "parameter pieces kept in host memory (max_in_cpu)", home,
                                kept * width))  # fmt: skip
            if placement.on_nvme:  # the ring is sized from the pieces on NVMe, as zero/shards.py sizes it
                rows.append(Row("buffers", f"parameter staging ring ({plan.param_buffers} buffers)", home,
                                plan.param_buffers * placement.buffer_bytes))  # fmt: skip
            nvme_bytes = [piece_of[index] * width for index in placement.on_nvme]
            outsized = outsized_kept((b for b in nvme_bytes if b > placement.buffer_bytes), plan.staging_bytes)
            if outsized:
                rows.append(Row("buffers", "outsized parameter pieces kept from the step to the next forward", home,
                                outsized))  # fmt: skip
            big = [b for b in nvme_bytes if b > placement.buffer_bytes]
            if big:  # their buffers are kept for the next step's edits (zero/shards.py)
                rows.append(Row("buffers", "outsized parameter piece the step edits", home,
                                outsized_spare_bytes(big, plan.staging_bytes) - outsized))  # fmt: skip
        else:
            rows.append(Row("model states", "parameter pieces (this rank's share of every unit)", param_home,
                            sum(pieces) * width))  # fmt: skip
        if persistent:
            rows.append(Row("model states", "persistent parameters (whole on every rank)", Where.DEVICE,
                            persistent * width))  # fmt: skip
        largest_unit = max((u for u, _ in units), default=0)
        live = gathered_units_numel(total=sum(u for u, _ in units), largest=largest_unit,
                                    max_live=zero.stage3_max_live_parameters)  # fmt: skip
        rows.append(Row("buffers", "gathered units (stage3_max_live_parameters and one kept, or the whole model)",
                        Where.DEVICE, live * width))  # fmt: skip
    else:
        rows.append(Row("model states", "parameters (whole on every rank)", Where.DEVICE, numel * width))

    # ---- fp32 masters and optimizer states ----
    if opt_home is Where.NVME:  # tiles [master | states], each segment 4 KiB-aligned
        masters = "split master weights (16 bits each)" if split else "fp32 master weights"
        what = f"{masters} and optimizer states ({momentum_states} {state_dtype} per element)"
        rows.append(Row("model states", f"{what}, tiles of <= {plan.tile_numel:,} elements", Where.NVME,
                        swap.optimizer))  # fmt: skip
    else:
        masters_are_weights = width == 4 and not offload_opt.enabled
        if not masters_are_weights:
            what = "split master weights (16 bits each beside the bf16 weights)" if split else "fp32 master weights"
            rows.append(Row("model states", what, opt_home, int(share * 4 * master)))
        if momentum_states:
            rows.append(Row("model states", f"optimizer states ({momentum_states} {state_dtype} per element)",
                            opt_home, int(share * state_bytes * momentum_states)))  # fmt: skip

    # ---- gradients: the reduced fp32 gradient is where the optimizer steps: the compute device, host memory
    # (offloaded: [Note: gradient shards] in zero/gradient_shards.py), or NVMe with the optimizer there at stage 3 ----
    grad_home = _home("cpu", offload_opt.pin_memory, cuda=cuda) if offload_opt.enabled else Where.DEVICE
    if zero.stage <= 1:
        rows.append(Row("model states", "fp32 gradient buffers (whole: all-reduced at the boundary)", Where.DEVICE,
                        trainable * 4))  # fmt: skip
        rows.append(Row("model states", "reduced fp32 gradient (this rank's share; stage 0: all of it)",
                        grad_home, share * 4))  # fmt: skip
    else:
        home = Where.NVME if grad_on_nvme else grad_home
        grad_bytes = swap.gradients if grad_on_nvme else share * 4
        stored = config.infinity.offloaded_gradient_dtype if grad_on_nvme else "fp32"
        if config_steps_in_backward(config):  # each reduced piece steps and goes back at once; with CUDA it is
            # copied into one reused host buffer first, the widest piece's size (zero/unit_optimizer.py _on_host)
            landing = max(layout.runs, default=0) * 4 if cuda else 0
            rows.append(Row("model states", "reduced fp32 gradient: never held whole (the step runs in backward, "
                            "unit by unit; with CUDA one host buffer of the widest piece)", home, landing))  # fmt: skip
        else:
            rows.append(Row("model states", f"reduced {stored} gradient (this rank's share)", home, grad_bytes))
        if zero.stage == 2:
            in_flight = min(trainable, 2 * zero.reduce_bucket_size)
            rows.append(Row("buffers", "gradient buckets in flight", Where.DEVICE, in_flight * 4))
        else:
            rows.append(_stage3_gradient_buckets(owners, config, n))
    if zero.stage in (1, 2) and n > 1:  # the step's gathers of new weights (zero/bucket_optimizer.py)
        largest = max(layout.runs, default=0)  # elements of the largest bucket piece
        part = min(plan.tile_numel, largest, plan.gather_numel) if offload_opt.enabled else plan.gather_numel
        if offload_opt.enabled or largest > plan.gather_numel:  # else each bucket is gathered in place
            rows.append(Row("buffers", f"new weights' gathers in flight ({MAX_TILE_GATHERS} of {n} x {part:,} "
                            "elements)", Where.DEVICE, MAX_TILE_GATHERS * n * part * width))  # fmt: skip

    # ---- the optimizer's NVMe rings and workspaces: the largest tile (tiles never cross a unit or a bucket) ----
    tile = min(plan.tile_numel, max(layout.runs, default=0))
    if offload_opt.device == "nvme":
        count = plan.optimizer_buffers
        ring_home = _home("cpu", offload_opt.pin_memory, cuda=cuda)
        rows.append(Row("buffers", f"optimizer staging ring ({count} tiles of {tile:,} elements)", ring_home,
                        int(count * tile * state_width * 4)))  # fmt: skip
        if grad_on_nvme:
            rows.append(Row("buffers", "gradient staging ring", ring_home, count * tile * plan.gradient_itemsize))
            if plan.gradient_itemsize != 4:  # the tile stepping's gradient, in fp32 (zero/grads.py)
                rows.append(Row("buffers", "decoded gradient of one tile", Where.HOST, tile * 4))
    if offload_opt.enabled and split:  # the tile stepping's master, joined (zero/split_master.py)
        rows.append(Row("buffers", "joined split master of one tile", Where.HOST,
                        tile * MasterSplitter.BYTES_PER_ELEMENT))  # fmt: skip
    if offload_opt.enabled and state_dtype != "fp32":  # the tile stepping's states, decoded (zero/tiles.py)
        rows.append(Row("buffers", f"decoded {state_dtype} optimizer states of one tile", Where.HOST,
                        tile * momentum_states * 4))  # fmt: skip

    activations = _activations(arch, shape)
    rows += activations
    on_nvme = "nvme" in (offload_opt.device, offload_param.device)
    if activations and not cuda and policy_for(on_nvme=on_nvme, host_share=plan.host_share) is KEEP:
        rows.append(Row("buffers", f"freed blocks the heap keeps for the next step (KEEP: {KEPT_ACTIVATION_COPIES}x "
                        "the activations, measured)", Where.DEVICE,
                        KEPT_ACTIVATION_COPIES * sum(row.nbytes for row in activations)))  # fmt: skip
    checkpoint = trainable * (1 + momentum_states) * 4 + (numel - trainable) * width
    return Estimate(rows=rows, numel=numel, trainable_numel=trainable, plan=plan, swap=swap,
                    checkpoint_bytes=checkpoint)  # fmt: skip
