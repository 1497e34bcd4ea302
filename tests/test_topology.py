"""The topology: the one owner of the parallel layout. parallel_state only reads it, a missing
collection or group resolves to its groups, and a config's parallel sizes must match the groups
a model is built with."""

from dataclasses import fields

import pytest
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state as ps
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.process_groups import ProcessGroupCollection
from teratron.topology import (GROUP_NAMES, Topology, check_parallel_sizes, current_topology,
                               resolve_pg_collection, set_current_topology)
from teratron.transformer.transformer_config import TransformerConfig

COLLECTION_FIELDS = [f.name for f in fields(ProcessGroupCollection)]


def _config(**sizes) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                             use_cpu_initialization=True, **sizes)


def test_all_ones_topology_without_torch_distributed():
    topology = current_topology()
    assert not topology.is_initialized and not ps.model_parallel_is_initialized()
    sizes = [topology.tensor_model_parallel_size, topology.pipeline_model_parallel_size,
             topology.context_parallel_size, topology.expert_model_parallel_size,
             topology.expert_tensor_parallel_size, topology.data_parallel_size,
             topology.expert_data_parallel_size]
    assert sizes == [1] * 7 and topology.virtual_pipeline_model_parallel_size is None
    for name in GROUP_NAMES:
        assert topology.group(name) is None and topology.size(name) == 1 and topology.rank(name) == 0
        assert topology.global_ranks(name) == [0]
    assert all(getattr(resolve_pg_collection(), name) is None for name in COLLECTION_FIELDS)
    given = ProcessGroupCollection()
    assert resolve_pg_collection(given) is given  # nothing to fill in
    with pytest.raises(KeyError, match="unknown group 'xx'"):
        topology.group("xx")


def test_parallel_state_reads_the_current_topology_only():
    set_current_topology(Topology(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                  virtual_pipeline_model_parallel_rank=1))
    try:
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
        assert ps.get_virtual_pipeline_model_parallel_rank() == 1
        assert not ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()  # chunk 1 of 2, one stage
        assert ps.is_pipeline_first_stage(ignore_virtual=True)
        ps.set_virtual_pipeline_model_parallel_rank(0)
        assert current_topology().virtual_pipeline_model_parallel_rank == 0
        assert ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
    finally:
        ps.destroy_model_parallel()
    assert current_topology().virtual_pipeline_model_parallel_size is None
    assert ps.get_virtual_pipeline_model_parallel_rank() is None


def test_config_sizes_must_match_the_groups():
    no_groups = ProcessGroupCollection()
    check_parallel_sizes(_config(), no_groups)
    for sizes, field in [(dict(tensor_model_parallel_size=2), "tensor_model_parallel_size"),
                         (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size"),
                         (dict(expert_model_parallel_size=2), "expert_model_parallel_size"),
                         (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size")]:
        if field.startswith("expert"):
            sizes.update(num_moe_experts=4, add_bias_linear=False)
        config = _config(**sizes)
        with pytest.raises(ValueError) as error:
            check_parallel_sizes(config, no_groups)
        message = str(error.value)
        assert message.startswith(f"config.{field}=2 but the model's ") and "has 1 rank(s)" in message
        assert "\n" not in message
    # A dense model has no expert layers: its expert sizes drive nothing.
    check_parallel_sizes(_config(expert_tensor_parallel_size=2), no_groups)


def test_gpt_model_refuses_a_config_its_groups_contradict():
    with pytest.raises(ValueError, match="config.tensor_model_parallel_size=2 but the model's tp group has 1"):
        GPTModel(_config(tensor_model_parallel_size=2), get_gpt_layer_local_spec(), 64, 8)


def _members(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _resolved_groups():
    """4 ranks, TP 2 x PP 2 (rank = tp + 2 * pp)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    topology = current_topology()
    current = resolve_pg_collection()
    assert all(getattr(current, name) is topology.group(name) for name in COLLECTION_FIELDS)
    # A group given is kept; every missing one is the topology's.
    partial = resolve_pg_collection(ProcessGroupCollection(tp=dist.group.WORLD))
    assert partial.tp is dist.group.WORLD and partial.pp is topology.group("pp")
    assert partial.dp is topology.group("dp") and partial.embd is topology.group("embd")
    # A model built without groups, and one with only TP given, take the rest from the topology.
    config = _config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model = GPTModel(config, get_gpt_layer_local_spec(), 64, 8, pre_process=topology.is_pipeline_first_stage(),
                     post_process=topology.is_pipeline_last_stage())
    assert model.pg_collection.tp is topology.group("tp") and model.pg_collection.pp is topology.group("pp")
    assert len(model.decoder.layers) == 1  # one of the two layers per stage
    # The collection's None groups are the topology's too, so a TP = 1 config contradicts them.
    with pytest.raises(ValueError) as refused:
        GPTModel(_config(), get_gpt_layer_local_spec(), 64, 8, pg_collection=ProcessGroupCollection())
    report = {"sizes": [topology.tensor_model_parallel_size, topology.pipeline_model_parallel_size,
                        topology.data_parallel_size, topology.expert_data_parallel_size],
              "tp": _members(current.tp), "pp": _members(current.pp), "refused": str(refused.value)}
    ps.destroy_model_parallel()
    report["after_destroy"] = [current_topology().is_initialized, resolve_pg_collection().tp]
    return report


def test_missing_groups_resolve_to_the_current_topology():
    for rank, report in enumerate(run_distributed(_resolved_groups, 4)):
        assert report["sizes"] == [2, 2, 1, 1]  # DP and expert DP: 4 / (2 x 2)
        assert report["tp"] == [rank - rank % 2, rank - rank % 2 + 1] and report["pp"] == [rank % 2, rank % 2 + 2]
        assert report["refused"].startswith("config.tensor_model_parallel_size=1 but the model's tp group has 2")
        assert report["after_destroy"] == [False, None]
