"""`teratron merge`: the weighted sum of model weights, published atomically; every
incompatibility refuses with its reason and writes nothing."""

import json
import os

import pytest
import torch

from dist import run_distributed
from teratron import cli
from teratron import parallel_state as ps
from teratron.dist_checkpointing import load_checkpoint, save_checkpoint, storage
from teratron.dist_checkpointing.merge import merge_checkpoints
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.models.gpt.builder import build_gpt_model
from teratron.process_groups import ProcessGroupCollection

ARGS = dict(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2, num_query_groups=2,
            kv_channels=8, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
            add_qkv_bias=False, qk_layernorm=False, position_embedding_type="rope", rotary_base=10000,
            rotary_percent=1.0, rotary_interleaved=False, untie_embeddings_and_output_weights=True,
            max_position_embeddings=16, vocab_size=32, padded_vocab_size=32, num_experts=None,
            moe_ffn_hidden_size=None, moe_router_topk=None)


def merge_cli(*argv):
    return cli.main(["merge", *argv])


def model(seed, dtype=torch.float32, **changes):
    args = {**ARGS, **changes}
    torch.manual_seed(seed)
    return build_gpt_model(gpt_config_from_model_args(args, params_dtype=dtype),
                           pg_collection=ProcessGroupCollection()), args


def saved(root, seed, iteration=10, dtype=torch.float32, **changes):
    m, args = model(seed, dtype, **changes)
    save_checkpoint(str(root), iteration, [m], metadata={"model_args": args}, common={"iteration": iteration})
    return m


def test_weighted_sum_loads_like_any_checkpoint(tmp_path):
    models = [saved(tmp_path / name, seed, it) for name, seed, it in (("a", 1, 10), ("b", 2, 20), ("c", 3, 30))]
    weights = [0.5, 0.3, 0.4]  # used as given: no normalisation
    assert merge_cli("--inputs", *(str(tmp_path / n) for n in "abc"), "--weights", *map(str, weights),
                     "--output", str(tmp_path / "merged")) == 0
    fresh, _ = model(seed=9)
    metadata, _ = load_checkpoint(storage.resolve_checkpoint_dir(str(tmp_path / "merged")), [fresh], load_rng=False)
    states = [m.state_dict() for m in models]
    for name, value in fresh.state_dict().items():
        expected = sum(w * s[name].double() for w, s in zip(weights, states)).float()
        assert torch.equal(value, expected), name
    assert metadata["iteration"] == 30 and metadata["has_optimizer"] is False
    assert metadata["merge"]["weights"] == weights and metadata["merge"]["optimizer_state"] == "dropped"
    assert metadata["merge"]["inputs"] == [storage.iteration_dir(str(tmp_path / n), it)
                                           for n, it in (("a", 10), ("b", 20), ("c", 30))]
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c", "merged"]

    merge_checkpoints([str(tmp_path / "a"), str(tmp_path / "b")], [2.0, 6.0], str(tmp_path / "norm"), normalize=True)
    load_checkpoint(storage.resolve_checkpoint_dir(str(tmp_path / "norm")), [fresh], load_rng=False)
    for name, value in fresh.state_dict().items():
        expected = (0.25 * states[0][name].double() + 0.75 * states[1][name].double()).float()
        assert torch.equal(value, expected), name

    with pytest.raises(ValueError, match="has no optimizer state"):  # resume needs --no-load-optim
        opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        load_checkpoint(storage.resolve_checkpoint_dir(str(tmp_path / "norm")), [fresh], optimizer=opt)


def _save_tp2(root):
    ps.initialize_model_parallel(2)
    args = dict(ARGS)
    m = build_gpt_model(gpt_config_from_model_args(args, tensor_model_parallel_size=2))
    save_checkpoint(root, 10, [m], metadata={"model_args": args})


