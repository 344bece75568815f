"""`infinity ckpt info | to-fp32 | from-deepspeed`: look into a checkpoint, turn it into a plain fp32 state dict, or
make one from a DeepSpeed ZeRO checkpoint."""

from __future__ import annotations

import argparse
import sys

from infinity.errors import CheckpointError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="infinity ckpt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="tags, step, world size, stage, arrays and sizes of a checkpoint")
    info.add_argument("ckpt_dir", help="the save_dir given to save_checkpoint (or one tag's folder)")
    info.add_argument("--tag", default=None, help="the tag to describe (default: the one `latest` names)")
    info.add_argument("--arrays", action="store_true", help="list every array (default: the 5 largest)")
    fp32 = commands.add_parser(
        "to-fp32", help="write the fp32 weights as safetensors shards + model.safetensors.index.json (zero_to_fp32)"
    )
    fp32.add_argument("ckpt_dir", help="the save_dir given to save_checkpoint (or one tag's folder)")
    fp32.add_argument("out_dir", help="folder for the safetensors files (created)")
    fp32.add_argument("--tag", default=None, help="the tag to convert (default: the one `latest` names)")
    fp32.add_argument("--max-shard-size", default="5GB", help="largest shard file, e.g. 5GB, 500MB (default 5GB)")
    fp32.add_argument("--exclude-frozen-parameters", action="store_true",
                      help="only the parameters the run trained (a LoRA fine-tune's adapters), and the buffers")
    convert = commands.add_parser(
        "from-deepspeed", help="convert a DeepSpeed ZeRO checkpoint (stages 1-3) into one infinity resumes"
    )
    convert.add_argument("ckpt_dir", help="DeepSpeed's save_dir (with `latest`), or one tag's folder")
    convert.add_argument("out_dir", help="folder for the infinity checkpoint (load_checkpoint(out_dir) resumes it)")
    convert.add_argument("--tag", default=None, help="the tag to convert (default: the one `latest` names)")
    args = parser.parse_args(argv)
    from infinity.checkpoint.consolidate import describe, to_fp32

    try:
        if args.command == "info":
            print(describe(args.ckpt_dir, args.tag, every_array=args.arrays))
        elif args.command == "from-deepspeed":
            from infinity.checkpoint.from_deepspeed import from_deepspeed

            print(from_deepspeed(args.ckpt_dir, args.out_dir, tag=args.tag))
        else:
            files = to_fp32(args.ckpt_dir, args.out_dir, tag=args.tag, max_shard_size=args.max_shard_size,
                            exclude_frozen_parameters=args.exclude_frozen_parameters)
            print("\n".join(files))
    except (CheckpointError, ValueError) as e:
        print(f"infinity ckpt {args.command}: {e}", file=sys.stderr)
        return 1
    return 0
