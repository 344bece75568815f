"""The training run of `infinity train`, read top to bottom: build, (resume), the loop, (save), the summary."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import statistics
import sys
import time

import torch

import infinity
from infinity.checkpoint.consolidate import MODEL_CONFIG
from infinity.errors import CheckpointError
from infinity.memory.host import process_status_bytes
from infinity.train import interrupt, models
from infinity.train.data import token_source
from infinity.train.disk import DiskBusy, DiskPhases
from infinity.train.plan import Plan
from infinity.train.progress import Progress, ProgressLogHandler, StepFigures
from infinity.train.resume import checkpoint_and_tag
from infinity.train.summary import StepUsage, Summary, io_totals, kernel_figures
from infinity.zero.collectives import all_reduce_mean

logger = logging.getLogger("infinity")


class Run:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.args = plan.args
        self.steps_done = 0
        self.saved_to: str | None = None
        self.progress: Progress | None = None

    # ---- what the caller needs when the run ends early ----
    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def checkpoint_note(self) -> str:
        return f"; last checkpoint: {self.saved_to}" if self.saved_to else ""

    def _log_to(self, progress: Progress) -> None:
        """Rank 0's engine lines go between bar redraws; other ranks say only warnings."""
        infinity_logger = logging.getLogger("infinity")
        if self.plan.rank == 0:
            handler: logging.Handler = ProgressLogHandler(progress)
        else:
            handler = logging.StreamHandler(sys.stderr)
            handler.setLevel(logging.WARNING)
            handler.setFormatter(logging.Formatter(f"[infinity rank {self.plan.rank}] %(message)s"))
        infinity_logger.handlers[:] = [handler]
        infinity_logger.setLevel(logging.INFO)
        infinity_logger.propagate = False

    def _build(self):
        """The model under zero.Init at stage 3 (each rank builds only its pieces), then the engine."""
        from transformers import AutoModelForCausalLM

        config = self.plan.config
        stage = int((config.get("zero_optimization") or {}).get("stage", 0))
        torch.manual_seed(self.args.seed)
        hf_config = models.hf_config(self.plan.shape, seq_len=self.args.seq_len)
        init = infinity.zero.Init(config=config) if stage == 3 else contextlib.nullcontext()
        with init:
            model = AutoModelForCausalLM.from_config(hf_config)
        engine, *_ = infinity.initialize(model=model, config=config)
        return engine

    def train(self) -> Summary:
        args, plan = self.args, self.plan
        started = time.perf_counter()
        self.progress = Progress(total_steps=args.steps, first_step=0, enabled=plan.rank == 0)
        self._log_to(self.progress)
        for note in plan.notes:
            logger.info(note)
        engine = self._build()
        first_step = 0
        if args.resume is not None:
            path, _ = engine.load_checkpoint(*checkpoint_and_tag(args.resume))
            if path is None:
                raise CheckpointError(f"--resume {args.resume!r}: no checkpoint there (no `latest` file)")
            first_step = engine.global_steps
            logger.info("resumed from %s at step %d", path, first_step)
            if first_step >= args.steps:
                logger.info("the checkpoint is at step %d, --steps is %d: nothing to train", first_step, args.steps)
        self.steps_done = first_step
        source = token_source(args.data, vocab_size=plan.vocab_size, seq_len=args.seq_len, seed=args.seed)
        micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        tokens_per_step = micro * accumulation * args.seq_len * engine.world_size
        self.progress.close()
        self.progress = Progress(total_steps=args.steps, first_step=first_step, enabled=plan.rank == 0)
        self._log_to(self.progress)
        swap_folder = plan.nvme_paths[0] if plan.nvme_paths else None
        disk, phases = DiskBusy(swap_folder), DiskPhases(swap_folder)
        io_start = io_before = io_totals(engine.tier_stats())
        loop_started = time.perf_counter()
        losses: list[float] = []
        step_times: list[float] = []
        usages: list[StepUsage] = []
        for step in range(first_step, args.steps):
            step_started = time.perf_counter()
            usage_before = resource.getrusage(resource.RUSAGE_SELF)
            loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
            phases.begin_step()
            for m in range(accumulation):
                tokens = source.batch(rank=engine.global_rank, micro_step=step * accumulation + m,
                                      micro_batch=micro, seq_len=args.seq_len)  # fmt: skip
                with phases.phase("forward"):
                    loss = engine(input_ids=tokens, labels=tokens).loss  # the model shifts the labels itself
                with phases.phase("backward"):
                    engine.backward(loss)
                with phases.phase("step"):
                    engine.step()
                loss_sum += loss.detach().double()
                interrupt.raise_if_requested()  # a signal whose own raise Python dropped (train/interrupt.py)
            if step + 1 == args.steps:  # a step behind the forward has no next forward: its tiles count here,
                engine.finish_step()  # in the step's time, in no phase (the other steps' run in their forward)
            # the mean over ranks (what plain PyTorch on the whole batch reports), through the engine's group
            all_reduce_mean(engine.comm, loss_sum, async_op=False)
            losses.append(loss_sum.item() / accumulation)
            step_s = time.perf_counter() - step_started
            step_times.append(step_s)
            self.steps_done = step + 1
            io_now = io_totals(engine.tier_stats())
            moved = (io_now.read_bytes + io_now.write_bytes) - (io_before.read_bytes + io_before.write_bytes)
            io_before = io_now
            usage = resource.getrusage(resource.RUSAGE_SELF)
            usages.append(StepUsage(step_s=step_s, system_s=usage.ru_stime - usage_before.ru_stime,
                                    user_s=usage.ru_utime - usage_before.ru_utime, moved_bytes=moved,
                                    minor_faults=usage.ru_minflt - usage_before.ru_minflt))  # fmt: skip
            self.progress.update(StepFigures(step=step + 1, loss=losses[-1], step_s=step_s,
                                             tokens_per_s=tokens_per_step / step_s, io_gbps=moved / step_s / 1e9))
            if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                self._save(engine)
        loop_s = time.perf_counter() - loop_started
        io = io_totals(engine.tier_stats()).minus(io_start)  # the loop's, before a save reads the swap files
        disk_busy_s = disk.seconds()
        if args.save and self.steps_done > first_step:
            self._save(engine)
        self.progress.close()
        summary = Summary.gather(
            engine=engine, plan=plan, losses=losses, first_step=first_step, step_times=step_times, loop_s=loop_s,
            total_s=time.perf_counter() - started, io=io, disk_busy_s=disk_busy_s,
            peak_rss=process_status_bytes("VmHWM"), checkpoint=self.saved_to,
            median_step_s=statistics.median(step_times) if step_times else 0.0, tokens_per_step=tokens_per_step,
            kernel=kernel_figures(usages), disk_phases=phases.medians(),
        )  # fmt: skip
        engine.destroy()
        return summary

    def _save(self, engine) -> None:
        if self.plan.rank == 0:
            _write_model_config(engine.module.config, self.args.save)
        engine.save_checkpoint(self.args.save)
        self.saved_to = os.path.join(os.path.abspath(self.args.save), f"global_step{engine.global_steps}")
        logger.info("checkpoint saved: %s", self.saved_to)


def _write_model_config(config, save_dir: str) -> None:
    """The model's config.json in the save folder, where `infinity ckpt to-fp32` finds it and copies it beside the
    weights, so that from_pretrained loads them. Without training's use_cache=False (the loaded model gets the
    model type's default); written whole or not at all."""
    fields = json.loads(config.to_json_string())
    fields.pop("use_cache", None)
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, MODEL_CONFIG)
    with open(path + ".tmp", "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
