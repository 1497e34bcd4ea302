"""Expert parameters carry allreduce=False whatever the EP size (Megatron's rule): DDP reduces
them over the expert-data-parallel group, never the dense one, which under expert-TP != TP
would sum different expert-TP shards."""

import torch.nn.functional as F

from teratron.models.gpt import GPTModel, get_gpt_decoder_block_spec
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.transformer.transformer_config import TransformerConfig


def test_expert_params_never_take_the_dense_allreduce_at_ep1():
    for grouped in (False, True):
        config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                                   num_moe_experts=2, moe_layer_freq=[1, 0], moe_grouped_gemm=grouped,
                                   moe_shared_expert_intermediate_size=16, gated_linear_unit=True,
                                   activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True)
        assert config.expert_model_parallel_size == 1
        model = GPTModel(config, get_gpt_decoder_block_spec(config), 32, 8)
        flags = {name: getattr(p, "allreduce", True) for name, p in model.named_parameters()}
        experts = [n for n in flags if ".experts." in n]
        assert experts and not any(flags[n] for n in experts), flags
        assert all(flags[n] for n in flags if n not in experts), flags  # router, shared experts, dense

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, add_bias_linear=True,
                               use_cpu_initialization=True)
    init = config.init_method
    for is_expert in (False, True):
        column = ColumnParallelLinear(8, 8, config=config, init_method=init, bias=True, gather_output=False,
                                      is_expert=is_expert)
        row = RowParallelLinear(8, 8, config=config, init_method=init, bias=True, input_is_parallel=True,
                                skip_bias_add=False, is_expert=is_expert)
        for p in (column.weight, column.bias, row.weight, row.bias):
            assert p.allreduce is not is_expert
