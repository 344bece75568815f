"""ZeRO-Inference in one process: initialize() without an optimizer, stage 3 with the weights on NVMe against the
plain model, repeated generate() calls that leave nothing behind, and what an inference engine refuses."""

import gc
import os

import pytest
import torch

import infinity
from infinity import ConfigError
from infinity.engine import Engine
from infinity.inference import InferenceEngine
from infinity.memory.host import process_status_bytes
from infinity.zero.units import UnitState
from tests.inference.models import greedy, load_tiny_gpt2, save_tiny_gpt2, stage3_nvme_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


def test_stage3_nvme_logits_and_greedy_tokens_equal_the_plain_model_and_calls_leave_nothing(model_dir, tmp_path):
    plain = load_tiny_gpt2(model_dir)
    prompt = torch.tensor([[5, 17, 33, 2, 90], [7, 7, 64, 120, 3]])
    with torch.no_grad():
        logits_reference = plain(prompt).logits
    reference = greedy(plain, prompt, max_new_tokens=8, eos_token_id=None)

    engine, optimizer, loader, scheduler = infinity.initialize(
        model=load_tiny_gpt2(model_dir), config=stage3_nvme_config(str(tmp_path))
    )
    assert isinstance(engine, InferenceEngine) and (optimizer, loader, scheduler) == (None, None, None)
    engine.module.eval()
    assert torch.equal(engine(prompt).logits, logits_reference)
    assert torch.equal(greedy(engine.module, prompt, max_new_tokens=8, eos_token_id=None), reference)
    engine.zero_stats()  # the first calls recorded the trace; from here each pass reads ahead along it

    fds, rss, tiers = len(os.listdir("/proc/self/fd")), process_status_bytes("VmRSS"), engine.tier_stats()["parameters"]
    for _ in range(4):
        assert torch.equal(greedy(engine.module, prompt, max_new_tokens=8, eos_token_id=None), reference)
    after = engine.tier_stats()["parameters"]
    assert len(os.listdir("/proc/self/fd")) == fds
    assert process_status_bytes("VmRSS") - rss < 4 << 20  # a leaked unit per forward would be ~4 MiB here
    assert all(u.state is UnitState.RELEASED and u.full.untyped_storage().nbytes() == 0
               for u in engine.stage3.table.units)  # fmt: skip
    assert after["held_bytes"] == tiers["held_bytes"] and after["staging_bytes"] == tiers["staging_bytes"]
    # the weights came from the disk on every call (max_in_cpu 0): 4 calls x 8 passes x this rank's shard at least
    shard_bytes = tiers["held_bytes"]["nvme"]
    assert after["traffic"]["nvme_read"]["bytes"] - tiers["traffic"]["nvme_read"]["bytes"] >= 32 * shard_bytes
    stats = engine.zero_stats()
    assert stats["passes"] == 32 and stats["on_demand"] == 0  # every fetch read ahead along the recorded trace
    engine.destroy()


def test_training_calls_and_training_sections_are_clear_errors(model_dir, tmp_path):
    engine, *_ = infinity.initialize(model=load_tiny_gpt2(model_dir), config=stage3_nvme_config(str(tmp_path)))
    loss = engine(torch.tensor([[1, 2, 3]])).logits.sum()
    for call in (lambda: engine.backward(loss), engine.step, lambda: engine.save_checkpoint(str(tmp_path))):
        with pytest.raises(ConfigError, match=r'inference engine.*no optimizer.*add an "optimizer" section'):
            call()
    with pytest.raises(ConfigError, match=r"not supported, load_module_only=True included: .*infinity ckpt to-fp32"):
        engine.load_checkpoint(str(tmp_path), load_module_only=True)
    engine.destroy()
    with pytest.raises(ConfigError, match="lr_scheduler= was given but no optimizer"):
        infinity.initialize(model=load_tiny_gpt2(model_dir), config={}, lr_scheduler=lambda optimizer: None)
    with pytest.raises(ConfigError, match="no optimizer: pass optimizer="):
        Engine(model=load_tiny_gpt2(model_dir), config={"train_micro_batch_size_per_gpu": 1})


def test_below_stage3_the_whole_model_is_on_the_device_in_the_compute_dtype(model_dir, caplog):
    plain = load_tiny_gpt2(model_dir).to(torch.bfloat16)
    prompt = torch.tensor([[5, 17, 33, 2]])
    # a training config with "auto" values, a scheduler and optimizer offload, as Trainer's evaluation without
    # training leaves it (it removes the optimizer only): what needs an optimizer is unused, and said so
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto", "bf16": {"enabled": True},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
    with caplog.at_level("INFO", logger="infinity"):
        engine, optimizer, _, _ = infinity.initialize(model=load_tiny_gpt2(model_dir), config=config)
    assert "unused: scheduler, gradient_clipping='auto', zero_optimization.offload_optimizer" in caplog.text
    assert optimizer is None and engine.tier_stats() == {}
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(engine(prompt).logits, plain(prompt).logits)
    assert torch.equal(engine.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                       do_sample=False), greedy(plain, prompt, max_new_tokens=4))  # fmt: skip
    engine.destroy()


def test_a_model_belongs_to_one_engine(model_dir, tmp_path):
    """A model a live engine holds is refused by the next initialize() with a message naming destroy(); below
    stage 3 a destroyed engine's model can go to a new one; a destroyed stage-3 engine kept the weights."""
    model = load_tiny_gpt2(model_dir)
    engine, *_ = infinity.initialize(model=model, config={"zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match=r"already belongs to a live infinity engine.*engine\.destroy\(\)"):
        infinity.initialize(model=model, config={"zero_optimization": {"stage": 2}})
    engine.destroy()
    engine, *_ = infinity.initialize(model=model, config=stage3_nvme_config(str(tmp_path)))
    engine.destroy()
    del engine
    gc.collect()  # the engine gone too: the model still has no weights of its own
    with pytest.raises(ConfigError, match="partitioned by a stage-3 engine, now destroyed or dropped"):
        infinity.initialize(model=model, config={"zero_optimization": {"stage": 2}})
