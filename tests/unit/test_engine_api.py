"""The engine's DeepSpeed-style API in a single process (no launcher)."""

import pytest
import torch
from safetensors.torch import load_file

import infinity
import infinity.zero
from infinity import ConfigError
from infinity.config import parse_config
from infinity.engine import build_optimizer


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def base(**extra):
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, **extra}


def test_deepspeed_adam_decouples_weight_decay_unless_told_not_to():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    adam = parse_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert type(build_optimizer(adam, groups, on_cpu=True)) is torch.optim.AdamW
    classic = parse_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert type(build_optimizer(classic, [{"params": [torch.nn.Parameter(torch.zeros(2))]}], on_cpu=True)) is (
        torch.optim.Adam
    )


def test_returns_the_deepspeed_tuple_and_counts_steps():
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    engine, optimizer, loader, scheduler = infinity.initialize(
        model=mlp(), config=base(gradient_accumulation_steps=2, zero_optimization={"stage": 2}), training_data=dataset
    )
    assert loader.batch_size == 4 and scheduler is None and optimizer is engine.optimizer
    boundaries = []
    for inputs, target in loader:
        loss = torch.nn.functional.mse_loss(engine(inputs), target)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(loss)
        engine.step()
    assert boundaries == [False, True] * 4
    assert engine.global_steps == 4 and engine.micro_steps == 8
    assert engine.train_batch_size() == 8 and engine.zero_optimization_stage() == 2
    engine.eval()
    assert not engine.module.training


def test_config_scheduler_drives_get_lr():
    config = base(
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.4, "warmup_num_steps": 4, "warmup_type": "linear"},
        }
    )
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    seen = []
    for _ in range(5):
        seen.append(engine.get_lr()[0])
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    assert seen == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_user_optimizer_and_its_scheduler_keep_working():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, returned, _, returned_scheduler = infinity.initialize(
        model=model,
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}},
        optimizer=optimizer,
        lr_scheduler=scheduler,
    )
    assert returned_scheduler is scheduler
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    assert engine.get_lr() == [0.125]
    assert optimizer.param_groups[0]["params"][0] is engine.zero_optimizer.masters[0]


def test_unknown_initialize_argument_and_missing_optimizer():
    with pytest.raises(ConfigError, match="does not take mpu_thing"):
        infinity.initialize(model=mlp(), config=base(), mpu_thing=1)
    with pytest.raises(ConfigError, match="no optimizer"):  # initialize() without one: an InferenceEngine
        infinity.engine.Engine(model=mlp(), config={"train_micro_batch_size_per_gpu": 4})


def test_wall_clock_breakdown_is_reported(caplog):
    config = base(steps_per_print=2, wall_clock_breakdown=True)
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    with caplog.at_level("INFO", logger="infinity"):
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
    assert any("forward" in r.message and "optimizer step" in r.message for r in caplog.records)


def test_stage3_reports_fetch_statistics(caplog):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, *_ = infinity.initialize(model=mlp(), config=base(steps_per_print=2, zero_optimization=zero))
    assert engine.zero_stats()["fetches"] == 0  # nothing measured before the first step
    with caplog.at_level("INFO", logger="infinity"):
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
    stats = engine.zero_stats()
    assert stats["fetches"] == 4 and stats["passes"] == 1  # two modules, forward and backward
    assert stats["prefetched_fraction"] == 1.0 and stats["peak_live_numel"] == 8 * 16 + 16 + 16 + 1
    assert any("ZeRO-3 last step: 4 fetches, 100% prefetched" in r.message for r in caplog.records)
    assert all(p.numel() == 0 for p in engine.module.parameters())  # shards between steps
    engine.destroy()


def test_eval_forward_without_gradients_releases_everything():
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, *_ = infinity.initialize(model=mlp(), config=base(zero_optimization=zero))
    with torch.no_grad():
        first = engine(torch.ones(2, 8))
        again = engine(torch.ones(2, 8))
    assert torch.equal(first, again)
    assert not engine.stage3.coordinator.in_pass
    assert all(p.numel() == 0 for p in engine.module.parameters())
    engine.destroy()


