import pytest
import torch

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


def test_samples_after_follows_the_ramp_iteration_by_iteration():
    calc = build_num_microbatches_calculator(16, 2, 1, [4, 4, 48])
    consumed, expected = 0, [0]
    for _ in range(10):  # replay the loop: update, then consume this iteration's global batch
        calc.update(consumed)
        consumed += calc.get_current_global_batch_size()
        expected.append(consumed)
    assert [calc.samples_after(n) for n in range(11)] == expected
    assert build_num_microbatches_calculator(16, 2, 1).samples_after(5) == 80


def test_iterations_within_counts_the_whole_batches_that_fit():
    """--train-samples' run length: the most iterations whose samples (ramp-up included) fit."""
    calc = build_num_microbatches_calculator(16, 2, 1, [4, 4, 48])
    for samples in range(200):
        assert calc.iterations_within(samples) == max(n for n in range(20) if calc.samples_after(n) <= samples)
    assert [build_num_microbatches_calculator(16, 2, 1).iterations_within(s) for s in (15, 16, 95, 96)] == [0, 1, 5, 6]


def test_lr_reaches_min_lr_at_the_last_iteration_under_rampup():
    from teratron.training.arguments import parse_train_args
    from teratron.training.build import build_scheduler
    from teratron.training.config import build_run_config

    args = parse_train_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                             "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "16",
                             "--rampup-batch-size", "4", "4", "48", "--train-iters", "10", "--lr", "1.0",
                             "--min-lr", "0.1", "--lr-decay-style", "linear", "--lr-warmup-iters", "2"])
    run = build_run_config(args, 1)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = build_scheduler(run, optimizer)
    calc = build_num_microbatches_calculator(16, 2, 1, [4, 4, 48])
    consumed = 0
    for _ in range(10):
        calc.update(consumed)
        consumed += calc.get_current_global_batch_size()
        scheduler.step(increment=calc.get_current_global_batch_size())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
