"""The local experts of an MoE layer, each an MLP h -> moe_ffn_hidden_size -> h like the dense
one (GELU, or SwiGLU with gated_linear_unit), sharded over expert-TP.

SequentialMLP: a list of MLP modules run one after another.
GroupedMLP: the local experts' weights stacked, run as one grouped GEMM (`torch._grouped_mm` on
    CUDA for bf16 on sm90+, else an exact loop over the experts).

Initialisation is layout-invariant: expert e (its global index) is built under its own stream
`component_rng(f"expert{e}")`, seeded by the enclosing (layer) seed and e; its full weights are
drawn there and sharded over expert-TP. Any EP / expert-TP layout, and both classes, hold the
same experts for the same seed.

forward(tokens [N, h] grouped by expert, tokens_per_expert [L], probs [N]) -> [N, h]: each
expert's output (bias included) times its routing probability, or with moe_apply_probs_on_input
the input scaled instead.
"""

import torch
import torch.nn.functional as F

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.batch_invariant import batch_invariant_linear
from teratron.tensor_parallel.layers import set_tensor_model_parallel_attributes
from teratron.tensor_parallel.utils import divide, shard_tensor
from teratron import fusions
from teratron.topology import resolve_pg_collection
from teratron.transformer import activation_offload
from teratron.transformer.init_rng import component_rng
from teratron.transformer.mlp import MLP, bias_activation


def _scale_input(tokens, probs, config):
    if not config.moe_apply_probs_on_input:
        return tokens
    return (tokens.to(probs.dtype) * probs.unsqueeze(-1)).to(tokens.dtype)


def _scale_output(output, probs, config):
    if config.moe_apply_probs_on_input:
        return output
    return (output.to(probs.dtype) * probs.unsqueeze(-1)).to(output.dtype)


class SequentialMLP(torch.nn.Module):
    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None,
                 local_expert_indices=None):
        super().__init__()
        self.config = config
        indices = range(num_local_experts) if local_expert_indices is None else local_expert_indices
        tp_group = resolve_pg_collection(pg_collection).expt_tp
        experts = []
        for expert in indices:
            with component_rng(f"expert{expert}"):
                experts.append(MLP(config, submodules, ffn_hidden_size=config.moe_ffn_hidden_size,
                                   is_expert=True, tp_group=tp_group))
        self.local_experts = torch.nn.ModuleList(experts)

    def forward(self, tokens, tokens_per_expert, probs):
        tokens = _scale_input(tokens, probs, self.config)
        outputs = []
        for expert, chunk in zip(self.local_experts, tokens.split(tokens_per_expert)):
            output, bias = expert(chunk)
            outputs.append(output if bias is None else output + bias)
        return _scale_output(torch.cat(outputs), probs, self.config)


def _activation(config, x):
    function = fusions.fused(bias_activation) if config.bias_activation_fusion else bias_activation
    return function(x, None, config.activation_func, config.gated_linear_unit, config.glu_linear_offset,
                    config.activation_func_clamp_value)


def _grouped_mm_usable(x, weight) -> bool:
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9
            and x.shape[0] > 0 and x.shape[-1] % 8 == 0 and weight.shape[-1] % 8 == 0)


def grouped_gemm(x, weight, tokens_per_expert, batch_invariant=False):
    """Rows of expert e times weight[e]: x [N, k] (grouped by expert), weight [L, k, n] -> [N, n];
    with `batch_invariant`, each expert's GEMM in fixed-shape row tiles (tensor_parallel/batch_invariant)."""
    if batch_invariant:
        return torch.cat([batch_invariant_linear(F.linear, chunk, w.t())
                          for chunk, w in zip(x.split(tokens_per_expert), weight)])
    if _grouped_mm_usable(x, weight):
        offsets = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight, offs=offsets)
    return loop_gemm(x, weight, tokens_per_expert)


def loop_gemm(x, weight, tokens_per_expert):
    """grouped_gemm as one matmul per expert: exact on every device and dtype."""
    return torch.cat([chunk @ w for chunk, w in zip(x.split(tokens_per_expert), weight)])


class GroupedMLP(torch.nn.Module):
    """weight1 [L, h, fc1/etp] and weight2 [L, ffn/etp, h] (biases [L, fc1] and [L, h]); fc1 is
    [gate; up] under gated_linear_unit, sharded over expert-TP like ColumnParallelLinear with
    stride 2."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 local_expert_indices=None):
        super().__init__()
        self.config = config
        indices = list(range(num_local_experts) if local_expert_indices is None else local_expert_indices)
        tp_group = resolve_pg_collection(pg_collection).expt_tp
        tp_size, tp_rank = get_pg_size(tp_group), get_pg_rank(tp_group)
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        stride = 2 if config.gated_linear_unit else 1
        fc1_size = ffn * stride
        device = torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.device("cuda", torch.cuda.current_device())
        empty = lambda *shape: torch.empty(shape, dtype=config.params_dtype, device=device)  # noqa: E731
        self.weight1 = torch.nn.Parameter(empty(len(indices), hidden, divide(fc1_size, tp_size)))
        self.weight2 = torch.nn.Parameter(empty(len(indices), divide(ffn, tp_size), hidden))
        set_tensor_model_parallel_attributes(self.weight1, True, 2, stride)
        set_tensor_model_parallel_attributes(self.weight2, True, 1, 1)
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            self.bias1 = torch.nn.Parameter(torch.zeros_like(empty(len(indices), fc1_size)))
            self.bias2 = torch.nn.Parameter(torch.zeros_like(empty(len(indices), hidden)))
        for param in self.parameters():
            param.allreduce = False
        if config.perform_initialization:
            with torch.no_grad():
                for i, expert in enumerate(indices):
                    fc1, fc2 = self._full_weights(expert, fc1_size, hidden, ffn, device)
                    self.weight1[i] = shard_tensor(fc1, 0, stride, tp_rank, tp_size).t()
                    self.weight2[i] = shard_tensor(fc2, 1, 1, tp_rank, tp_size).t()

    def _full_weights(self, expert, fc1_size, hidden, ffn, device):
        """Expert `expert`'s full fc1 [fc1, h] and fc2 [h, ffn], drawn as its MLP would draw them."""
        with component_rng(f"expert{expert}"):
            fc1 = torch.empty(fc1_size, hidden, dtype=torch.float32, device=device)
            self.config.init_method(fc1)
            fc2 = torch.empty(hidden, ffn, dtype=torch.float32, device=device)
            self.config.output_layer_init_method(fc2)
        return fc1, fc2

    def forward(self, tokens, tokens_per_expert, probs):
        counts = torch.tensor(tokens_per_expert, device=tokens.device)
        tokens = _scale_input(tokens, probs, self.config)
        with activation_offload.offload("expert_fc1"):
            x = grouped_gemm(tokens, self.weight1, tokens_per_expert, self.config.batch_invariant_mode)
        if self.bias1 is not None:
            x = x + self.bias1.repeat_interleave(counts, dim=0)
        with activation_offload.offload("moe_act"):
            x = _activation(self.config, x)
        x = grouped_gemm(x, self.weight2, tokens_per_expert, self.config.batch_invariant_mode)
        if self.bias2 is not None:
            x = x + self.bias2.repeat_interleave(counts, dim=0)
        return _scale_output(x, probs, self.config)
