"""Layer placement: the layout language, even/uneven splits, and the errors for bad input.

Expected placements are written out by hand from the rules (seed text for the layout field,
Megatron's documented split rules), not computed by the code under test.
"""

import pytest

from teratron.pipeline_parallel.layout import (LayerType, PipelineParallelLayerLayout, get_mtp_num_layers_to_build,
                                               get_num_layers_to_build, get_transformer_layer_offset,
                                               stage_layer_counts)
from teratron.transformer.transformer_config import TransformerConfig

E, t, m, L = LayerType.embedding, LayerType.decoder, LayerType.mtp, LayerType.loss


def make_config(**kwargs) -> TransformerConfig:
    return TransformerConfig(hidden_size=8, num_attention_heads=2, **kwargs)


def placement(config, pp: int, vpp: int = 1) -> list:
    """[(offset, count)] per flat stage i = v * pp + p, through the public functions."""
    out = []
    for v in range(vpp):
        for p in range(pp):
            vp_stage = v if vpp > 1 else None
            out.append((get_transformer_layer_offset(config, vp_stage, pp_rank=p, pp_size=pp),
                        get_num_layers_to_build(config, vp_stage, pp_rank=p, pp_size=pp)))
    return out


def test_megatron_module_paths_name_the_same_objects():
    # Megatron users import these from core.transformer; placement lives in one module here.
    from teratron.transformer import enums, pipeline_parallel_layer_layout, transformer_block

    assert pipeline_parallel_layer_layout.PipelineParallelLayerLayout is PipelineParallelLayerLayout
    assert enums.LayerType is LayerType
    assert transformer_block.get_num_layers_to_build is get_num_layers_to_build


def test_seed_list_example():
    # [['embedding', 'decoder'], ['decoder', 'decoder', 'decoder', 'loss']]: pp = 2, vpp = None;
    # pp rank 0 holds embedding, decoder; pp rank 1 holds decoder*3, loss.
    layout = PipelineParallelLayerLayout([["embedding", "decoder"], ["decoder", "decoder", "decoder", "loss"]], 2)
    assert layout.virtual_pipeline_model_parallel_size == 1
    assert layout.layout == [[[E, t]], [[t, t, t, L]]]
    config = make_config(num_layers=4, pipeline_model_parallel_size=2,
                         pipeline_model_parallel_layout=[["embedding", "decoder"], ["decoder"] * 3 + ["loss"]])
    assert config.virtual_pipeline_model_parallel_size is None
    assert placement(config, 2) == [(0, 1), (1, 3)]


def test_seed_string_example():
    # The seed renders this example as 'E|(tt|)*2,(t|)4,mL' with the header "pp = 2, vpp = 4";
    # its renderer dropped the '*' of '(t|)*4', and the placement it lists (pp ranks 0..3,
    # vpp ranks 0..1) is pp = 4, vpp = 2 under i = a * pp + b:
    #   vpp 0: pp 0 embedding | pp 1-2 decoder*2 | pp 3 decoder
    #   vpp 1: pp 0-2 decoder | pp 3 mtp, loss
    layout = PipelineParallelLayerLayout("E|(tt|)*2,(t|)*4,mL", 4)
    assert layout.virtual_pipeline_model_parallel_size == 2
    assert layout.layout == [
        [[E], [t]],
        [[t, t], [t]],
        [[t, t], [t]],
        [[t], [m, L]],
    ]
    layout.validate_layer_layout(num_layers=8, mtp_num_layers=1)
    assert [layout.get_layer_offset(vp_stage=v, pp_rank=p) for v in range(2) for p in range(4)] == [0, 0, 2, 4, 5, 6, 7, 8]
    assert layout.get_layer_id_list(vp_stage=0, pp_rank=2) == [2, 3]
    assert layout.get_num_layers_to_build(LayerType.mtp, vp_stage=1, pp_rank=3) == 1
    assert layout.pretty_repr().splitlines() == [
        "PP rank 0: E | t", "PP rank 1: t*2 | t", "PP rank 2: t*2 | t", "PP rank 3: t | m,L"]
    assert layout == PipelineParallelLayerLayout([["E"], ["t", "t"], ["t", "t"], ["t"]] + [["t"]] * 3 + [["m", "L"]], 4)
    # Read literally, the garbled text is malformed: '4' is not a layer.
    with pytest.raises(ValueError, match=r"unexpected '4'"):
        PipelineParallelLayerLayout.parse_str_to_list("E|(tt|)*2,(t|)4,mL")


