"""A pipeline stage's stack of transformer layers, plus the final norm on the last stage.

The stage builds global layers [offset, offset + n) as `pipeline_parallel.layout` places them,
each under its own init stream (`init_rng`), so a layer's weights do not depend on the layout.
Activation recompute: 'full' recomputes whole layers in backward (method 'uniform': chunks of
`recompute_num_layers` layers; 'block': the stage's first `recompute_num_layers` layers);
'selective' is decided inside each layer (core_attn, mlp, layernorm).
With cuda_graph_impl='local' (scope 'full') the layers run as CUDA graphs once the training loop
switches them on (`transformer.cuda_graphs`).
With `config.fp8` the layers' linears run FP8 GEMMs (`apply_fp8`; first/last layers may
stay bf16), not the embedding or the output layer, which are outside the block.
"""

import functools
from dataclasses import dataclass, field
from typing import List, Union

import torch

from teratron import tensor_parallel
from teratron.fp8 import Fp8Recipe, layer_uses_fp8
from teratron.pipeline_parallel.layout import get_num_layers_to_build, get_transformer_layer_offset
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection
from teratron.transformer.cuda_graphs import LayerCudaGraphs
from teratron.transformer.init_rng import build_component
from teratron.transformer.norms import Norm
from teratron.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class TransformerBlockSubmodules:
    """The specs of this stage's layers (one per local layer) and of the final norm."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)
    layer_norm: Union[ModuleSpec, type, None] = Norm


def _block_submodules(spec, num_layers: int) -> TransformerBlockSubmodules:
    if isinstance(spec, TransformerBlockSubmodules):
        if len(spec.layer_specs) != num_layers:
            raise ValueError(
                f"the block spec lists {len(spec.layer_specs)} layer specs but this pipeline stage "
                f"builds {num_layers} layers; give one spec per local layer"
            )
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers)


def apply_fp8(layer: torch.nn.Module, config, layer_number: int, cp_group=None) -> None:
    """Switch the tensor-parallel linears of transformer layer `layer_number` to FP8 GEMMs when
    the config asks for it (TransformerBlock calls this for each layer it builds). MoE experts
    stay in the params dtype: an expert's per-tensor scale would depend on how expert
    parallelism groups tokens, breaking layout invariance."""
    if not layer_uses_fp8(config, layer_number):
        return
    recipe = Fp8Recipe.from_config(config)
    linears = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear,
               tensor_parallel.DuplicatedLinear)
    for name, module in layer.named_modules():
        if isinstance(module, linears) and not module.is_expert:
            module.enable_fp8(recipe, name=f"layer {layer_number} {name}", cp_group=cp_group)


class TransformerBlock(torch.nn.Module):
    """[s, b, h] -> [s, b, h] ([s/tp, b, h] under sequence parallelism)."""

    def __init__(self, config, spec, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None, vp_stage=None):
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.input_tensor = None
        pp = self.pg_collection.pp
        placement = dict(vp_stage=vp_stage, pp_rank=get_pg_rank(pp), pp_size=get_pg_size(pp))
        num_layers = get_num_layers_to_build(config, **placement)
        offset = get_transformer_layer_offset(config, **placement)
        submodules = _block_submodules(spec, num_layers)
        layers = []
        for i, layer_spec in enumerate(submodules.layer_specs):
            layer_number = offset + i + 1
            layers.append(build_component(f"layer{layer_number}", functools.partial(
                self._build_layer, layer_spec, layer_number, vp_stage), config.init_model_with_meta_device))
        self.layers = torch.nn.ModuleList(layers)
        self.cuda_graphs = None
        if config.cuda_graph_impl == "local" and config.cuda_graph_scope == "full" and layers:
            self.cuda_graphs = LayerCudaGraphs(self.layers, config.cuda_graph_retain_backward_graph)
        self.final_layernorm = None
        if post_process and post_layer_norm and submodules.layer_norm is not None:
            self.final_layernorm = build_component("final_norm", functools.partial(
                build_module, submodules.layer_norm, config=config, hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon), config.init_model_with_meta_device)

    def _build_layer(self, layer_spec, layer_number: int, vp_stage):
        layer = build_module(layer_spec, config=self.config, layer_number=layer_number,
                             pg_collection=self.pg_collection, vp_stage=vp_stage)
        apply_fp8(layer, self.config, layer_number, self.pg_collection.cp)
        return layer

    def set_input_tensor(self, input_tensor):
        """The activations received from the previous pipeline stage (used when not pre_process)."""
        self.input_tensor = input_tensor

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        if not self.pre_process:
            hidden_states = self.input_tensor
        if inference_context is not None:
            for layer in self.layers:
                hidden_states, _ = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                         inference_context=inference_context)
        elif self.cuda_graphs is not None and self.cuda_graphs.active(self.training):
            hidden_states = self.cuda_graphs(hidden_states, attention_mask, rotary_pos_emb)
        elif self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(hidden_states, attention_mask, rotary_pos_emb)
        else:
            hidden_states = self._run_layers(0, len(self.layers))(hidden_states, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, attention_mask, rotary_pos_emb):
            for layer in self.layers[start:end]:
                hidden_states, _ = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
            return hidden_states
        return run

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        """Full recompute: keep only each chunk's input; rerun the chunk in backward."""
        config, n = self.config, len(self.layers)
        distribute = bool(config.distribute_saved_activations)
        if config.recompute_method == "uniform":
            chunks = [(s, min(s + config.recompute_num_layers, n)) for s in range(0, n, config.recompute_num_layers)]
            recomputed = set(chunks)
        else:  # block: the first recompute_num_layers layers one by one, the rest as usual
            chunks = [(i, i + 1) for i in range(n)]
            recomputed = set(chunks[:config.recompute_num_layers])
        for chunk in chunks:
            run = self._run_layers(*chunk)
            if chunk in recomputed:
                hidden_states = tensor_parallel.checkpoint(run, distribute, hidden_states, attention_mask,
                                                           rotary_pos_emb, tp_group=self.pg_collection.tp)
            else:
                hidden_states = run(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states
