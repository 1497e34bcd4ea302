"""Megatron-LM's pretrain_gpt.py for bench/megatron_round_trip.sh, with two fixes for resuming
without Transformer Engine or Apex (Megatron-LM d98e8a6), run from Megatron-LM's source folder.

1. DistributedOptimizer.state_dict() asserts that every parameter's Adam state holds one step
   count, and a load calls it on the still-empty state (sharded_state_dict), so Megatron-LM cannot
   resume any distributed-optimizer checkpoint, its own included. The empty state gets step 0 for
   that call only; the checkpoint's step is loaded after.
2. Loading the fully_reshardable layout copies every tensor of a parameter's Adam state from the
   checkpoint's, `step` included, which that layout keeps in the param groups instead (KeyError
   'step'). States the checkpoint does not hold are left as they are."""
import collections
import runpy
import sys

import torch
from megatron.core.optimizer import distrib_optimizer

_state_dict = distrib_optimizer.DistributedOptimizer.state_dict


def state_dict(self):
    if len(self.optimizer.state):
        return _state_dict(self)
    for group in self.optimizer.param_groups:
        for p in group["params"]:
            self.optimizer.state[p]["step"] = torch.tensor(0.0)
    try:
        return _state_dict(self)
    finally:
        self.optimizer.state.clear()


_set_states = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states


def set_states(self, model_param, tensors):
    return _set_states(self, model_param, collections.defaultdict(lambda: None, tensors))


distrib_optimizer.DistributedOptimizer.state_dict = state_dict
distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
sys.argv[0] = "pretrain_gpt.py"
runpy.run_path("pretrain_gpt.py", run_name="__main__")
