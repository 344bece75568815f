"""The summary `infinity train` ends with: gathered from every rank (bytes summed, peak RSS the largest), so the
numbers describe the whole run, not rank 0."""

from __future__ import annotations

import dataclasses

import torch

from infinity.train.disk import PhaseTraffic
from infinity.train.medians import steady_medians
from infinity.zero.collectives import all_reduce_max_, all_reduce_sum_

GB = 1e9
GIB = 1 << 30


@dataclasses.dataclass(kw_only=True)
class IoTotals:
    """NVMe traffic of this rank so far, per owner ("parameters", "optimizer", "gradients")."""

    read: dict[str, int]
    written: dict[str, int]
    blocked_s: float
    held_nvme: int  # bytes of swap-file segments
    staging: int = 0  # bytes of the host staging rings in front of NVMe

    @property
    def read_bytes(self) -> int:
        return sum(self.read.values())

    @property
    def write_bytes(self) -> int:
        return sum(self.written.values())

    def minus(self, earlier: IoTotals) -> IoTotals:
        return IoTotals(
            read={k: v - earlier.read.get(k, 0) for k, v in self.read.items()},
            written={k: v - earlier.written.get(k, 0) for k, v in self.written.items()},
            blocked_s=self.blocked_s - earlier.blocked_s,
            held_nvme=self.held_nvme,
            staging=self.staging,
        )


def io_totals(tier_stats: dict) -> IoTotals:
    read = {owner: s["traffic"]["nvme_read"]["bytes"] for owner, s in tier_stats.items()}
    written = {owner: s["traffic"]["nvme_write"]["bytes"] for owner, s in tier_stats.items()}
    blocked = sum(s["traffic"][d]["blocked_s"] for s in tier_stats.values() for d in ("nvme_read", "nvme_write"))
    held = sum(s["held_bytes"].get("nvme", 0) for s in tier_stats.values())
    staging = sum(s["staging_bytes"] for s in tier_stats.values())
    return IoTotals(read=read, written=written, blocked_s=blocked, held_nvme=held, staging=staging)


PAGE_BYTES = 4096


@dataclasses.dataclass(kw_only=True, slots=True)
class StepUsage:
    """What the kernel did for a step of rank 0 (getrusage: every thread of the process, the I/O threads' too),
    beside the step's NVMe traffic; ``kernel_figures`` gives their medians over the steps after the first, which
    also faults in what the run keeps. Reused memory shows as few minor faults against the pages moved; a step
    that maps fresh memory for its transfers takes about one per 4 KiB page moved (the I/O target of the issue
    this answers: minor faults at most 5% of the pages, system time at most 20% of the step)."""

    step_s: float
    system_s: float  # system CPU seconds
    user_s: float  # user CPU seconds
    minor_faults: float
    moved_bytes: float  # this rank's NVMe reads + writes

    @property
    def system_part(self) -> float:
        return self.system_s / self.step_s if self.step_s else 0.0

    @property
    def faults_per_page_moved(self) -> float | None:
        return self.minor_faults / (self.moved_bytes / PAGE_BYTES) if self.moved_bytes else None


def kernel_figures(steps: list[StepUsage]) -> StepUsage | None:
    """Each figure's median over the steps after the first (all of them where only one ran); None where none
    ran."""
    return steady_medians(steps)


def _across_ranks(engine, values: list[float], reduce) -> list[float]:
    """Through the engine's group and device (NCCL reduces device tensors only); failures are CollectiveErrors."""
    tensor = torch.tensor(values, dtype=torch.float64, device=engine.device)
    return reduce(engine.comm, tensor).tolist()


