import pytest
import torch.distributed as dist

from dist import run_distributed
from teratron import parallel_state as ps
from teratron.parallel_state import RankGenerator
from teratron.process_groups import ProcessGroupCollection, get_pg_rank, get_pg_size
from teratron.topology import current_topology

# 16 ranks, order "tp-cp-ep-dp-pp". Written out by hand from
#   dense:  rank = tp + 2*cp + 4*dp + 8*pp          (TP2 CP2 DP2 PP2)
#   expert: rank = etp + 2*ep + 4*edp + 8*pp        (ETP2 EP2 EDP2 PP2)
DENSE = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "tp-pp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
    "tp-cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "tp-dp": [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]],
    "tp-dp-cp": [list(range(8)), list(range(8, 16))],
}
EXPERT = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "tp-ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "tp-ep-pp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
}
EMBEDDING = [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]  # first + last stage
POSITION_EMBEDDING = [[r] for r in range(8)]  # first stage


def test_rank_generator_dense_and_expert_grids():
    dense = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for token, groups in DENSE.items():
        assert dense.get_ranks(token) == groups, token
    assert dense.get_ranks("cp-dp") == DENSE["dp-cp"]  # members follow the order, not the token
    expert = RankGenerator(tp=2, ep=2, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for token, groups in EXPERT.items():
        assert expert.get_ranks(token) == groups, token


def test_rank_generator_other_order_and_errors():
    # order "tp-pp-dp": rank = tp + 2*pp + 4*dp (missing size-1 dims go last)
    grid = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp")
    assert grid.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.get_ranks("tp-dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="leaves out cp"):
        RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=2, order="tp-dp-pp")
    with pytest.raises(ValueError, match="at most once"):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-tp")
    with pytest.raises(ValueError, match="unknown"):
        grid.get_ranks("tp-xx")


def test_uninitialized_is_a_group_of_one():
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_group() is None
    assert ps.get_data_parallel_group(with_context_parallel=True) is None
    assert ps.get_embedding_group() is None
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_pipeline_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_rank() == 0
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    assert all(getattr(pgs, name) is None for name in ("tp", "pp", "dp", "dp_cp", "cp", "ep", "expt_tp",
                                                       "expt_dp", "mp", "embd", "pos_embd", "tp_cp"))
    assert get_pg_size(None) == 1 and get_pg_rank(None) == 0


def _members(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _grid_report():
    for bad in [dict(tensor_model_parallel_size=3),
                dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=4,
                     pipeline_model_parallel_size=2)]:
        try:
            ps.initialize_model_parallel(**bad)
        except ValueError as error:
            assert "16" in str(error), error
        else:
            raise AssertionError(f"{bad} was accepted")
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=2, context_parallel_size=2,
                                 expert_model_parallel_size=2)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    report = {
        "groups": {name: _members(getattr(pgs, name)) for name in
                   ("tp", "pp", "dp", "dp_cp", "cp", "ep", "expt_tp", "expt_dp", "tp_ep", "mp", "embd",
                    "pos_embd", "tp_cp")},
        "tp_dp": _members(ps.get_tensor_and_data_parallel_group()),
        "tp_dp_cp": _members(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        "tp_ep_pp": _members(ps.get_expert_tensor_model_pipeline_parallel_group()),
        "sizes": [ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                  ps.get_data_parallel_world_size(), ps.get_data_parallel_world_size(with_context_parallel=True),
                  ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                  ps.get_expert_tensor_parallel_world_size(), ps.get_expert_data_parallel_world_size(),
                  ps.get_model_parallel_world_size(), ps.get_tensor_and_context_parallel_world_size()],
        "ranks": [ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
                  ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                  ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_tensor_parallel_rank(),
                  ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()],
        "pp_neighbours": [ps.get_pipeline_model_parallel_first_rank(), ps.get_pipeline_model_parallel_last_rank(),
                          ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()],
        "src": [ps.get_tensor_model_parallel_src_rank(), ps.get_data_parallel_src_rank()],
        "in_embedding": ps.is_rank_in_embedding_group(),
        "in_position_embedding": ps.is_rank_in_position_embedding_group(),
        "embedding_ranks": ps.get_embedding_global_ranks(),
    }
    stages = {}
    for vp in (0, 1):
        ps.set_virtual_pipeline_model_parallel_rank(vp)
        stages[vp] = [ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                      ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True),
                      ps.is_rank_in_embedding_group(ignore_virtual=False)]
    ps.set_virtual_pipeline_model_parallel_rank(0)
    stages["vp_stage=1"] = [ps.is_pipeline_first_stage(vp_stage=1), ps.is_pipeline_last_stage(vp_stage=1)]
    report["stages"] = stages
    report["vpp"] = ps.get_virtual_pipeline_model_parallel_world_size()
    t = current_topology()
    report["topology"] = [t.tensor_model_parallel_size, t.pipeline_model_parallel_size,
                          t.virtual_pipeline_model_parallel_size, t.context_parallel_size,
                          t.expert_model_parallel_size, t.expert_tensor_parallel_size, t.data_parallel_size,
                          t.expert_data_parallel_size]
    ps.destroy_model_parallel()
    report["destroyed"] = [ps.model_parallel_is_initialized(), ps.get_tensor_model_parallel_group(),
                           ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size()]
    return report


