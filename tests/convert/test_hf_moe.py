"""Hugging Face conversion of the MoE families: tiny random Mixtral, Qwen2-MoE (its gated shared
expert, QKV biases, per-layer windows) and Qwen3-MoE models built offline with transformers
(every weight random). Imported logits equal transformers' (fp32,
1e-4, dropless) with either expert class; import-hf -> export-hf gives back the same tensors and
config, and transformers loads the export with the same logits; a checkpoint imported at EP = 1
loads at EP = 2 (and expert-TP = 2) with the same logits and re-saves to the same weights; a
fine-tuned import exports with the run's aux-loss coefficient."""

import json

import pytest
import torch
from torch.testing import assert_close

from convert.hf_testing import (VOCAB, TOKENIZER_FILES, convert, finetune, hf_logits, hf_tensors,
                                ids_and_positions, read_config, save_random_hf_model)
from dist import run_distributed
from teratron import parallel_state as ps
from teratron.convert.hf import from_hf
from teratron.convert.hf_config import hf_config_from_model_args, model_args_from_hf
from teratron.convert.safetensors_io import INDEX_FILENAME
from teratron.dist_checkpointing import load_checkpoint, save_checkpoint, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.models.gpt.builder import build_gpt_model

MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
FAMILIES = {
    # every layer MoE, top-2 renormalised; the experts' size is intermediate_size
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)),
    # layer 1 only (decoder_sparse_step 2), weights not renormalised, a dense MLP elsewhere
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=16,
                       decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)),
    # layers 0 and 1 (layer 2 in mlp_only_layers), top-3 renormalised, tied embeddings
    "qwen3_moe_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3, mlp_only_layers=[2],
                            norm_topk_prob=True, tie_word_embeddings=True, router_aux_loss_coef=0.02)),
    # layers 0 and 2 (layer 1 in mlp_only_layers), weights not renormalised, the gated shared expert,
    # QKV biases, a window of 4 (biting on 12 tokens) on layer 0 only (max_window_layers 2)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                       num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False, use_sliding_window=True,
                       sliding_window=4, max_window_layers=2)),
    # layer 1 only (decoder_sparse_step 2), top-2 renormalised, no QKV bias, tied embeddings, no windows
    "qwen2_moe_norm": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                       dict(moe_intermediate_size=24, shared_expert_intermediate_size=16, num_experts=4,
                            num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False,
                            tie_word_embeddings=True)),
}


def make_moe_model(family, path):
    """A random tiny HF MoE model saved to `path` (with tokenizer files); its logits."""
    config_cls, model_cls, extra = FAMILIES[family]
    logits = save_random_hf_model(config_cls, model_cls, {**MOE, **extra}, path, max_shard_size="20KB")
    if family == "qwen3_moe_norm":  # the Hub's Qwen3-MoE config names (transformers 4)
        hub = read_config(path)
        hub.update(num_experts=hub.pop("num_local_experts"), rope_theta=hub.pop("rope_parameters")["rope_theta"])
        (path / "config.json").write_text(json.dumps(hub))
    return logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_import_export_round_trip(family, tmp_path):
    src = tmp_path / "hf"
    reference = make_moe_model(family, src)
    for grouped in (False, True):
        model, config = from_hf(str(src), moe_grouped_gemm=grouped)
        with torch.no_grad():
            assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    expected_freq = {"mixtral": 1, "qwen3_moe": [0, 1, 0], "qwen3_moe_norm": [1, 1, 0], "qwen2_moe": [1, 0, 1],
                     "qwen2_moe_norm": [0, 1, 0]}[family]
    assert (config.num_moe_experts, config.moe_layer_freq) == (4, expected_freq)
    assert config.moe_router_pre_softmax == (family in ("qwen3_moe", "qwen2_moe"))
    assert config.moe_aux_loss_coeff == read_config(src)["router_aux_loss_coef"]
    qwen2 = family.startswith("qwen2_moe")
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (
        ({"qwen2_moe": 40, "qwen2_moe_norm": 16}[family], True) if qwen2 else (None, False))
    assert config.add_qkv_bias == (family == "qwen2_moe")
    assert (config.window_size, config.window_attn_skip_freq) == (((3, 0), [1, 0, 0]) if family == "qwen2_moe"
                                                                  else (None, None))

    original = hf_tensors(src)
    for grouped in (False, True):
        ckpt, out = tmp_path / f"ckpt{grouped}", tmp_path / f"out{grouped}"
        convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), "--expert-model-parallel-size", "2",
                *(["--moe-grouped-gemm"] if grouped else []))
        metadata = storage.read_metadata(storage.resolve_checkpoint_dir(str(ckpt)))
        assert metadata["model_args"]["moe_grouped_gemm"] == grouped
        assert metadata["layout"]["expert_model_parallel_size"] == 2
        convert("export-hf", "--load", str(ckpt), "--out", str(out), "--max-shard-size", "30KB")
        exported = hf_tensors(out)
        assert set(original) == set(exported)
        for name in original:
            assert torch.equal(original[name], exported[name]), name
        # The config comes back (RoPE in the source's own fields), with head_dim set.
        assert read_config(out) == {**read_config(src), "head_dim": config.kv_channels}
        for name in TOKENIZER_FILES:
            assert (out / name).read_bytes() == (src / name).read_bytes()
        assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