def test_string_grammar():
    parse = PipelineParallelLayerLayout.parse_str_to_list
    assert parse("Et*3|(tt|)*29,m|L") == [[E, t, t, t]] + [[t, t]] * 29 + [[m], [L]]
    assert parse("E, t | t t L") == [[E, t], [t, t, L]]
    assert parse("((t|)*2t)*2") == [[t], [t], [t, t], [t], [t]]  # nested repetition
    assert parse("Et|*2L") == [[E, t], [], [L]]
    assert PipelineParallelLayerLayout.get_num_stages_from_str("E|(t|)*3L") == 5


@pytest.mark.parametrize("text, message", [
    ("Ex|L", r"unexpected 'x' at position 1"),
    ("E|(t|", r"unclosed '\('"),
    ("Et)|L", r"unmatched '\)'"),
    ("Et*|L", r"'\*' must be followed by a repeat count"),
    ("E*t|L", r"'\*' must be followed by a repeat count"),
    ("*2Et|L", r"unexpected '\*'"),
])
def test_malformed_strings(text, message):
    with pytest.raises(ValueError, match=message):
        PipelineParallelLayerLayout.parse_str_to_list(text)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|L"),
     r"3 stages, which is not a multiple of pipeline_model_parallel_size \(2\)"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|ttL"),
     r"names 3 decoder layers 't' but num_layers is 4"),
    (dict(num_layers=2, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|ttL"),
     r"names 3 decoder layers 't' but num_layers is 2"),
    (dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="tE|ttL"),
     r"embedding 'E' exactly once, first in the first stage"),
    (dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tLt|E|L"),
     r"embedding 'E' exactly once"),
    (dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="EtL|tt"),
     r"loss 'L' exactly once, last in the last stage"),
    (dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tmtL"),
     r"names 1 mtp layers 'm' but mtp_num_layers is None"),
    (dict(num_layers=3, mtp_num_layers=1, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tmtL"),
     r"places decoder layers after an mtp layer"),
    (dict(num_layers=2, mtp_num_layers=1, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettm|L"),
     r"places mtp layers 'm' outside the last stage"),
    (dict(num_layers=2, mtp_num_layers=2, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettm|mL"),
     r"places mtp layers 'm' outside the last stage"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3,
          pipeline_model_parallel_layout="Et|t|t|tL"),
     r"4 stages = 2 pipeline x 2 virtual stages, but virtual_pipeline_model_parallel_size is 3"),
    (dict(num_layers=2, pipeline_model_parallel_layout="Et|tL"),
     r"has 2 stages but pipeline_model_parallel_size is 1"),
    (dict(num_layers=2, pipeline_model_parallel_size=2, pipeline_model_parallel_layout=[["E", "t"], ["tt", "L"]]),
     r"unknown layer 'tt'"),
    (dict(num_layers=2, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tL",
          num_layers_in_first_pipeline_stage=1),
     r"cannot be combined"),
    (dict(num_layers=7, pipeline_model_parallel_size=2),
     r"num_layers \(7\) over pipeline_model_parallel_size \(2\): 7 layers cannot be split evenly over 2"),
    (dict(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3),
     r"pipeline rank 0's 4 layers over virtual_pipeline_model_parallel_size \(3\)"),
    (dict(num_layers=8, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=1,
          num_layers_in_last_pipeline_stage=2),
     r"the 5 layers left for the 2 middle pipeline stages"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1,
          num_layers_in_last_pipeline_stage=2),
     r"do not add up to num_layers \(4\)"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=5),
     r"do not add up to num_layers \(4\)"),
    (dict(num_layers=4, num_layers_in_first_pipeline_stage=2),
     r"num_layers_in_first_pipeline_stage=2 needs pipeline_model_parallel_size > 1"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=-1),
     r"num_layers_in_last_pipeline_stage must be a non-negative integer"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1,
          account_for_loss_in_pipeline_split=True),
     r"cannot be combined with account_for_embedding/loss_in_pipeline_split"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True),
     r"num_layers \(4\) \+ embedding/loss \(1\)"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_config(**kwargs)


