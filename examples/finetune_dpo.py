"""Preference tuning with TRL's DPOTrainer on infinity: the policy and its frozen reference model both ZeRO-3
partitioned, their weights on NVMe. Two lines differ from a plain TRL script (each marked "plain TRL:" below):

    args = InfinityDPOConfig(infinity=config, ...)                         # args = DPOConfig(...)
    trainer = InfinityDPOTrainer(model=model, ref_model=ref_model, ...)    # trainer = DPOTrainer(...)

TRL makes the reference model a DeepSpeed inference engine; here it becomes an infinity inference engine with the
same config, partitioned over the ranks with its pieces on NVMe beside the policy's. The models are a tiny Llama
built here with a character tokenizer (examples/tiny_lm.py: nothing to download); each prompt is a run of the
alphabet, the chosen completion continues it and the rejected one runs backwards. Prints ``loss A -> B`` last
(the first logged DPO loss, log 2 at the start, and the last). Needs the `hf` extra (pip install -e ".[hf]").

    python examples/finetune_dpo.py --steps 20 --nvme-path ./swap
    torchrun --nproc_per_node 2 examples/finetune_dpo.py --steps 20 --nvme-path ./swap
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

try:  # the `hf` extra: transformers, trl
    from datasets import Dataset
    from tiny_lm import CHARACTERS, char_tokenizer, tiny_llama, zero3_nvme

    from infinity.integrations.trl import InfinityDPOConfig, InfinityDPOTrainer
except ImportError as e:
    raise SystemExit(f'examples/finetune_dpo.py needs the hf extra: pip install -e ".[hf]" ({e})') from None


def preferences(n: int) -> Dataset:
    letters = CHARACTERS[:26]

    def run(start: int, length: int, step: int = 1) -> str:
        return " ".join(letters[(start + step * i) % 26] for i in range(length))

    return Dataset.from_dict({"prompt": [run(s, 4) + " " for s in range(n)],
                              "chosen": [run(s + 4, 4) for s in range(n)],
                              "rejected": [run(s + 2, 4, step=-1) for s in range(n)]})  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nvme-path", default=None, help="the swap folder (default: a temp folder, removed after)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dpo_") as scratch:  # the trainer's output_dir and the default swap
        train(args, scratch)
    return 0


def train(args, scratch: str) -> None:
    """The DPO run; ``scratch`` (removed after) holds the trainer's output_dir and, unless named, the swap folder."""
    nvme_path = args.nvme_path or os.path.join(scratch, "swap")
    os.makedirs(nvme_path, exist_ok=True)

    tokenizer = char_tokenizer()
    model, ref_model = tiny_llama(len(tokenizer)), tiny_llama(len(tokenizer))  # the same seeded weights
    # plain TRL: args = DPOConfig(...)
    dpo_args = InfinityDPOConfig(
        infinity=zero3_nvme(nvme_path),
        output_dir=os.path.join(scratch, "output"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        beta=0.1,
        max_length=32,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        bf16=False,  # fp32: a CPU without bf16 units is tens of times slower in bf16
        use_cpu=not torch.cuda.is_available(),
    )
    # plain TRL: trainer = DPOTrainer(model=model, ref_model=ref_model, args=dpo_args, ...)
    trainer = InfinityDPOTrainer(model=model, ref_model=ref_model, args=dpo_args,
                                 train_dataset=preferences(64 * args.steps), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    trainer.engine.destroy()  # collective: every rank calls it, the reference's too
    trainer.ref_model.destroy()
    if trainer.is_world_process_zero():
        margin = logs[-1]["rewards/margins"]
        print(f"reward margin of the chosen over the rejected completion at the last step: {margin:.4f}", flush=True)
        print(f"{args.steps} steps: loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
