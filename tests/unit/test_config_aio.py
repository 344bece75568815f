"""The `aio` config section: DeepSpeed names, legacy keys, clear errors."""

import pytest

from infinity import ConfigError
from infinity.config import parse_aio


def test_defaults_are_deepspeeds():
    s = parse_aio({})
    assert (s.block_size, s.queue_depth, s.intra_op_parallelism, s.single_submit, s.overlap_events) == (
        1048576,
        8,
        1,
        False,
        True,
    )


def test_numbers_written_as_floats():
    assert parse_aio({"block_size": 1.048576e6, "queue_depth": 3.2e1}).queue_depth == 32


def test_legacy_thread_count_warns_and_maps():
    with pytest.warns(DeprecationWarning, match="aio.thread_count is deprecated; use aio.intra_op_parallelism"):
        assert parse_aio({"thread_count": 2}).intra_op_parallelism == 2


def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError, match="unknown key aio.queue_dept: did you mean queue_depth"):
        parse_aio({"queue_dept": 8})


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"block_size": 5000}, "aio.block_size must be a multiple of 4096"),
        ({"queue_depth": 0}, "aio.queue_depth must be between 1"),
        ({"queue_depth": 8.5}, "aio.queue_depth must be a whole number"),
        ({"single_submit": 1}, "aio.single_submit must be true or false"),
        ({"use_gds": True}, "use_gds"),
    ],
)
def test_bad_values(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_aio(raw)
