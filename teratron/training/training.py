"""`pretrain`: start the processes, build the Trainer from a run description and train
(Megatron's `pretrain`).

    run = run_config_from_args(parse_train_args(argv), world_size, vocab_size)
    pretrain(run)
"""

from typing import Callable, Optional

import torch.distributed as dist

from teratron.dist_checkpointing import release_save_dir
from teratron.tokenizers import build_tokenizer
from teratron.training.config import RunConfig
from teratron.parallel_state import initialize_distributed
from teratron.training.initialize import apply_deterministic_env, initialize_model_parallel, shutdown
from teratron.training.megatron_flags import startup_notes
from teratron.training.trainer import NonFiniteLossError, Trainer, TrainState

__all__ = ["NonFiniteLossError", "TrainState", "Trainer", "pretrain"]


def pretrain(run: RunConfig, tokenizer=None,
             after_training: Optional[Callable[[Trainer], None]] = None) -> TrainState:
    """Train `run` (its tokenizer built from run.tokenizer unless given); `after_training` gets
    the finished Trainer (the demo samples from it)."""
    if run.training.deterministic_mode:
        apply_deterministic_env()
    world_size = initialize_distributed(run.distributed.distributed_backend,
                                        run.distributed.distributed_timeout_minutes)
    try:
        if world_size != run.distributed.world_size:
            raise ValueError(f"the run was described for {run.distributed.world_size} processes but "
                             f"{world_size} started; build the RunConfig for this launch")
        initialize_model_parallel(run.transformer, run.distributed, run.ddp)
        if not dist.is_initialized() or dist.get_rank() == 0:
            for line in startup_notes(run.megatron_flags):
                print(line, flush=True)
        trainer = Trainer(run, tokenizer or build_tokenizer(run.tokenizer))
        state = trainer.train()
        if after_training is not None:
            after_training(trainer)
        return state
    finally:
        release_save_dir()
        shutdown()