def _expert_parallel_reload(ckpt, resaved):
    """On 2 ranks, the EP = 1 import loaded at EP = 2 (alltoall dispatcher) and at TP = expert-TP
    = 2 (allgather); the logits of both. The EP = 2 model is re-saved to `resaved`."""
    checkpoint_dir = storage.resolve_checkpoint_dir(ckpt)
    model_args = storage.read_metadata(checkpoint_dir)["model_args"]
    logits = []
    for tp, ep, dispatcher in ((1, 2, "alltoall"), (2, 1, "allgather")):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        model = build_gpt_model(gpt_config_from_model_args(
            model_args, padded_vocab_size=128 * tp, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
            moe_token_dispatcher_type=dispatcher))
        model.parallel_output = False
        load_checkpoint(checkpoint_dir, [model], load_optimizer=False)
        with torch.no_grad():
            logits.append(model(*ids_and_positions())[..., :VOCAB])
        if ep == 2:
            moe = [layer.mlp for layer in model.decoder.layers if hasattr(layer.mlp, "local_expert_indices")]
            assert moe and all(len(mlp.local_expert_indices) == 2 for mlp in moe)
            save_checkpoint(resaved, 3, [model], metadata={"model_args": model_args})
        ps.destroy_model_parallel()
    return logits


@pytest.mark.parametrize("family,grouped", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", True)])
def test_expert_parallel_load_and_export(family, grouped, tmp_path):
    """import-hf (EP = 1) -> EP = 2 and TP = 2 loads (logits as transformers'; Qwen2-MoE's gated
    shared expert and windows too) -> EP = 2 save -> export-hf without the HF side files (the
    config is rebuilt from the model args) -> the same tensors, and transformers agrees."""
    src, ckpt, resaved, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "resaved", tmp_path / "out"
    reference = make_moe_model(family, src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), *(["--moe-grouped-gemm"] if grouped else []))
    for rank_logits in (t for per_rank in run_distributed(_expert_parallel_reload, 2, str(ckpt), str(resaved))
                        for t in per_rank):
        assert_close(rank_logits, reference, rtol=0, atol=1e-4)
    convert("export-hf", "--load", str(resaved), "--out", str(out))
    original, exported = hf_tensors(src), hf_tensors(out)
    assert set(original) == set(exported)
    for name in original:
        assert torch.equal(original[name], exported[name]), name
    rebuilt = read_config(out)
    assert rebuilt["model_type"] == family
    assert (rebuilt["decoder_sparse_step"], rebuilt["mlp_only_layers"]) == (1, [0, 2] if family == "qwen3_moe" else [1])
    if family == "qwen2_moe":
        assert (rebuilt["use_sliding_window"], rebuilt["sliding_window"], rebuilt["layer_types"]) == (
            True, 4, ["sliding_attention", "full_attention", "full_attention"])
        assert (rebuilt["shared_expert_intermediate_size"], rebuilt["qkv_bias"]) == (40, True)
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


