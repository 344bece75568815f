"""The training loader initialize() builds, at world size 2: each rank a disjoint share, a new order each epoch."""

import torch

import infinity
from tests.distributed.harness import run_distributed

EPOCHS = 3


def _orders(loader) -> list[list[int]]:
    return [[int(i) for (batch,) in loader for i in batch] for _ in range(EPOCHS)]


def _worker(*, rank: int, world_size: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}
    model = torch.nn.Linear(2, 1)
    result = {}
    for size in (16, 17):
        _, _, loader, _ = infinity.initialize(
            model=model, config=config, training_data=torch.utils.data.TensorDataset(torch.arange(size))
        )
        result[size] = {"len": len(loader), "orders": _orders(loader)}
    return result


def _expected(size: int, rank: int, epoch: int) -> list[int]:
    sampler = torch.utils.data.DistributedSampler(
        range(size), num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def test_ranks_split_each_epoch_and_reshuffle(tmp_path):
    per_rank = run_distributed(_worker, 2, tmp_path, timeout_s=180)
    for size in (16, 17):
        assert [r[size]["len"] for r in per_rank] == [4, 4]
        for epoch in range(EPOCHS):
            first, second = (r[size]["orders"][epoch] for r in per_rank)
            assert len(first) == len(second) == 8
            assert not set(first) & set(second)  # disjoint
            assert len(set(first) | set(second)) == 16  # the whole dataset; of 17, one sample dropped
            for rank, order in enumerate((first, second)):
                assert order == _expected(size, rank, epoch)
        for record in per_rank:
            orders = record[size]["orders"]
            assert orders[0] != orders[1] != orders[2]