def test_fail_closed(tmp_path):
    a = tmp_path / "a"
    saved(a, 1)
    cases = {
        "keys": (dict(num_layers=3), "hold different tensors|model args differ"),
        "shape": (dict(ffn_hidden_size=32), "model args differ: ffn_hidden_size"),
        "config": (dict(norm_epsilon=1e-6), "model args differ: norm_epsilon"),
    }
    for name, (changes, reason) in cases.items():
        saved(tmp_path / name, 2, **changes)
    saved(tmp_path / "bf16", 2, dtype=torch.bfloat16)
    run_distributed(_save_tp2, 2, str(tmp_path / "tp2"))
    # Same model args but tensors that differ: hand-edited metadata must not hide them.
    saved(tmp_path / "keys_only", 2, num_layers=3)
    meta_file = storage.resolve_checkpoint_dir(str(tmp_path / "keys_only")) + "/metadata.json"
    meta = json.loads(open(meta_file).read())
    meta["model_args"]["num_layers"] = 2
    open(meta_file, "w").write(json.dumps(meta))
    refusals = [
        (["keys"], [1, 1], ValueError, r"model args differ: num_layers \(first input 2, this input 3\)$"),
        (["keys_only"], [1, 1], ValueError, "hold different tensors .* decoder.layers.2"),
        (["shape"], [1, 1], ValueError, "ffn_hidden_size"),
        (["config"], [1, 1], ValueError, "norm_epsilon"),
        (["bf16"], [1, 1], ValueError, "dtype torch.bfloat16"),
        (["tp2"], [1, 1], ValueError, "layout"),
        (["config"], [1, 0], ValueError, "positive"),
        (["config"], [1], ValueError, "2 --inputs"),
        ([], [1], ValueError, "at least two"),
        (["missing"], [1, 1], FileNotFoundError, "missing"),
    ]
    for others, weights, error, reason in refusals:
        inputs = [str(a)] + [str(tmp_path / o) for o in others]
        with pytest.raises(error, match=reason):
            merge_checkpoints(inputs, [float(w) for w in weights], str(tmp_path / "out"))
        assert not any(p.startswith("out") for p in os.listdir(tmp_path)), others
    with pytest.raises(FileExistsError, match="already exists"):
        merge_checkpoints([str(a), str(a)], [1.0, 1.0], str(tmp_path / "bf16"))
    assert merge_cli("--inputs", str(a), str(tmp_path / "config"), "--weights", "1", "-1",
                     "--output", str(tmp_path / "out")) == 2  # one-line error, status 2
    assert not (tmp_path / "out").exists()


def test_the_command_names_the_flags_that_differ(tmp_path, capsys):
    saved(tmp_path / "a", 1)
    saved(tmp_path / "b", 2, ffn_hidden_size=32, untie_embeddings_and_output_weights=False)
    assert merge_cli("--inputs", str(tmp_path / "a"), str(tmp_path / "b"), "--weights", "1", "1",
                     "--output", str(tmp_path / "out")) == 2
    assert capsys.readouterr().err.strip().endswith(
        "model args differ: --ffn-hidden-size (first input 24, this input 32); --untie-embeddings-and-output-weights "
        "(first input on, this input off)")
    assert not (tmp_path / "out").exists()


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    """A merge that fails while writing removes its staging folder and touches no other folder."""
    saved(tmp_path / "a", 1)
    saved(tmp_path / "b", 2)
    (tmp_path / "out.tmp-merge").mkdir()  # a user's folder next to the output is not a leftover

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("teratron.dist_checkpointing.merge.serialization.save", fail)
    with pytest.raises(OSError, match="disk full"):
        merge_checkpoints([str(tmp_path / "a"), str(tmp_path / "b")], [1.0, 1.0], str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "out.tmp-merge"]


def test_recorded_layouts_need_not_match(tmp_path):
    """An import records only TP/PP/EP, a run its whole layout: with the same chunks they merge."""
    a, b = saved(tmp_path / "a", 1), saved(tmp_path / "b", 2)
    b_dir = storage.resolve_checkpoint_dir(str(tmp_path / "b"))
    metadata = storage.read_metadata(b_dir)
    metadata["layout"] = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                          "expert_model_parallel_size": 1}
    storage.write_metadata(b_dir, metadata)
    merge_checkpoints([str(tmp_path / "a"), str(tmp_path / "b")], [0.5, 0.5], str(tmp_path / "out"))
    fresh, _ = model(seed=9)
    load_checkpoint(storage.resolve_checkpoint_dir(str(tmp_path / "out")), [fresh], load_rng=False)
    states = a.state_dict(), b.state_dict()
    for name, value in fresh.state_dict().items():
        expected = (0.5 * states[0][name].double() + 0.5 * states[1][name].double()).float()
        assert torch.equal(value, expected), name
