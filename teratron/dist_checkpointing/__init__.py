"""Sharded checkpoints through torch.distributed.checkpoint: every tensor is saved as boxes of its
global tensor, so a checkpoint loads into any TP / PP / VPP / DP / EP layout, with or without the
distributed optimizer (Megatron Core: `megatron.core.dist_checkpointing`). Loading runs no code
from the files (`safe_load`) and checks their checksums; a run locks its save directory
(`save_dir`)."""

from teratron.dist_checkpointing.checkpoint import (AsyncSave, NonFiniteStateError, load_checkpoint,
                                                    save_checkpoint, start_async_save)
from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from teratron.dist_checkpointing.safe_load import UnsafeCheckpointError
from teratron.dist_checkpointing.save_dir import SaveDirError, claim_save_dir, release_save_dir
from teratron.dist_checkpointing.serialization import load, load_full, save
from teratron.dist_checkpointing.storage import DamagedCheckpointError

__all__ = ["AsyncSave", "DamagedCheckpointError", "NonFiniteStateError", "SaveDirError", "ShardedObject",
           "ShardedTensor", "UnsafeCheckpointError", "claim_save_dir", "load", "load_checkpoint", "load_full",
           "release_save_dir", "save", "save_checkpoint", "start_async_save"]
