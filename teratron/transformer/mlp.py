"""The feed-forward block: h -> ffn (column-parallel) -> activation -> h (row-parallel).

With `gated_linear_unit` linear_fc1 produces [gate; up] and the activation is
act(gate) * (up + glu_linear_offset) (SwiGLU = gated + silu); with
`activation_func_clamp_value` L the gate is clamped to at most L and up to [-L, L] first
(the same in MoE experts). gpt-oss's experts are `quick_gelu` gated (Megatron's --quick-geglu),
clamped at 7 with glu_linear_offset 1; GPT-2's MLP is `openai_gelu`, GELU's tanh approximation
(Megatron's --openai-gelu); Nemotron-H's MLPs and experts are `squared_relu`, relu(x)^2 ungated
(Megatron's --squared-relu). The fused weight is
`partition_stride=2`: each TP rank holds [gate_shard; up_shard], so the gate and up halves of a
rank's output line up.
"""

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from teratron import fusions
from teratron.topology import resolve_pg_collection
from teratron.transformer import activation_offload
from teratron.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class MLPSubmodules:
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None


class MLP(torch.nn.Module):
    """[s, b, h] -> ([s, b, h], bias of linear_fc2 or None)."""

    def __init__(self, config, submodules: MLPSubmodules, is_expert: bool = False,
                 input_size: int | None = None, ffn_hidden_size: int | None = None, tp_group=None,
                 pg_collection=None):
        super().__init__()
        self.config = config
        if tp_group is None:
            groups = resolve_pg_collection(pg_collection)
            tp_group = groups.expt_tp if is_expert else groups.tp
        input_size = config.hidden_size if input_size is None else input_size
        ffn_hidden_size = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        gated = config.gated_linear_unit
        self.linear_fc1 = build_module(
            submodules.linear_fc1, input_size, ffn_hidden_size * (2 if gated else 1), config=config,
            init_method=config.init_method, gather_output=False, bias=config.add_bias_linear,
            skip_bias_add=True, stride=2 if gated else 1, is_expert=is_expert, tp_group=tp_group,
        )
        self.linear_fc2 = build_module(
            submodules.linear_fc2, ffn_hidden_size, input_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=is_expert, tp_group=tp_group,
        )
        # Activation offloading names an expert's pieces; the dense MLP is offloaded whole.
        self.fc1_offload_name, self.act_offload_name = ("expert_fc1", "moe_act") if is_expert else (None, None)

    def activation(self, x, bias=None):
        """act(x + bias), gated: act(gate) * (up + glu_linear_offset), clamped with
        activation_func_clamp_value; one fused kernel with `bias_activation_fusion`."""
        c = self.config
        function = fusions.fused(bias_activation) if c.bias_activation_fusion else bias_activation
        return function(x, bias, c.activation_func, c.gated_linear_unit, c.glu_linear_offset,
                        c.activation_func_clamp_value)

    def forward(self, hidden_states):
        with activation_offload.offload(self.fc1_offload_name):
            intermediate, bias = self.linear_fc1(hidden_states)
        with activation_offload.offload(self.act_offload_name):
            activated = self.activation(intermediate, bias)
        return self.linear_fc2(activated)


def quick_gelu(x):
    """x * sigmoid(1.702 x), the sigmoid approximation of GELU (Megatron's quick_gelu)."""
    return x * torch.sigmoid(1.702 * x)


def openai_gelu(x):
    """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Megatron's
    openai_gelu; GPT-2's "gelu_new")."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x):
    """relu(x)^2 (Megatron's squared_relu; transformers' "relu2")."""
    return torch.pow(F.relu(x), 2)


def bias_activation(x, bias, activation_func, gated: bool, glu_linear_offset: float,
                    clamp_value: float | None = None):
    if bias is not None:
        x = x + bias
    if not gated:
        return activation_func(x)
    gate, up = x.chunk(2, dim=-1)
    if clamp_value is not None:
        gate, up = gate.clamp(max=clamp_value), up.clamp(-clamp_value, clamp_value)
    return activation_func(gate) * (up + glu_linear_offset)
