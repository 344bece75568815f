"""ZeRO-Inference at world size 2: stage 3 with the weights on NVMe, generate() and the eval forward against the
plain model on every rank, with ranks whose sequences stop at different lengths (synced_gpus on by default while
the engine lives; an explicit False fails within collective_timeout). One run checks all of it."""

import torch

from tests.distributed.harness import run_distributed
from tests.inference.models import greedy, load_tiny_gpt2, save_tiny_gpt2, stage3_nvme_config

PROMPTS = {0: [5, 17, 33, 2], 1: [9, 41, 7, 100, 12, 3]}


def _generate_on_every_rank(*, rank: int, world_size: int, nvme_path: str, model_dir: str) -> dict:
    import infinity

    plain = load_tiny_gpt2(model_dir)
    prompt = torch.tensor([PROMPTS[rank]])
    # Rank 0 stops at an eos, its second new token (its first, if that is the same token); rank 1 runs 8 new
    # tokens without an eos: rank 0 finishes first and must keep taking part in rank 1's fetches
    kwargs = {"max_new_tokens": 8}
    if rank == 0:
        kwargs["eos_token_id"] = int(greedy(plain, prompt, max_new_tokens=2)[0, -1])
    else:
        kwargs["eos_token_id"] = None
    reference = greedy(plain, prompt, **kwargs)
    with torch.no_grad():
        logits_reference = plain(prompt).logits

    engine, optimizer, _, scheduler = infinity.initialize(
        model=load_tiny_gpt2(model_dir), config=stage3_nvme_config(nvme_path)
    )
    engine.module.eval()
    logits = engine(prompt).logits
    with torch.no_grad():
        bare_logits = engine.module(prompt).logits  # the model's own hooks, outside engine.forward
    generated = [greedy(engine.module, prompt, **kwargs) for _ in range(2)]  # synced_gpus not passed
    generated.append(engine.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **kwargs))
    stats = engine.tier_stats()["parameters"]
    engine.destroy()
    restored = "generate" not in engine.module.__dict__  # the synced_gpus default goes with the engine
    assert optimizer is None and scheduler is None
    return {
        "unsynced": _unsynced_generate(rank, nvme_path, model_dir, prompt, kwargs),
        "logits_equal": torch.equal(logits, logits_reference),
        "bare_equal": torch.equal(bare_logits, logits_reference),
        "new_tokens": [g.shape[1] - prompt.shape[1] for g in generated],
        "reference_new_tokens": reference.shape[1] - prompt.shape[1],
        "generated_equal": [torch.equal(g, reference) for g in generated],
        "nvme_read_bytes": stats["traffic"]["nvme_read"]["bytes"],
        "generate_restored": restored,
    }


def _unsynced_generate(rank: int, nvme_path: str, model_dir: str, prompt, kwargs) -> str:
    """An explicit synced_gpus=False is respected: rank 0 leaves generate() while rank 1 still fetches. Rank 1 gets
    a CollectiveError within collective_timeout (3 s here), not a hang; rank 0 finishes."""
    import infinity
    from infinity.errors import CollectiveError

    config = {**stage3_nvme_config(nvme_path), "collective_timeout": 3}
    engine, *_ = infinity.initialize(model=load_tiny_gpt2(model_dir), config=config)
    try:
        greedy(engine.module, prompt, synced_gpus=False, **kwargs)
        outcome = "finished"
    except CollectiveError as e:
        outcome = str(e)
    engine.destroy()
    return outcome


def test_stage3_nvme_generate_matches_the_plain_model_on_both_ranks(tmp_path):
    model_dir = save_tiny_gpt2(tmp_path / "model")
    (tmp_path / "nvme").mkdir()
    results = run_distributed(_generate_on_every_rank, 2, tmp_path, timeout_s=120, nvme_path=str(tmp_path / "nvme"),
                              model_dir=model_dir)  # fmt: skip
    for rank, result in enumerate(results):
        assert result["logits_equal"] and result["bare_equal"], rank
        assert result["generated_equal"] == [True, True, True], rank
        assert result["new_tokens"] == [result["reference_new_tokens"]] * 3, rank
        assert result["nvme_read_bytes"] > 0 and result["generate_restored"], rank
    assert results[0]["reference_new_tokens"] < results[1]["reference_new_tokens"] == 8  # rank 0 stopped early
    assert results[0]["unsynced"] == "finished"
    assert "ZeRO-3 fetch" in results[1]["unsynced"] and "collective_timeout" in results[1]["unsynced"]