def test_finetune_an_imported_mixtral_and_export_it(tmp_path):
    """import-hf -> `teratron train --load --finetune` with Megatron's MoE flags -> export-hf:
    transformers loads the trained experts and agrees with teratron's logits for them; the run's
    aux-loss coefficient becomes router_aux_loss_coef."""
    src, ckpt, trained, out = (tmp_path / n for n in ("hf", "ckpt", "trained", "out"))
    make_moe_model("mixtral", src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    finetune(ckpt, trained, "--num-layers", "3", "--ffn-hidden-size", "24", "--rotary-base", "1000000",
             "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
             "--moe-layer-freq", "[1]*3",  # recorded as the import's 1: the same layer pattern
             "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.05")
    convert("export-hf", "--load", str(trained), "--out", str(out))
    assert read_config(out)["router_aux_loss_coef"] == 0.05
    expert = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    assert not torch.equal(hf_tensors(out)[expert], hf_tensors(src)[expert])
    model, _ = from_hf(str(out))
    with torch.no_grad():
        ours = model(*ids_and_positions())
    assert_close(hf_logits(str(out)), ours, rtol=0, atol=1e-4)


def test_finetune_an_imported_qwen2_moe_and_export_it(tmp_path):
    """Qwen2-MoE through `teratron train` with Megatron's flags for it (the gated shared expert:
    --moe-shared-expert-gate; the window on layer 0): the trained gate and shared expert export,
    and transformers agrees with teratron's logits for them."""
    src, ckpt, trained, out = (tmp_path / n for n in ("hf", "ckpt", "trained", "out"))
    make_moe_model("qwen2_moe", src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    finetune(ckpt, trained, "--num-layers", "3", "--ffn-hidden-size", "48", "--norm-epsilon", "1e-5",
             "--disable-bias-linear", "--add-qkv-bias", "--window-size", "3,0", "--window-attn-skip-freq", "[1,0,0]",
             "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-layer-freq",
             "[1,0,1]", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "40",
             "--moe-shared-expert-gate", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01")
    convert("export-hf", "--load", str(trained), "--out", str(out))
    assert read_config(out)["router_aux_loss_coef"] == 0.01
    for name in ("model.layers.2.mlp.shared_expert_gate.weight", "model.layers.0.mlp.shared_expert.down_proj.weight"):
        assert not torch.equal(hf_tensors(out)[name], hf_tensors(src)[name]), name
    model, _ = from_hf(str(out))
    with torch.no_grad():
        ours = model(*ids_and_positions())
    assert_close(hf_logits(str(out)), ours, rtol=0, atol=1e-4)


def test_moe_refusals(tmp_path):
    src = tmp_path / "hf"
    make_moe_model("qwen3_moe", src)
    hf = read_config(src)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 with renormalised weights"):
        model_args_from_hf({**hf, "num_experts_per_tok": 1, "norm_topk_prob": True}, "cfg")
    assert model_args_from_hf({**hf, "num_experts_per_tok": 1}, "cfg")["moe_router_pre_softmax"]
    with pytest.raises(ValueError, match="no layer is MoE"):
        model_args_from_hf({**hf, "mlp_only_layers": [1]}, "cfg")
    no_experts = {k: v for k, v in hf.items() if k not in ("num_experts", "num_local_experts")}
    with pytest.raises(ValueError, match="cfg: config.json lacks num_experts"):
        model_args_from_hf(no_experts, "cfg")
    with pytest.raises(ValueError, match="cfg: config.json lacks moe_intermediate_size"):
        model_args_from_hf({**hf, "moe_intermediate_size": None}, "cfg")
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide the model's 4 experts"):
        convert("import-hf", "--hf-path", str(src), "--save", str(tmp_path / "c"), "--expert-model-parallel-size", "3")
    (src / "config.json").write_text(json.dumps({**hf, "moe_intermediate_size": 25}))
    with pytest.raises(ValueError, match="does not divide the experts' MLP size \\(25\\)"):
        convert("import-hf", "--hf-path", str(src), "--save", str(tmp_path / "c"), "--tensor-model-parallel-size", "2")
    assert not (tmp_path / "c").exists()
    (src / "config.json").write_text(json.dumps(hf))
    index = json.loads((src / INDEX_FILENAME).read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    (src / INDEX_FILENAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.3.up_proj.weight is missing"):
        from_hf(str(src))

    args = model_args_from_hf(hf, "cfg")
    for field, value, expected in (("moe_shared_expert_intermediate_size", 16, None),
                                   ("moe_router_score_function", "sigmoid", "softmax"),
                                   ("add_bias_linear", True, False)):
        with pytest.raises(ValueError, match=f"{field}={value!r}; Mixtral and Qwen3-MoE need {expected!r}"):
            hf_config_from_model_args({**args, field: value})
    no_qk_norm = {**args, "qk_layernorm": False}
    with pytest.raises(ValueError, match="mixes dense and MoE layers"):
        hf_config_from_model_args(no_qk_norm)
    with pytest.raises(ValueError, match="moe_router_pre_softmax=True"):
        hf_config_from_model_args({**no_qk_norm, "moe_layer_freq": 1})
    assert hf_config_from_model_args({**no_qk_norm, "moe_layer_freq": 1, "moe_router_pre_softmax": False}) \
        ["model_type"] == "mixtral"


def test_qwen2_moe_refusals(tmp_path):
    src = tmp_path / "hf"
    make_moe_model("qwen2_moe", src)
    hf = read_config(src)
    for change, message in [
        (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0; transformers' qwen2_moe always"),
        (dict(shared_expert_intermediate_size=None), "config.json lacks shared_expert_intermediate_size"),
        (dict(use_sliding_window=False), "layer_types has sliding layers but sliding_window=0"),
        (dict(layer_types=["sliding_attention"] * 2), "layer_types must give 3 entries"),
    ]:
        with pytest.raises(ValueError, match=f"^cfg: {message}"):
            model_args_from_hf({**hf, **change}, "cfg")
    # Without layer_types, transformers 5's rule: every other layer below max_window_layers.
    derived = {k: v for k, v in hf.items() if k != "layer_types"}
    assert model_args_from_hf({**derived, "max_window_layers": 3}, "cfg")["window_attn_skip_freq"] == [1, 0, 1]
    assert "window_size" not in model_args_from_hf({**derived, "use_sliding_window": False}, "cfg")
    args = model_args_from_hf(hf, "cfg")
    for change, message in [
        (dict(qk_layernorm=True), "the checkpoint's MoE model has qk_layernorm=True; Qwen2-MoE needs False"),
        (dict(moe_router_score_function="sigmoid"),
         "the checkpoint's MoE model has moe_router_score_function='sigmoid'; Qwen2-MoE needs 'softmax'"),
        (dict(window_size=[3, 2]), "the checkpoint's model has window_size=\\[3, 2\\]; Qwen2-MoE's windows are causal"),
        (dict(moe_shared_expert_gate=False), "the checkpoint's MoE model has moe_shared_expert_intermediate_size=40; "
                                             "Mixtral and Qwen3-MoE need None"),
    ]:
        with pytest.raises(ValueError, match=f"^{message}"):
            hf_config_from_model_args({**args, **change})
