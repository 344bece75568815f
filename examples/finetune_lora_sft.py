"""LoRA supervised fine-tuning with TRL's SFTTrainer on infinity, the base model's weights on NVMe (ZeRO-3).
Two lines differ from a plain TRL script (each marked "plain TRL:" below, with what it replaces):

    args = InfinitySFTConfig(infinity=config, ...)            # args = SFTConfig(...)
    trainer = InfinitySFTTrainer(model=model, args=args, ...)  # trainer = SFTTrainer(...)

The model is a tiny Llama built here with a character tokenizer (examples/tiny_lm.py: nothing to download); PEFT
puts LoRA adapters on its attention and MLP projections, and only they train: the optimizer holds them alone and
save_model writes PEFT's adapter files, which PeftModel.from_pretrained loads onto a fresh base. The script then
does that and lets the fine-tuned model continue a prompt. Prints ``loss A -> B`` last (the first logged loss and
the last). Needs the `hf` extra (pip install -e ".[hf]").

    python examples/finetune_lora_sft.py --steps 20 --nvme-path ./swap
    torchrun --nproc_per_node 2 examples/finetune_lora_sft.py --steps 20 --nvme-path ./swap
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch

try:  # the `hf` extra: transformers, peft, trl
    import peft
    from datasets import Dataset
    from tiny_lm import alphabet_text, char_tokenizer, tiny_llama, zero3_nvme

    from infinity.integrations.trl import InfinitySFTConfig, InfinitySFTTrainer
except ImportError as e:
    raise SystemExit(f'examples/finetune_lora_sft.py needs the hf extra: pip install -e ".[hf]" ({e})') from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nvme-path", default=None, help="the swap folder (default: a temp folder, removed after)")
    parser.add_argument("--output-dir", default=None, help="the adapter's folder (default: a temp folder)")
    args = parser.parse_args()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="lora_sft_")
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="lora_sft_swap_")
    os.makedirs(nvme_path, exist_ok=True)

    tokenizer = char_tokenizer()
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"])  # fmt: skip
    model = peft.get_peft_model(tiny_llama(len(tokenizer)), lora)
    # plain TRL: args = SFTConfig(...)
    sft_args = InfinitySFTConfig(
        infinity=zero3_nvme(nvme_path),
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=2e-2,  # a tiny model on an easy task: the loss falls within a few steps
        max_length=32,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        bf16=False,  # fp32: a CPU without bf16 units is tens of times slower in bf16
        use_cpu=not torch.cuda.is_available(),
    )
    data = Dataset.from_dict({"text": alphabet_text(64 * args.steps)})
    # plain TRL: trainer = SFTTrainer(model=model, args=sft_args, ...)
    trainer = InfinitySFTTrainer(model=model, args=sft_args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()  # adapter_model.safetensors + adapter_config.json, nothing of the base
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.engine.destroy()  # collective: every rank calls it
    if args.nvme_path is None:
        shutil.rmtree(nvme_path, ignore_errors=True)
    if not trainer.is_world_process_zero():
        return 0
    tuned = peft.PeftModel.from_pretrained(tiny_llama(len(tokenizer)), output_dir).eval()
    prompt = tokenizer("c d e", return_tensors="pt").input_ids
    tokens = tuned.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    text = "".join(tokenizer.convert_ids_to_tokens(tokens[0].tolist()))
    print(f"adapter saved in {output_dir}; 'c d e' continues as {text!r}", flush=True)
    print(f"{args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
