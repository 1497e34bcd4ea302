"""The ModuleSpec of an MoE layer, the drop-in `mlp` of a transformer layer's spec."""

from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.transformer.mlp import MLPSubmodules
from teratron.transformer.moe.experts import GroupedMLP, SequentialMLP
from teratron.transformer.moe.moe_layer import MoELayer, MoESubmodules
from teratron.transformer.moe.shared_experts import SharedExpertMLP
from teratron.transformer.spec_utils import ModuleSpec


def get_moe_module_spec(use_te=None, num_experts=None, moe_grouped_gemm: bool = False,
                        moe_use_legacy_grouped_gemm: bool = False) -> ModuleSpec:
    """MoELayer with GroupedMLP experts (moe_grouped_gemm) or SequentialMLP ones, and a
    SharedExpertMLP for the shared experts (built only when moe_shared_expert_intermediate_size
    is set; gated with moe_shared_expert_gate).
    `use_te` and `moe_use_legacy_grouped_gemm` keep Megatron's signature: teratron has one
    implementation of each."""
    if num_experts is None:
        raise ValueError("get_moe_module_spec needs num_experts (the dense MLP spec has none)")
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if moe_grouped_gemm:
        experts = ModuleSpec(module=GroupedMLP)
    else:
        experts = ModuleSpec(module=SequentialMLP, submodules=linears)
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=experts, shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears)))
