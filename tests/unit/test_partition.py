"""The bucket-sharded layout: every element has exactly one owner, pieces are equal, buckets respect sizes."""

import pytest

from infinity.zero.partition import ALIGN, overlap, plan, plan_group


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("numels", [[1], [5, 7, 11], [1000, 3, 3, 2000, 17], [64] * 40])
@pytest.mark.parametrize("bucket_numel", [1, 50, 10_000])
def test_every_element_has_one_owner(world_size, numels, bucket_numel):
    layout = plan_group(0, numels, world_size=world_size, bucket_numel=bucket_numel)
    assert layout.numel == sum(numels)
    seen = []
    for bucket in layout.buckets:
        assert bucket.padded_numel % (world_size * ALIGN) == 0 and bucket.padded_numel >= bucket.numel
        assert bucket.piece_numel * world_size == bucket.padded_numel
        assert bucket.numel <= max(bucket_numel, max(s.numel for s in bucket.slots))
        owners = [0] * bucket.numel
        for rank in range(world_size):
            start, end = bucket.piece_range(rank)
            for slot in bucket.slots:
                part = overlap(slot, start, end)
                if part:
                    for i in range(*part):
                        owners[i] += 1
        assert owners == [1] * bucket.numel
        seen.extend(s.param_index for s in bucket.slots)
    assert seen == list(range(len(numels)))  # order kept, nothing dropped
    assert layout.shard_numel == sum(b.piece_numel for b in layout.buckets)


def test_shard_offsets_are_contiguous_per_rank():
    layout = plan_group(0, [10, 20, 30, 40], world_size=2, bucket_numel=35)
    offsets = [b.shard_offset for b in layout.buckets]
    assert offsets == [sum(b.piece_numel for b in layout.buckets[:i]) for i in range(len(layout.buckets))]


def test_groups_never_share_buckets():
    layouts = plan([[5, 5], [7]], world_size=2, bucket_numel=100)
    assert [b.group for b in layouts[0].buckets] == [0]
    assert [b.group for b in layouts[1].buckets] == [1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        plan_group(0, [1], world_size=0, bucket_numel=1)
    with pytest.raises(ValueError, match="bucket_numel"):
        plan_group(0, [1], world_size=1, bucket_numel=0)
