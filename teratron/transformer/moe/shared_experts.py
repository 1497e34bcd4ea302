"""SharedExpertMLP: the MoE layer's shared experts, a dense MLP every token runs, optionally
scaled per token by a learned sigmoid gate (config.moe_shared_expert_gate; Qwen2-MoE's):

    shared(x) = sigmoid(x . w_gate) * MLP(x)      w_gate [1, h]: one scalar gate per token

The MLP is tensor-parallel like the dense one. The gate weight reads the whole hidden vector, so
it is replicated over TP (Megatron's `gate_weight`); under sequence parallelism each rank gates
its own tokens, so its gradient is summed over TP like a norm's (`sequence_parallel=True`).
"""

import torch
import torch.nn.functional as F

from teratron.transformer.mlp import MLP, MLPSubmodules
from teratron.tensor_parallel.layers import param_device


class SharedExpertMLP(MLP):
    """[s, b, h] -> ([s, b, h], bias of linear_fc2 or None; with the gate the bias is added
    before gating and None is returned)."""

    def __init__(self, config, submodules: MLPSubmodules, ffn_hidden_size: int | None = None, pg_collection=None):
        super().__init__(config, submodules, ffn_hidden_size=ffn_hidden_size, pg_collection=pg_collection)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            device = param_device(config)
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype,
                                                              device=device))
            if config.perform_initialization:
                master = torch.empty(self.gate_weight.shape, dtype=torch.float32, device=device)
                config.init_method(master)
                with torch.no_grad():
                    self.gate_weight.copy_(master)
            self.gate_weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states):
        output, bias = super().forward(hidden_states)
        if self.gate_weight is None:
            return output, bias
        if bias is not None:
            output = output + bias
        gate = torch.sigmoid(F.linear(hidden_states, self.gate_weight))  # [s, b, 1]
        return output * gate, None