@dataclasses.dataclass(kw_only=True)
class Summary:
    heading: str
    losses: list[float]
    first_step: int
    total_s: float
    loop_s: float
    median_step_s: float
    tokens_per_s: float
    peak_rss_max: float
    peak_rss_rank0: float
    peak_rss_sum: float  # every rank's peak added up: what the node held at most (ranks of one node)
    io: IoTotals  # summed over ranks
    blocked_s_max: float
    disk_busy_s: float | None
    swap_folders: list[str]
    checkpoint: str | None
    kernel: StepUsage | None = None  # rank 0's medians (kernel_figures)
    disk_phases: dict[str, PhaseTraffic] | None = None  # rank 0's medians per phase (train/disk.py DiskPhases)
    step_behind_forward: bool = False  # the optimizer's step ran behind the next forward (its I/O in the forward's)
    step_in_backward: bool = False  # the optimizer's step ran in the boundary's backward (its time in backward's)

    @classmethod
    def gather(cls, *, engine, plan, losses, first_step, step_times, loop_s, total_s, io: IoTotals, disk_busy_s,
               peak_rss, checkpoint, median_step_s, tokens_per_step, kernel=None,
               disk_phases=None) -> Summary:  # fmt: skip
        """Collective: every rank calls it, in the same order."""
        owners = sorted(set(io.read) | set(io.written))
        summed = _across_ranks(engine, [io.read.get(o, 0) for o in owners] + [io.written.get(o, 0) for o in owners]
                               + [io.held_nvme, io.staging], all_reduce_sum_)  # fmt: skip
        rss_max, blocked_max = _across_ranks(engine, [float(peak_rss), io.blocked_s], all_reduce_max_)
        (rss_sum,) = _across_ranks(engine, [float(peak_rss)], all_reduce_sum_)
        n = len(owners)
        io_sum = IoTotals(read=dict(zip(owners, summed[:n], strict=True)),
                          written=dict(zip(owners, summed[n : 2 * n], strict=True)),
                          blocked_s=io.blocked_s, held_nvme=int(summed[-2]), staging=int(summed[-1]))  # fmt: skip
        numel = plan.numel
        heading = (f"{plan.shape.name} ({numel / 1e6:,.1f}M parameters), ZeRO stage {engine.zero_optimization_stage()}"
                   f", world size {engine.world_size}, {_dtype_name(engine)}, micro-batch "
                   f"{engine.train_micro_batch_size_per_gpu()} x {plan.args.seq_len} tokens"
                   f" x {engine.gradient_accumulation_steps()} accumulation")  # fmt: skip
        return cls(heading=heading, losses=losses, first_step=first_step, total_s=total_s, loop_s=loop_s,
                   median_step_s=median_step_s,
                   tokens_per_s=tokens_per_step / median_step_s if median_step_s else 0.0,
                   peak_rss_max=rss_max, peak_rss_rank0=float(peak_rss), peak_rss_sum=rss_sum, io=io_sum,
                   blocked_s_max=blocked_max,
                   disk_busy_s=disk_busy_s, swap_folders=plan.nvme_paths, checkpoint=checkpoint,
                   kernel=kernel, disk_phases=disk_phases,
                   step_behind_forward=engine.zero_optimizer.steps_behind_forward,
                   step_in_backward=engine.zero_optimizer.steps_taken_in_backward > 0)  # fmt: skip

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"infinity train: done. {self.heading}"]
        if self.losses:
            first, last = self.first_step + 1, self.first_step + len(self.losses)
            lines.append(f"  loss          {self.losses[0]:.4f} (step {first}) -> {self.losses[-1]:.4f} (step {last})")
            lines.append(f"  time          {self.total_s:.1f} s in all, {self.loop_s:.1f} s training; median step "
                         f"{self.median_step_s:.2f} s, {self.tokens_per_s:,.0f} tokens/s")  # fmt: skip
        else:
            lines.append("  loss          no steps trained (the checkpoint was already at --steps)")
        lines.append(f"  peak RSS      {self.peak_rss_max / GIB:.2f} GiB (the largest rank; rank 0: "
                     f"{self.peak_rss_rank0 / GIB:.2f} GiB)")  # fmt: skip
        if self.swap_folders and self.io.held_nvme and (self.io.read_bytes or self.io.write_bytes):
            moved = ", ".join(
                f"{owner} read {self.io.read.get(owner, 0) / GB:.2f} GB / wrote "
                f"{self.io.written.get(owner, 0) / GB:.2f} GB"
                for owner in sorted(self.io.read) if self.io.read.get(owner) or self.io.written.get(owner)
            )
            lines.append(f"  NVMe traffic  {moved} (all ranks)")
            lines.append(f"  swap files    {self.io.held_nvme / GB:.2f} GB under {', '.join(self.swap_folders)} "
                         "(all ranks; removed at the end)")  # fmt: skip
            waits = (f"  I/O waits     blocked {self.blocked_s_max:.2f} s of {self.loop_s:.1f} s training "
                     "(the most on a rank)")  # fmt: skip
            if self.disk_busy_s:
                hidden = max(0.0, 1.0 - self.blocked_s_max / self.disk_busy_s)
                waits += (f"; the disk was busy {self.disk_busy_s:.1f} s: {100 * hidden:.0f}% of it hidden behind "
                          "compute")  # fmt: skip
            lines.append(waits)
            if self.disk_phases is not None:
                lines.append(self._disk_phases_line())
        elif not self.losses:
            lines.append("  NVMe traffic  none: no step ran")
        else:
            lines.append("  NVMe traffic  none: the config offloads nothing to NVMe")
        if self.kernel is not None:
            lines.append(self._kernel_line())
        lines.append(f"  checkpoint    {self.checkpoint or 'none (pass --save DIR to keep one)'}")
        return "\n".join(lines)

    def _steps_medians_cover(self) -> str:
        return "the step" if len(self.losses) < 2 else "the steps after the first"

    def _disk_phases_line(self) -> str:
        parts = [f"{name} {p.wall_s:.2f} s ({p.read_bytes / GB:.2f} GB read, {p.written_bytes / GB:.2f} GB written, "
                 f"busy {p.busy_s:.2f} s)" for name, p in self.disk_phases.items()]  # fmt: skip
        behind = "; the optimizer's step runs behind the forward: its I/O counts there" if self.step_behind_forward \
            else "; the optimizer's step runs in backward: its time counts there" if self.step_in_backward else ""
        device = "the first swap folder's device" if len(self.swap_folders) > 1 else "the swap folder's device"
        return (f"  disk phases   {', '.join(parts)}; medians over {self._steps_medians_cover()}: rank 0's time, "
                f"{device}'s bytes and busy time (every process's I/O on it){behind}")

    def _kernel_line(self) -> str:
        k = self.kernel
        steps = self._steps_medians_cover()
        line = (f"  kernel        {k.system_s:.2f} s of system time a step ({100 * k.system_part:.0f}% of the step; "
                f"user {k.user_s:.2f} s), {k.minor_faults:,.0f} minor faults a step")  # fmt: skip
        per_page = k.faults_per_page_moved
        if per_page is not None:
            line += f" ({100 * per_page:.1f}% of the 4 KiB pages moved to and from NVMe)"
        return line + f"; medians over {steps}, rank 0, all threads"


def _dtype_name(engine) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(engine.compute_dtype, "?")
