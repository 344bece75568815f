"""The `infinity` logger reaches a user who configured no logging (rank 0: info, other ranks: warnings only), and
stays out of the way of one who did."""

import contextlib
import logging

import torch

from infinity.logs import install_default_handler


@contextlib.contextmanager
def bare_logging():
    """No handler anywhere, as in a plain script (pytest's capture handlers, added for the test's call phase, set
    aside meanwhile)."""
    root, ours = logging.getLogger(), logging.getLogger("infinity")
    saved = (root.handlers[:], ours.handlers[:], ours.level, ours.propagate)
    root.handlers[:], ours.handlers[:] = [], []
    ours.setLevel(logging.NOTSET)
    try:
        yield ours
    finally:
        root.handlers[:], ours.handlers[:] = saved[0], saved[1]
        ours.setLevel(saved[2])
        ours.propagate = saved[3]


class Collect(logging.Handler):
    """A user's handler on the root logger, keeping what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def test_rank_0_sees_the_engine_lines(capsys):
    with bare_logging() as logger:
        install_default_handler(0)
        install_default_handler(0)  # a second engine adds nothing
        assert len(logger.handlers) == 1
        logger.info("step 10: loss 1.0")
    assert capsys.readouterr().err == "[infinity] step 10: loss 1.0\n"


def test_other_ranks_only_warn(capsys):
    with bare_logging() as logger:
        install_default_handler(1)
        logger.info("step 10: loss 1.0")
        logger.warning("module order changed")
    assert capsys.readouterr().err == "[infinity rank 1] module order changed\n"


def test_other_ranks_info_stays_out_of_logging_configured_later():
    collect = Collect()
    with bare_logging() as logger:
        install_default_handler(1)
        logging.getLogger().addHandler(collect)
        logger.info("step 10: loss 1.0")
        logger.warning("module order changed")
    assert collect.records == ["module order changed"]


def test_configured_logging_is_left_alone():
    with bare_logging() as logger:
        logging.getLogger().addHandler(logging.NullHandler())
        install_default_handler(0)
        assert logger.handlers == [] and logger.propagate


def test_logging_configured_after_the_engine_takes_over(capsys):
    collect = Collect()
    with bare_logging() as logger:
        install_default_handler(0)
        logging.getLogger().addHandler(collect)  # the user's basicConfig, after initialize()
        logger.info("step 10: loss 1.0")
    assert collect.records == ["step 10: loss 1.0"]
    assert capsys.readouterr().err == ""  # said once, by the user's handler


def test_zero_init_says_its_arguments_without_effect_before_any_engine(capsys):
    """zero.Init usually comes before initialize() has set up the default handler: its "no effect" line for
    DeepSpeed's pin_memory= must reach a user who set up no logging all the same."""
    from torch import nn

    import infinity.zero
    from infinity import config_keys

    config_keys._SAID.discard("zero.Init(pin_memory=)")
    with bare_logging():
        with infinity.zero.Init(pin_memory=True):
            nn.Linear(4, 4)
        err = capsys.readouterr().err
    assert "zero.Init(pin_memory=) has no effect in infinity" in err, err


def test_zero_init_says_the_pieces_keep_the_models_dtype_under_a_16_bit_config(capsys, monkeypatch):
    """DeepSpeed cuts zero.Init's pieces in the config's bf16 when dtype= is not given; here they keep the model's
    dtype (a model built under Init equals one built without): said once, with what to pass."""
    from torch import nn

    import infinity.zero
    from infinity.zero import init

    monkeypatch.setattr(init, "_DTYPE_SAID", [])
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with bare_logging():
        for _ in range(2):
            with infinity.zero.Init(config=config):
                layer = nn.Linear(4, 4)
        err = capsys.readouterr().err
    assert err.count("pass dtype=torch.bfloat16 to build them in 16 bits") == 1, err
    assert layer.weight.dtype is torch.float32


def test_gathered_parameters_says_fwd_module_has_no_effect(capsys):
    from torch import nn

    import infinity.zero
    from infinity import config_keys

    config_keys._SAID.discard("GatheredParameters(fwd_module=)")
    layer = nn.Linear(2, 2)
    with bare_logging():
        with infinity.zero.GatheredParameters(list(layer.parameters()), fwd_module=layer):
            pass
        err = capsys.readouterr().err
    assert "GatheredParameters(fwd_module=) has no effect in infinity" in err, err