def test_save_16bit_model_below_stage3(tmp_path):
    """The saved bf16 weights are the trained ones: those plain PyTorch reaches with the same recipe (fp32
    AdamW masters, a bf16 copy for forward and backward), not the initial weights."""
    lr, weight_decay = 0.1, 0.01
    optimizer = {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}}
    config = base(optimizer=optimizer, zero_optimization={"stage": 2}, bf16={"enabled": True})
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    master = mlp()
    initial = {name: p.detach().to(torch.bfloat16) for name, p in master.named_parameters()}
    reference = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    compute = mlp().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        inputs = torch.randn(4, 8, generator=gen)
        engine.backward(engine(inputs).float().pow(2).mean())
        engine.step()
        compute(inputs.to(torch.bfloat16)).float().pow(2).mean().backward()
        for p_master, p_compute in zip(master.parameters(), compute.parameters(), strict=True):
            p_master.grad, p_compute.grad = p_compute.grad.float(), None
        reference.step()
        with torch.no_grad():
            for p_master, p_compute in zip(master.parameters(), compute.parameters(), strict=True):
                p_compute.copy_(p_master)
    assert engine.save_16bit_model(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    assert sorted(state) == sorted(master.state_dict())
    for name, want in master.named_parameters():
        saved = state[name]
        assert saved.dtype == torch.bfloat16, name
        assert not torch.equal(saved, initial[name]), f"{name}: the initial weights were saved"
        error = (saved.float() - want.detach().to(torch.bfloat16).float()).abs().max() / want.abs().max()
        assert error <= 2**-8, f"{name}: {float(error):.1e} from plain PyTorch"  # one bf16 rounding at most


def test_zero_init_arguments_do_what_deepspeed_documents_or_are_refused():
    from infinity.errors import ConfigError
    from infinity.zero.init import init_shard

    torch.manual_seed(0)
    built = mlp()
    whole = {name: p.detach().clone() for name, p in built.named_parameters()}
    infinity.zero.Init(module=built)  # an existing model, partitioned at once
    assert all(p.numel() == 0 for p in built.parameters())
    with infinity.zero.GatheredParameters(list(built.parameters())):
        assert all(torch.equal(p, whole[name]) for name, p in built.named_parameters())
    with infinity.zero.Init(enabled=False):
        plain = torch.nn.Linear(8, 4)
    assert plain.weight.shape == (4, 8) and init_shard(plain.weight) is None
    torch.manual_seed(1)
    reference = torch.nn.Linear(8, 4)
    torch.manual_seed(1)
    with infinity.zero.Init(dtype=torch.bfloat16):
        layer = torch.nn.Linear(8, 4)
    assert init_shard(layer.weight).dtype == torch.bfloat16
    with infinity.zero.GatheredParameters([layer.weight]):
        assert torch.equal(layer.weight, reference.weight.detach().to(torch.bfloat16))
    with pytest.raises(ConfigError, match="offload_param.nvme_path is not set"):  # config_dict_or_path is read
        infinity.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    for kwargs, message in (({"mpu": object()}, r"zero.Init\(mpu=...\) is not supported"),
                            ({"zero_quantized_weights": True}, r"zero.Init\(zero_quantized_weights=...\)"),
                            ({"param_swapper": object()}, r"zero.Init\(param_swapper=...\)"),
                            ({"dtype": torch.int8}, "dtype must be torch.float16"),
                            ({"config": {}, "config_dict_or_path": {"aio": {}}}, "same argument")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            infinity.zero.Init(**kwargs)
    with pytest.raises(TypeError, match="not_an_argument"):  # never silently ignored
        infinity.zero.Init(not_an_argument=1)


def test_zero_init_in_one_process_partitions_and_restores_torch():
    original = torch.nn.Linear.__init__
    with infinity.zero.Init():
        layer = torch.nn.Linear(8, 4)
    assert layer.weight.numel() == 0 and tuple(layer.weight.ds_shape) == (4, 8)
    assert torch.nn.Linear.__init__ is original
    plain = torch.nn.Linear(8, 4)
    assert plain.weight.shape == (4, 8)
    with infinity.zero.GatheredParameters(layer.parameters()):
        assert layer.weight.shape == (4, 8)
    assert layer.weight.numel() == 0
