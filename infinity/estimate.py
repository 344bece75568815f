"""`infinity estimate`: bytes per rank on each tier (device, host pinned, host other, NVMe) for a named model and
a config, before anything runs, and the largest model of its family that this machine's RAM and free disk hold
under that config. The arithmetic is infinity/budget.py's; this module describes the model (built on
the meta device: nothing is allocated), measures the runtime's own footprint, and prints."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from infinity.budget import Architecture, Estimate, Owner, RunShape, Where, estimate, owners_of
from infinity.config import AutoError, AutoValues, ConfigError, load_json, parse_config
from infinity.memory.plan import host_memory_bytes

GIB = 1 << 30
PROG = "infinity estimate"
# What a training process holds whatever its model's size: Python, torch, transformers with the model's own code,
# and the engine's fixed machinery (process group, I/O threads, allocator arenas, code paths imported on first
# use), measured by training the same kind of model shrunk to a negligible size (one layer of width 64) for two
# steps under the same config, in a fresh process, with any swap files in a temporary folder.
RUNTIME_PROBE = """
import json, os, sys, tempfile
import torch, infinity
from transformers import AutoConfig, AutoModelForCausalLM
fields, config = json.loads(sys.argv[1]), json.loads(sys.argv[2])
with tempfile.TemporaryDirectory() as folder:
    for key in ("offload_param", "offload_optimizer"):
        section = config.get("zero_optimization", {}).get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            section["nvme_path"] = folder
    model_config = AutoConfig.for_model(**fields)
    if config.get("zero_optimization", {}).get("stage") == 3:
        with infinity.zero.Init(config=config):
            model = AutoModelForCausalLM.from_config(model_config)
    else:
        model = AutoModelForCausalLM.from_config(model_config)
    engine, *_ = infinity.initialize(model=model, config=config)
    for _ in range(2):
        tokens = torch.randint(0, model_config.vocab_size, (engine.train_micro_batch_size_per_gpu(), 16))
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    engine.destroy()
print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024)  # the peak, as a run's summary
"""
# The probe's model: the same kind, every size field shrunk (whichever of these names the config uses).
SHRUNK = {"hidden_size": 64, "n_embd": 64, "num_hidden_layers": 1, "n_layer": 1, "num_attention_heads": 2, "n_head": 2,
          "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 128, "head_dim": 32}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="gpt2-tiny",
                        help="a named model (see infinity train --help) or a config .json")  # fmt: skip
    parser.add_argument("--config", required=True, help="the DeepSpeed-style JSON config the run would use")
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks, all on this machine: they share its host memory and disk")  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the config's")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="as infinity train chooses it")
    parser.add_argument("--nvme-path", default=None, help="where the swap files would go (for the free-space fit)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the estimate as JSON")
    return parser  # fmt: skip


def describe(shape) -> tuple[list[Owner], Architecture]:
    """The parameter owners of the model built on the meta device, and its transformer dimensions."""
    import torch
    from transformers import AutoModelForCausalLM

    from infinity.train.models import hf_config

    config = hf_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return owners_of(model), Architecture.of(config)


def runtime_bytes(shape, raw: dict) -> int | None:
    """Resident bytes of the fixed part of a run, measured in a fresh process (RUNTIME_PROBE); None if it fails."""
    fields = {k: v for k, v in shape.fields.items() if k not in ("architectures", "transformers_version")}
    fields.update({k: v for k, v in SHRUNK.items() if k in fields})
    fields.update(bos_token_id=0, eos_token_id=0, pad_token_id=None)
    config = json.loads(json.dumps(raw))
    config["train_micro_batch_size_per_gpu"] = 2
    config.pop("train_batch_size", None)
    config.pop("gradient_accumulation_steps", None)
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    env.pop("MASTER_ADDR", None)
    try:
        done = subprocess.run([sys.executable, "-c", RUNTIME_PROBE, json.dumps(fields), json.dumps(config)],
                              capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    except (subprocess.TimeoutExpired, OSError) as e:
        print(f"{PROG}: the runtime could not be measured ({e})", file=sys.stderr)
        return None
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{PROG}: the runtime could not be measured (exit {done.returncode}: {last})", file=sys.stderr)
        return None


def momentum_states(raw: dict) -> int:
    """fp32 optimizer states per element the config's optimizer keeps (Adam 2, SGD 1 with momentum, else 0)."""
    optimizer = raw.get("optimizer") or {}
    kind = str(optimizer.get("type", "adamw")).lower()
    if kind == "sgd":
        return 1 if float((optimizer.get("params") or {}).get("momentum", 0) or 0) else 0
    return 2


def plan_estimate(shape, raw: dict, args, *, owners_arch=None, available: int | None = None) -> tuple[Estimate, dict]:
    """The estimate for one model under the config (raw, with the command line's overrides); ``available``: the
    node's host memory to plan with (default: this machine's), shared by ``args.world_size`` ranks."""
    import torch

    owners, arch = owners_arch or describe(shape)
    config = parse_config(raw, world_size=args.world_size, auto=AutoValues(hidden_size=arch.hidden or None))
    width = 2 if (config.bf16.enabled or config.fp16.enabled) else 4
    run = RunShape(world_size=args.world_size, micro_batch=config.train_micro_batch_size_per_gpu,
                   seq_len=args.seq_len, dtype_bytes=width, local_ranks=args.world_size,
                   host_available=available if available is not None else host_memory_bytes())  # fmt: skip
    return estimate(owners, arch, config, run, cuda=torch.cuda.is_available(), momentum_states=momentum_states(raw)), {
        "micro_batch": run.micro_batch, "dtype_bytes": width, "stage": config.zero.stage}


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:8.3f} GiB"


