"""The model's sharded state: each parameter under its global name, as boxes of the global tensor.

Global names are the state-dict names of a one-stage model: pipeline-local layer indices become
global (`pipeline_parallel.layout` offsets, so PP, VPP and uneven splits reshard), and the last
stage's copy of a tied output weight (`shared_embedding=True`) is saved and loaded as
`embedding.word_embeddings.weight`, whose replica it is. Tensor-parallel shards are placed by
their `partition_dim` / `partition_stride` attributes. MoE experts are saved by their global
expert index: SequentialMLP's `local_experts.<j>` under the index the layer gives local expert j,
GroupedMLP's stacked weights as boxes of an [num_experts, ...] tensor; both shard over the
expert-tensor-parallel group.
"""

import re
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from teratron.dist_checkpointing.mapping import shard_tensor_items
from teratron.pipeline_parallel.layout import get_transformer_layer_offset
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.utils import local_flat_range

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
TIED_KEY = "embedding.word_embeddings.weight"


@dataclass
class ParamLayout:
    """Where a rank's tensor sits in its global tensor."""
    key: str
    dim: int | None  # the tensor-parallel partition dim (None: replicated)
    stride: int
    rank: int
    world: int
    replica: bool = False  # the tied output weight's copy: saved by the first stage
    experts: tuple | None = None  # (first local expert, number of experts) of stacked expert weights

    def items(self, key, local, **kwargs):
        items = shard_tensor_items(key, local, self.dim, self.stride, self.rank, self.world,
                                   resizable_rows=self.key in VOCAB_KEYS, replica=self.replica, **kwargs)
        if self.experts is not None:
            first, total = self.experts
            for item in items:
                item.global_shape = (total,) + tuple(item.global_shape[1:])
                item.global_offset = (item.global_offset[0] + first,) + tuple(item.global_offset[1:])
        return items


def unwrap(chunk):
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def _layer_offset(model, pg) -> int:
    if pg is None or get_pg_size(pg.pp) == 1:
        return 0
    return get_transformer_layer_offset(model.config, vp_stage=model.vp_stage, pp_rank=get_pg_rank(pg.pp),
                                        pp_size=get_pg_size(pg.pp))


def global_key(name: str, offset: int) -> str:
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _expert_params(model) -> dict:
    """expert tensor -> (stage-local name, (first expert, number of experts) or None)."""
    out = {}
    for name, module in model.named_modules():
        indices, experts = getattr(module, "local_expert_indices", None), getattr(module, "experts", None)
        if indices is None or experts is None:
            continue
        local = getattr(experts, "local_experts", None)
        if local is not None:  # SequentialMLP: one MLP per expert, named by its global index
            for j, expert in enumerate(local):
                for pname, tensor in expert.state_dict(keep_vars=True).items():
                    out[tensor] = (f"{name}.experts.local_experts.{indices[j]}.{pname}", None)
        else:  # GroupedMLP: tensors stacked over the local experts along dim 0
            for pname, tensor in experts.state_dict(keep_vars=True).items():
                out[tensor] = (f"{name}.experts.{pname}", (indices[0], module.config.num_moe_experts))
    return out


def param_layouts(model_chunks, pg_collection=None) -> dict:
    """tensor (parameter or persistent buffer) -> ParamLayout, over all model chunks, placed by
    `pg_collection` (default: each chunk's own `pg_collection`)."""
    layouts = {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        pg = pg_collection or getattr(model, "pg_collection", None)  # None: a plain module, one process
        offset = _layer_offset(model, pg)
        experts = _expert_params(model)
        for name, tensor in model.state_dict(keep_vars=True).items():
            tied_copy = getattr(tensor, "shared_embedding", False)
            name, stacked = experts.get(tensor, (name, None))
            key = TIED_KEY if tied_copy else global_key(name, offset)
            tp = None if pg is None else pg.expt_tp if tensor in experts else pg.tp
            if getattr(tensor, "tensor_model_parallel", False):
                layouts[tensor] = ParamLayout(key, tensor.partition_dim, tensor.partition_stride,
                                              get_pg_rank(tp), get_pg_size(tp), tied_copy, stacked)
            else:
                layouts[tensor] = ParamLayout(key, None, 1, 0, 1, tied_copy, stacked)
    return layouts


def model_sharded_items(model_chunks, pg_collection=None) -> list:
    """ShardedTensors of every model tensor (views: loading writes into the model). An FSDP
    parameter (a DTensor) is saved from its local shard, a flat range of the parameter, in the
    dtype the model computes in (`compute_dtype`, as a model without FSDP holds it); its fp32
    values are the optimizer's master weights, saved by the optimizer's items."""
    items = []
    for tensor, layout in param_layouts(model_chunks, pg_collection).items():
        if isinstance(tensor, DTensor):
            items += _fsdp_shard_items(tensor, layout)
        else:
            items += layout.items(layout.key, tensor.detach())
    return items


def _fsdp_shard_items(param, layout) -> list:
    with torch.no_grad():
        local = param.to_local()  # the shard's own storage
    copy = local.to(getattr(param, "compute_dtype", local.dtype), copy=True).view(-1)
    items = layout.items(layout.key, copy, flat_range=local_flat_range(param), local_shape=tuple(param.shape))
    if items:
        items[0].on_load = lambda: local.copy_(copy.view_as(local))
    return items


def is_model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state"))
