"""Train a transformers causal LM with Hugging Face's Trainer on infinity. Two lines differ from a plain Trainer
script (each marked "plain Trainer:" below, with what it replaces):

    args = InfinityTrainingArguments(infinity=config, ...)   # args = TrainingArguments(deepspeed=config, ...)
    trainer = InfinityTrainer(model=model, args=args, ...)    # trainer = Trainer(model=model, args=args, ...)

The config is a DeepSpeed JSON (configs/zero3.json by default, or --config); the batch sizes, accumulation,
clipping, optimizer and scheduler settings come from the TrainingArguments, as with DeepSpeed. A JSON written for
the Trainer (its values "auto" or equal to the arguments') is taken as it is; configs/zero3.json is edited first
(load_config), because it was written for `infinity train`: its explicit batch size, learning rate and bf16
would contradict these arguments (an error, as with Transformers' DeepSpeed), bf16 on a CPU without bf16 units
is tens of times slower, and its 100 warmup steps outlast a short run. The
model is a small GPT-2 built from a GPT2Config (nothing to download), the data synthetic and learnable: each
sequence counts up from a random token. Prints the folder the model was saved in, then ``loss A -> B`` (the first
logged loss and the last). Needs the `hf` extra (pip install -e ".[hf]").

    python examples/hf_trainer.py --steps 20
    torchrun --nproc_per_node 2 examples/hf_trainer.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

try:  # the `hf` extra: transformers with the Trainer, and accelerate
    from transformers import GPT2Config, GPT2LMHeadModel

    from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments
except ImportError as e:
    raise SystemExit(f'examples/hf_trainer.py needs the hf extra: pip install -e ".[hf]" ({e})') from None

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, SEQ = 256, 32


class CountingData(torch.utils.data.Dataset):
    """Sequences that count up (mod VOCAB) from a random first token; the model learns x[t + 1] = x[t] + 1."""

    def __init__(self, n: int, seed: int = 0) -> None:
        first = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (first + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def load_config(path: str) -> dict:
    """The JSON, with "auto" where the TrainingArguments decide (explicit values there must equal the arguments');
    fp32 on a CPU (no bf16 units there, as a rule); the Trainer's own schedule (see the module's docstring)."""
    with open(path) as f:
        config = json.load(f)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):  # fmt: skip
        config[key] = "auto"
    if "optimizer" in config:  # the JSON's optimizer type, with the arguments' hyperparameters
        config["optimizer"]["params"] = dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")
    if not torch.cuda.is_available():
        config.pop("bf16", None)
        config.pop("fp16", None)
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:  # this model is tiny: partition all but the smallest parameters
        zero["stage3_param_persistence_threshold"] = 1000
    config.pop("scheduler", None)  # the Trainer's own linear schedule, from the arguments
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.normpath(os.path.join(HERE, "..", "configs", "zero3.json")))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default=None, help="checkpoints and the saved model (default: a temp folder)")
    args = parser.parse_args()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=None, eos_token_id=None))  # fmt: skip
    # plain Trainer: args = TrainingArguments(deepspeed=config, ...)
    training_args = InfinityTrainingArguments(
        infinity=load_config(args.config),
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,  # a tiny model on an easy task: the loss falls within a few steps
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    # plain Trainer: trainer = Trainer(model=model, args=training_args, ...)
    trainer = InfinityTrainer(model=model, args=training_args, train_dataset=CountingData(64 * args.steps))
    trainer.train()
    trainer.save_model()  # model.safetensors + config.json: GPT2LMHeadModel.from_pretrained(output_dir) loads it
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(f"model saved in {output_dir} (GPT2LMHeadModel.from_pretrained loads it)", flush=True)
        print(f"{args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    trainer.engine.destroy()  # collective: every rank calls it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
