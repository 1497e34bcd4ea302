import pytest

from teratron.training.microbatches import build_num_microbatches_calculator


def test_constant():
    calc = build_num_microbatches_calculator(global_batch_size=16, micro_batch_size=2, data_parallel_size=2)
    for consumed in (0, 16, 10_000):
        calc.update(consumed)
        assert calc.get() == 4
        assert calc.get_current_global_batch_size() == 16


def test_global_batch_not_divisible():
    with pytest.raises(ValueError, match="--global-batch-size \\(10\\).*multiple of 4"):
        build_num_microbatches_calculator(10, 2, 2)


def test_rampup_follows_megatron_steps():
    # 4 -> 12 in steps of 4 over 24 samples: two steps, one every 12 samples.
    calc = build_num_microbatches_calculator(12, 2, 2, rampup_batch_size=[4, 4, 24])
    expected = {0: 4, 11: 4, 12: 8, 23: 8, 24: 12, 1000: 12}
    for consumed, batch in expected.items():
        calc.update(consumed)
        assert calc.get_current_global_batch_size() == batch
        assert calc.get() == batch // 4


def test_rampup_errors():
    with pytest.raises(ValueError, match="whole steps"):
        build_num_microbatches_calculator(12, 2, 2, rampup_batch_size=[4, 5, 24])
    with pytest.raises(ValueError, match="intermediate global batch 6"):
        build_num_microbatches_calculator(12, 2, 2, rampup_batch_size=[6, 6, 24])
    with pytest.raises(ValueError, match="three integers"):
        build_num_microbatches_calculator(12, 2, 2, rampup_batch_size=[4, 4])
