"""Sharded checkpoints through torch.distributed.checkpoint: every tensor is saved as boxes of its
global tensor, so a checkpoint loads into any TP / PP / VPP / DP / EP layout, with or without the
distributed optimizer (Megatron Core: `megatron.core.dist_checkpointing`)."""

from teratron.dist_checkpointing.checkpoint import (AsyncSave, load_checkpoint, save_checkpoint,
                                                    start_async_save)
from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from teratron.dist_checkpointing.serialization import load, load_full, save

__all__ = ["AsyncSave", "ShardedObject", "ShardedTensor", "load", "load_checkpoint", "load_full", "save",
           "save_checkpoint", "start_async_save"]