def _own(groups, rank):
    return next(g for g in groups if rank in g)


def test_sixteen_rank_grid_getters():
    reports = run_distributed(_grid_report, 16)
    for rank, report in enumerate(reports):
        tp, cp, dp, pp = rank % 2, rank // 2 % 2, rank // 4 % 2, rank // 8
        etp, ep, edp = rank % 2, rank // 2 % 2, rank // 4 % 2
        g = report["groups"]
        assert g["tp"] == _own(DENSE["tp"], rank) and g["cp"] == _own(DENSE["cp"], rank)
        assert g["dp"] == _own(DENSE["dp"], rank) and g["dp_cp"] == _own(DENSE["dp-cp"], rank)
        assert g["pp"] == _own(DENSE["pp"], rank) and g["mp"] == _own(DENSE["tp-pp"], rank)
        assert g["tp_cp"] == _own(DENSE["tp-cp"], rank)
        assert report["tp_dp"] == _own(DENSE["tp-dp"], rank)
        assert report["tp_dp_cp"] == _own(DENSE["tp-dp-cp"], rank)
        assert g["expt_tp"] == _own(EXPERT["tp"], rank) and g["ep"] == _own(EXPERT["ep"], rank)
        assert g["expt_dp"] == _own(EXPERT["dp"], rank) and g["tp_ep"] == _own(EXPERT["tp-ep"], rank)
        assert report["tp_ep_pp"] == _own(EXPERT["tp-ep-pp"], rank)
        assert g["embd"] == _own(EMBEDDING, rank)  # every rank is on the first or the last stage
        assert g["pos_embd"] == ([rank] if pp == 0 else None)
        assert report["sizes"] == [2, 2, 2, 4, 2, 2, 2, 2, 4, 4]
        assert report["ranks"] == [tp, cp, dp, pp, cp + 2 * dp, etp, ep, edp]
        stage_ranks = _own(DENSE["pp"], rank)
        other = stage_ranks[1 - pp]
        assert report["pp_neighbours"] == [stage_ranks[0], stage_ranks[1], other, other]
        assert report["src"] == [_own(DENSE["tp"], rank)[0], _own(DENSE["dp"], rank)[0]]
        assert report["in_embedding"] and report["in_position_embedding"] == (pp == 0)
        assert report["embedding_ranks"] == _own(EMBEDDING, rank)
        assert report["vpp"] == 2
        assert report["topology"] == [2] * 8
        assert report["destroyed"] == [False, None, None, 1]
        first, last = pp == 0, pp == 1
        # [first, last, first ignoring virtual, last ignoring virtual, holds the embedding chunk]
        assert report["stages"][0] == [first, False, first, last, first]
        assert report["stages"][1] == [False, last, first, last, last]
        assert report["stages"]["vp_stage=1"] == [False, last]
