"""How many micro-batches make one global batch, with Megatron's batch-size ramp-up.

global batch = micro batch x number of micro-batches x data-parallel size. With
`--rampup-batch-size START INCREMENT SAMPLES` the global batch grows from START by INCREMENT
in equal steps over the first SAMPLES consumed samples, then stays at --global-batch-size.
"""

from dataclasses import dataclass
from typing import Optional


@dataclass
class NumMicroBatchesCalculator:
    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    start_global_batch_size: Optional[int] = None
    batch_size_increment: Optional[int] = None
    rampup_samples: Optional[int] = None

    def __post_init__(self):
        for name in ("global_batch_size", "micro_batch_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size % self.micro_batch_times_data_parallel_size:
            raise ValueError(
                f"--global-batch-size ({self.global_batch_size}) is not divisible by --micro-batch-size "
                f"({self.micro_batch_size}) x data-parallel size ({self.data_parallel_size}); choose a "
                f"multiple of {self.micro_batch_times_data_parallel_size}"
            )
        if self.start_global_batch_size is not None:
            self._validate_rampup()
        self.update(0)

    @property
    def is_rampup(self) -> bool:
        return self.start_global_batch_size is not None

    def _validate_rampup(self):
        start, incr, samples = self.start_global_batch_size, self.batch_size_increment, self.rampup_samples
        if start < 1 or incr < 1 or samples < 0:
            raise ValueError(
                f"--rampup-batch-size {start} {incr} {samples}: start and increment must be >= 1 and "
                "the ramp-up sample count >= 0"
            )
        if start > self.global_batch_size or (self.global_batch_size - start) % incr:
            raise ValueError(
                f"--rampup-batch-size: the global batch must grow from {start} to --global-batch-size "
                f"({self.global_batch_size}) in whole steps of {incr}; pick values where "
                f"({self.global_batch_size} - {start}) is a non-negative multiple of {incr}"
            )
        for size in range(start, self.global_batch_size + 1, incr):
            if size % self.micro_batch_times_data_parallel_size:
                raise ValueError(
                    f"--rampup-batch-size: intermediate global batch {size} is not divisible by "
                    f"micro batch x data-parallel size ({self.micro_batch_times_data_parallel_size}); "
                    "choose a start and increment that are multiples of it"
                )

    def update(self, consumed_samples: int) -> None:
        """Set the current global batch for `consumed_samples` samples seen so far."""
        if not self.is_rampup:
            self.current_global_batch_size = self.global_batch_size
        else:
            num_steps = (self.global_batch_size - self.start_global_batch_size) // self.batch_size_increment
            if num_steps == 0 or consumed_samples >= self.rampup_samples:
                self.current_global_batch_size = self.global_batch_size
            else:
                samples_per_step = self.rampup_samples / num_steps
                steps = int(consumed_samples / samples_per_step)
                self.current_global_batch_size = (
                    self.start_global_batch_size + steps * self.batch_size_increment
                )
        # Every size the ramp can reach was checked for divisibility in __post_init__.
        assert self.current_global_batch_size % self.micro_batch_times_data_parallel_size == 0
        self.num_micro_batches = self.current_global_batch_size // self.micro_batch_times_data_parallel_size

    def samples_after(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` iterations (ramp-up included)."""
        if not self.is_rampup:
            return iterations * self.global_batch_size
        probe = NumMicroBatchesCalculator(self.global_batch_size, self.micro_batch_size,
                                          self.data_parallel_size, self.start_global_batch_size,
                                          self.batch_size_increment, self.rampup_samples)
        consumed = 0
        for done in range(iterations):
            if consumed >= self.rampup_samples:  # past the ramp: constant batches
                return consumed + (iterations - done) * self.global_batch_size
            probe.update(consumed)
            consumed += probe.current_global_batch_size
        return consumed

    def iterations_within(self, samples: int) -> int:
        """Whole iterations whose global batches fit in `samples` samples (ramp-up included): the
        run length of --train-samples (samples // global batch without ramp-up, as Megatron)."""
        if not self.is_rampup:
            return samples // self.global_batch_size
        probe = NumMicroBatchesCalculator(self.global_batch_size, self.micro_batch_size,
                                          self.data_parallel_size, self.start_global_batch_size,
                                          self.batch_size_increment, self.rampup_samples)
        consumed = iterations = 0
        while consumed < self.rampup_samples:
            probe.update(consumed)
            if consumed + probe.current_global_batch_size > samples:
                return iterations
            consumed += probe.current_global_batch_size
            iterations += 1
        return iterations + (samples - consumed) // self.global_batch_size

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size


def build_num_microbatches_calculator(global_batch_size, micro_batch_size, data_parallel_size,
                                      rampup_batch_size=None) -> NumMicroBatchesCalculator:
    """`rampup_batch_size` is Megatron's [start, increment, ramp-up samples] triple or None."""
    if rampup_batch_size is None:
        return NumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size)
    if len(rampup_batch_size) != 3:
        raise ValueError(
            f"--rampup-batch-size takes three integers <start> <increment> <ramp-up samples>, "
            f"got {rampup_batch_size}"
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return NumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                     start, increment, samples)
