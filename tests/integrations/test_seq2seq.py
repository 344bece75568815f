"""InfinitySeq2SeqTrainer against the plain Seq2SeqTrainer on a tiny T5 learning to copy: two training steps at
stage 3, then evaluate() with predict_with_generate and predict(): the eval loss and the generated predictions
are the plain trainer's, at world size 1 and 2 (synced generation on every rank)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration  # noqa: E402

from infinity.integrations.transformers import (  # noqa: E402
    InfinitySeq2SeqTrainer,
    InfinitySeq2SeqTrainingArguments,
)
from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.test_accelerator import stage_config  # noqa: E402


def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=64, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    return T5ForConditionalGeneration(config)


class Copy(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(2, 64, (n, 6), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(6, dtype=torch.long), "labels": self.ids[i]}


def arguments(output_dir, world_size: int) -> dict:
    return dict(output_dir=str(output_dir), per_device_train_batch_size=8 // world_size,
                per_device_eval_batch_size=4 // world_size, learning_rate=1e-2, max_steps=2, report_to=[], seed=0,
                save_strategy="no", disable_tqdm=True, use_cpu=True, predict_with_generate=True,
                generation_max_length=8, logging_steps=1)  # fmt: skip


def run(world_size: int, output_dir, *, plain: bool) -> dict:
    data = {"train_dataset": Copy(16, 1), "eval_dataset": Copy(8, 2)}
    if plain:
        args = Seq2SeqTrainingArguments(**arguments(output_dir, world_size))
        trainer = Seq2SeqTrainer(model=t5(), args=args, **data)
    else:
        args = InfinitySeq2SeqTrainingArguments(infinity=stage_config(3), **arguments(output_dir, world_size))
        trainer = InfinitySeq2SeqTrainer(model=t5(), args=args, **data)
    trainer.train()
    metrics = trainer.evaluate()
    predictions = trainer.predict(Copy(8, 2)).predictions
    if getattr(trainer, "engine", None) is not None:
        trainer.engine.destroy()
    return {"eval_loss": metrics["eval_loss"], "predictions": np.asarray(predictions)}


def _worker(*, rank: int, world_size: int, output_dir: str) -> dict:
    # Accelerate's CPU multi-process state reads the launcher's variables (the harness joined the gloo group)
    os.environ.update({"LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    return {name: run(world_size, f"{output_dir}/{name}", plain=name == "plain") for name in ("plain", "infinity")}


@pytest.mark.parametrize("world_size", [1, 2])
def test_evaluate_and_predict_with_generate_match_the_plain_trainer(world_size, tmp_path):
    if world_size == 1:
        results = [{name: run(1, tmp_path / name, plain=name == "plain") for name in ("plain", "infinity")}]
    else:
        results = run_distributed(_worker, world_size, tmp_path, timeout_s=180, output_dir=str(tmp_path))
    for result in results:
        want, got = result["plain"], result["infinity"]
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
        assert np.array_equal(got["predictions"], want["predictions"])