def _nvme_folder(raw: dict, override: str | None) -> str | None:
    zero = raw.get("zero_optimization") or {}
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            return override or section.get("nvme_path")
    return None


def _existing(folder: str | None) -> str | None:
    """The folder, or its nearest existing parent (where it would be made): free space is measured there."""
    if folder is None:
        return None
    folder = os.path.abspath(folder)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return folder


def fits(result: Estimate, *, runtime: int, ranks: int, ram: int, disk: int | None,
         init_given_back: bool = True) -> bool:  # fmt: skip
    """``init_given_back``: the swap folder's filesystem gives zero.Init's punched blocks back (the engine probes
    it, and credits the copy only then); else the copy counts beside the run's files."""
    import torch

    cuda = torch.cuda.is_available()
    host = (result.host_bytes(cuda=cuda) + runtime) * ranks
    run, init = result.total(Where.NVME), result.nvme_during_init
    nvme = (max(run, init) if init_given_back else run + init) * ranks  # the copy is given back as it is taken
    device_ok = not cuda or result.total(Where.DEVICE) <= torch.cuda.get_device_properties(0).total_memory
    return device_ok and host <= ram and (nvme == 0 or (disk is not None and nvme <= disk))


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from infinity.train import models
    from infinity.train.options import SECTIONS, apply_dtype, apply_micro_batch, quiet_transformers, unfilled_auto

    quiet_transformers()
    for bad, message in ((args.world_size < 1, f"--world-size {args.world_size}: at least 1"),
                         (args.seq_len < 2, f"--seq-len {args.seq_len}: at least 2")):  # fmt: skip
        if bad:
            print(f"{PROG}: error: {message}", file=sys.stderr)
            return 2
    try:
        shape = models.resolve(args.model)
        raw = load_json(args.config)
        for key in SECTIONS:
            if key in raw and not isinstance(raw[key], dict):
                raise ConfigError(f"{key} must be a JSON object, got {raw[key]!r}")
    except (models.UnknownModelError, ConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    notes: list[str] = []
    apply_micro_batch(raw, args.micro_batch)
    apply_dtype(raw, args.dtype, notes)
    try:
        result, facts = plan_estimate(shape, raw, args)
    except models.UnknownModelError as e:  # a config transformers cannot build as a causal LM
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except AutoError as e:
        print(f"{PROG}: error: --config {args.config}: {unfilled_auto(e, PROG)}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"{PROG}: error: --config {args.config}: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f'{PROG}: error: it builds transformers models on the meta device: pip install -e ".[train]" ({e})',
              file=sys.stderr)  # fmt: skip
        return 2
    import torch

    cuda = torch.cuda.is_available()
    measured = runtime_bytes(shape, raw)
    runtime = measured or 0
    host = result.host_bytes(cuda=cuda)
    lines = [f"{shape.name}: {result.numel / 1e6:,.1f}M parameters ({result.trainable_numel / 1e6:,.1f}M trainable), "
             f"ZeRO stage {facts['stage']}, world size {args.world_size}, {facts['dtype_bytes']}-byte compute dtype, "
             f"micro-batch {facts['micro_batch']} x {args.seq_len} tokens; per rank:"]  # fmt: skip
    lines += [f"  {n}" for n in notes]
    for category in ("model states", "buffers", "activations"):
        for row in (r for r in result.rows if r.category == category):
            lines.append(f"  {category:13} {row.where.value:12} {_gib(row.nbytes)}  {row.what}")
    lines.append("  totals        " + ", ".join(f"{w.value} {result.total(w) / GIB:.3f} GiB" for w in Where))
    device = "" if cuda else " (no CUDA: the device is the host)"
    fixed = (f"{runtime / GIB:.3f} GiB runtime (python, torch, transformers, the engine: measured)" if measured
             else "the runtime (could not be measured)")  # fmt: skip
    lines.append(f"  host RSS      {_gib(host + runtime)}  = {host / GIB:.3f} GiB for the run{device} + {fixed}")
    lines.append(f"  checkpoints   {_gib(result.checkpoint_io_bytes)}  more host memory while one is saved or loaded "
                 "(its transfers in flight)")
    ram = host_memory_bytes()
    folder = _existing(_nvme_folder(raw, args.nvme_path))
    disk = shutil.disk_usage(folder).free if folder else None
    family = [m for m in models.family_members(shape.family)] if shape.name in models.CATALOG else []
    from infinity.memory.nvme_store import can_punch_holes

    punches = bool(folder) and can_punch_holes(folder)  # zero.Init's copy is given back only where it can be
    largest = None
    for member in family if measured else []:  # without the runtime's figure no fit is claimed
        member_result, _ = plan_estimate(member, raw, args)
        if fits(member_result, runtime=runtime, ranks=args.world_size, ram=ram, disk=disk,
                init_given_back=punches):
            largest = member.name
    where = f" and {disk / GIB:.1f} GiB free at {folder}" if disk is not None else ""
    if not family:
        verdict = "(a model from a file: no family to walk)"
    elif not measured:
        verdict = "no fit claimed: the runtime could not be measured"
    else:
        verdict = f"largest {shape.family} that fits: {largest}" if largest else f"no {shape.family} fits"
    lines.append(f"  this machine  {ram / GIB:.1f} GiB RAM available{where}, for {args.world_size} rank(s): {verdict}")
    print("\n".join(lines))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"model": shape.name, "numel": result.numel, "runtime_bytes": measured, "host_bytes": host,
                       "tiers": {w.value: result.total(w) for w in Where}, "largest_fitting": largest,
                       "rows": [{"category": r.category, "what": r.what, "where": r.where.value, "bytes": r.nbytes}
                                for r in result.rows]}, f, indent=2)  # fmt: skip
    return 0