def test_even_and_virtual_split():
    assert placement(make_config(num_layers=8, pipeline_model_parallel_size=4), 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    config = make_config(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    # virtual stage 0 holds layers 0-3 (rank 0: 0-1, rank 1: 2-3), virtual stage 1 layers 4-7.
    assert placement(config, 2, 2) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    with pytest.raises(ValueError, match="vp_stage must be given"):
        get_num_layers_to_build(config, pp_rank=0, pp_size=2)


def test_uneven_first_and_last():
    config = make_config(num_layers=8, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=1,
                         num_layers_in_last_pipeline_stage=3)
    assert placement(config, 4) == [(0, 1), (1, 2), (3, 2), (5, 3)]
    config = make_config(num_layers=5, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1)
    assert placement(config, 2) == [(0, 1), (1, 4)]
    config = make_config(num_layers=10, pipeline_model_parallel_size=3, num_layers_in_last_pipeline_stage=2)
    assert placement(config, 3) == [(0, 4), (4, 4), (8, 2)]
    # With virtual stages each rank's layers split over its chunks: ranks hold 2, 4, 4, 6.
    config = make_config(num_layers=16, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
                         num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=6)
    assert stage_layer_counts(config, 4) == [1, 2, 2, 3, 1, 2, 2, 3]
    assert placement(config, 4, 2) == [(0, 1), (1, 2), (3, 2), (5, 3), (8, 1), (9, 2), (11, 2), (13, 3)]


def test_account_for_embedding_and_loss():
    config = make_config(num_layers=6, pipeline_model_parallel_size=4, account_for_embedding_in_pipeline_split=True,
                         account_for_loss_in_pipeline_split=True)
    assert placement(config, 4) == [(0, 1), (1, 2), (3, 2), (5, 1)]
    config = make_config(num_layers=7, pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True)
    assert placement(config, 2) == [(0, 3), (3, 4)]
    config = make_config(num_layers=3, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                         account_for_loss_in_pipeline_split=True)
    assert placement(config, 2, 2) == [(0, 1), (1, 1), (2, 1), (3, 0)]


def test_layout_sets_virtual_size_and_placement():
    config = make_config(num_layers=5, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|tL")
    assert isinstance(config.pipeline_model_parallel_layout, PipelineParallelLayerLayout)
    assert config.virtual_pipeline_model_parallel_size == 2
    assert placement(config, 2, 2) == [(0, 1), (1, 2), (3, 1), (4, 1)]
    # An empty middle stage and a standalone loss stage.
    config = make_config(num_layers=3, pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Ett||t|L")
    assert placement(config, 4) == [(0, 2), (2, 0), (2, 1), (3, 0)]
    # One process builds the whole model whatever the layout.
    assert get_num_layers_to_build(config, pp_rank=0, pp_size=1) == 3
    with pytest.raises(ValueError, match="layout is for 4 pipeline stages, not 2"):
        get_num_layers_to_build(config, pp_rank=0, pp_size=2)


def test_mtp_layers_sit_on_the_last_stage():
    def mtp_counts(config, pp, vpp=1):
        return [get_mtp_num_layers_to_build(config, v if vpp > 1 else None, pp_rank=p, pp_size=pp)
                for v in range(vpp) for p in range(pp)]

    assert mtp_counts(make_config(num_layers=4, mtp_num_layers=2), 1) == [2]
    assert mtp_counts(make_config(num_layers=4, mtp_num_layers=2, pipeline_model_parallel_size=2), 2) == [0, 2]
    config = make_config(num_layers=4, mtp_num_layers=1, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2)
    assert mtp_counts(config, 2, 2) == [0, 0, 0, 1]  # the last virtual stage of the last rank
    # A layout: MTP with the loss in a standalone last stage, and alongside decoder layers.
    config = make_config(num_layers=4, mtp_num_layers=2, pipeline_model_parallel_size=2,
                         pipeline_model_parallel_layout="Ett|tt|  |mmL")
    assert placement(config, 2, 2) == [(0, 2), (2, 2), (4, 0), (4, 0)]
    assert mtp_counts(config, 2, 2) == [0, 0, 0, 2]
    config = make_config(num_layers=3, mtp_num_layers=1, pipeline_model_parallel_size=2,
                         pipeline_model_parallel_layout="Et|ttmL")
    assert mtp_counts(config, 2) == [0, 1]
    assert mtp_counts(make_config(num_layers=3), 1) == [0]
