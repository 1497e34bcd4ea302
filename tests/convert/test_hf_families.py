"""Hugging Face conversion of DeepSeek-V3 and gpt-oss: tiny random models of each built offline with
transformers (every weight random, the expert bias included). Imported logits equal transformers'
(fp32, 1e-4) with either expert class; import-hf -> export-hf gives back the same tensors and
config.json, and transformers loads the export with the same logits; the import loads at
EP = 2 and at TP = expert-TP = 2 with the same logits.

gpt_oss: YaRN with fractional ramp bounds, sliding windows of 4 (biting on 12 tokens) on layers
0 and 2, sinks, biases, clamped quick-GEGLU experts; gpt_oss_rope: plain RoPE, every layer
windowed, tied embeddings. deepseek_v3: MLA with query compression and YaRN (mscale /
mscale_all_dim), one dense layer then MoE with group-limited sigmoid routing, expert bias,
scaling, two shared experts (and, in its own tests, an MTP layer: depth-1 logits equal
transformers' MtpModel's, the engine drafts with it); deepseek_v3_halves: no query compression,
RoPE in rotate-half layout (rope_interleave false, reordered on import; exported interleaved),
top-1 routing without groups, every layer MoE. Both families fine-tune through `teratron train`
with Megatron's flags for them and export the result."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from convert.hf_testing import (VOCAB, TOKENIZER_FILES, convert, finetune, hf_logits, hf_tensors,
                                ids_and_positions, read_config, save_random_hf_model)
from dist import run_distributed
from teratron import parallel_state as ps
from teratron.convert.hf import from_hf
from teratron.convert.hf_config import hf_config_from_model_args, model_args_from_hf
from teratron.convert.safetensors_io import INDEX_FILENAME
from teratron.dist_checkpointing import load_checkpoint, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.engines.mtp_proposer import MTPProposer
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.tokenizers.null_tokenizer import NullTokenizer

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=16,
            rope_theta=1000.0)
GPT_OSS = dict(intermediate_size=24, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=4, rms_norm_eps=1e-5)
DEEPSEEK = dict(intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4, kv_lora_rank=16,
                qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_routed_experts=8, num_nextn_predict_layers=0)
FAMILIES = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        GPT_OSS, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(YARN, truncate=False))),
    "gpt_oss_rope": ("GptOssConfig", "GptOssForCausalLM", dict(
        GPT_OSS, num_key_value_heads=4, layer_types=["sliding_attention"] * 3, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=5000.0))),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        DEEPSEEK, q_lora_rank=24, n_shared_experts=2, n_group=4, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8))),
    "deepseek_v3_halves": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        DEEPSEEK, q_lora_rank=None, n_shared_experts=1, n_group=1, topk_group=1, num_experts_per_tok=1,
        norm_topk_prob=False, first_k_dense_replace=0, rope_interleave=False, rope_parameters=dict(
            rope_type="default", rope_theta=500.0))),
}


def make_model(family, path):
    """A random tiny HF model saved to `path` (with tokenizer files; the expert bias random too);
    its logits."""
    config_cls, model_cls, extra = FAMILIES[family]
    logits = save_random_hf_model(config_cls, model_cls, {**COMMON, **extra}, path, max_shard_size="30KB")
    biases = [t for name, t in hf_tensors(path).items() if name.endswith("e_score_correction_bias")]
    assert len(biases) == (0 if family.startswith("gpt_oss") else 3 - FAMILIES[family][2]["first_k_dense_replace"])
    assert all(t.abs().min() > 0 for t in biases)
    return logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_round_trip(family, tmp_path):
    src = tmp_path / "hf"
    reference = make_model(family, src)
    for grouped in (False, True):
        model, config = from_hf(str(src), moe_grouped_gemm=grouped)
        with torch.no_grad():
            assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    if family.startswith("gpt_oss"):
        assert (config.softmax_type, config.glu_linear_offset, config.activation_func_clamp_value) == (
            "learnable", 1.0, 7.0)
        assert (config.window_size, config.window_attn_skip_freq) == (
            (3, 0), [1, 0, 1] if family == "gpt_oss" else None)
    else:
        assert config.multi_latent_attention and config.moe_router_enable_expert_bias
        assert config.moe_layer_freq == ([0, 1, 1] if family == "deepseek_v3" else 1)

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), "--expert-model-parallel-size", "2",
            "--tensor-model-parallel-size", "2")
    convert("export-hf", "--load", str(ckpt), "--out", str(out), "--max-shard-size", "40KB")
    original, exported = hf_tensors(src), hf_tensors(out)
    assert set(original) == set(exported)
    reordered = {n for n in original if family == "deepseek_v3_halves" and ("q_proj" in n or "kv_a_proj" in n)}
    for name in set(original) - reordered:
        assert torch.equal(original[name], exported[name]), name
    for name in reordered:  # exported in DeepSeek's interleaved layout: the same rows, reordered
        assert not torch.equal(original[name], exported[name])
        assert torch.equal(original[name].sort(dim=0).values, exported[name].sort(dim=0).values), name
    source_config, exported_config = read_config(src), read_config(out)
    if family == "deepseek_v3_halves":
        source_config["rope_interleave"] = True
    assert exported_config == source_config
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


def _parallel_reload(ckpt):
    """On 2 ranks, the EP = 1 import loaded at EP = 2 (alltoall dispatcher) and at TP = 2 (allgather;
    expert-TP 2, or 1 for biased experts); the logits of both."""
    checkpoint_dir = storage.resolve_checkpoint_dir(ckpt)
    model_args = storage.read_metadata(checkpoint_dir)["model_args"]
    logits = []
    # Experts with biases (gpt-oss) are not split over TP (expert-TP 1).
    etp = 1 if model_args["add_bias_linear"] else 2
    for tp, ep, dispatcher in ((1, 2, "alltoall"), (2, 1, "allgather")):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp if tp == 2 else 1)
        model = build_gpt_model(gpt_config_from_model_args(
            model_args, padded_vocab_size=128 * tp, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp if tp == 2 else 1, moe_token_dispatcher_type=dispatcher))
        model.parallel_output = False
        load_checkpoint(checkpoint_dir, [model], load_optimizer=False)
        with torch.no_grad():
            logits.append(model(*ids_and_positions())[..., :VOCAB])
        ps.destroy_model_parallel()
    return logits


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_expert_and_tensor_parallel_loads(family, tmp_path):
    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    reference = make_model(family, src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), "--moe-grouped-gemm")
    for rank_logits in (t for per_rank in run_distributed(_parallel_reload, 2, str(ckpt)) for t in per_rank):
        assert_close(rank_logits, reference, rtol=0, atol=1e-4)


def add_mtp_layer(src):
    """Give the saved tiny deepseek_v3 at `src` one random MTP layer (transformers' MtpModel, its
    tensors written under DeepSeek's names model.layers.3.*, with copies of the embedding and
    head) and num_nextn_predict_layers 1; returns transformers' MtpModel read back from `src`."""
    from transformers.modeling_layers import MtpModel

    (src / "config.json").write_text(json.dumps({**read_config(src), "num_nextn_predict_layers": 1}))
    main = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    torch.manual_seed(1)
    mtp = MtpModel(main, 1)
    tensors, prefix = {}, "model.layers.3."
    with torch.no_grad():
        for name, t in mtp.state_dict().items():
            if name.startswith(("embed_tokens", "shared_head")):  # the main model's, shared
                continue
            t = torch.randn_like(t) * 0.3
            name = prefix + name.removeprefix("layers.0.").removeprefix("mtp_block.").replace(
                "post_norm", "shared_head.norm")
            if name.endswith("experts.gate_up_proj"):  # per expert in the files, as the main layers
                for e, (gate, up) in enumerate(w.chunk(2) for w in t):
                    tensors.update({name.replace("gate_up_proj", f"{e}.gate_proj.weight"): gate,
                                    name.replace("gate_up_proj", f"{e}.up_proj.weight"): up})
            elif name.endswith("experts.down_proj"):
                tensors.update({name.replace("down_proj", f"{e}.down_proj.weight"): w for e, w in enumerate(t)})
            else:
                tensors[name] = t
    original = hf_tensors(src)
    tensors.update({prefix + "embed_tokens.weight": original["model.embed_tokens.weight"],
                    prefix + "shared_head.head.weight": original["lm_head.weight"]})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(src / "mtp.safetensors"))
    index = json.loads((src / INDEX_FILENAME).read_text())
    index["weight_map"].update({name: "mtp.safetensors" for name in tensors})
    (src / INDEX_FILENAME).write_text(json.dumps(index))
    # transformers looks for DeepSeek-V3's MTP layer at index 61 only: point it at this model's.
    main = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    return main, MtpModel.from_pretrained(main).eval()


def mtp_logits(model, ids, positions):
    """teratron's depth-1 logits [b, s, V] (the last position's next-next token is past the end)."""
    with torch.no_grad():
        embeddings = model.embedding(ids, positions)
        rotary = model._rotary_pos_emb(embeddings, positions)
        hidden = model.decoder(embeddings, attention_mask=None, rotary_pos_emb=rotary)
        depth1 = model.mtp(ids, positions, hidden, model.embedding, None, rotary)[0]
        return model.output_logits(depth1).transpose(0, 1)


def test_deepseek_mtp_layer_imports_exports_and_drafts(tmp_path):
    """DeepSeek-V3's MTP layer: teratron's depth-1 logits equal transformers' MtpModel's (its
    embedding of token t + 1 and the main model's final hidden state at t); import-hf ->
    export-hf gives back every tensor (the copies included) and config.json; the engine drafts
    with it and still gives transformers' greedy output."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_model("deepseek_v3", src)
    main, hf_mtp = add_mtp_layer(src)
    ids, positions = ids_and_positions()
    with torch.no_grad():
        final_hidden = main(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        hidden = hf_mtp.forward_layer(0, final_hidden[:, :-1], positions[:, 1:], None, input_ids=ids[:, 1:])
        reference = hf_mtp._project_to_logits(hidden)
    model, config = from_hf(str(src))
    assert config.mtp_num_layers == 1
    assert_close(mtp_logits(model, ids, positions)[:, :-1], reference, rtol=0, atol=1e-4)

    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), "--tensor-model-parallel-size", "2")
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    original, exported = hf_tensors(src), hf_tensors(out)
    assert set(original) == set(exported) and any(".layers.3." in name for name in exported)
    for name in original:
        assert torch.equal(original[name], exported[name]), name
    assert read_config(out) == read_config(src)

    engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB), InferenceConfig(
        buffer_size_gb=0.01, block_size=4, max_seq_length=64, num_speculative_tokens=1))
    assert isinstance(engine.draft, MTPProposer)
    prompts, greedy = [[5, 17, 3, 59, 42, 7], [8, 2]], SamplingParams(temperature=0, num_tokens_to_generate=8,
                                                                       ignore_eod=True)
    main.generation_config.eos_token_id, main.generation_config.pad_token_id = None, 0
    expected = [main.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, len(p):].tolist()
                for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == expected
    assert engine.num_draft_tokens_proposed > 0


def test_deepseek_mtp_refusals(tmp_path):
    """A config naming MTP layers the files lack imports without them (a one-line warning); files
    with MTP layers the config does not name, or an MTP copy of the embedding that is not a copy,
    are refused."""
    src = tmp_path / "hf"
    reference = make_model("deepseek_v3", src)
    config = read_config(src)
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.warns(UserWarning, match=r"num_nextn_predict_layers=1 but the files hold no multi-token-prediction "
                                         r"layer \(model.layers.3.\*\); imported without") as record:
        model, _ = from_hf(str(src))
    assert len(record) == 1 and "\n" not in str(record[0].message)
    with torch.no_grad():
        assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    add_mtp_layer(src)
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"the files hold layers \[3\] past num_hidden_layers=3, but "
                                         r"num_nextn_predict_layers=0"):
        from_hf(str(src))
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    copy = load_file(str(src / "mtp.safetensors"))
    copy["model.layers.3.embed_tokens.weight"] = copy["model.layers.3.embed_tokens.weight"] + 1
    save_file(copy, str(src / "mtp.safetensors"))
    with pytest.raises(ValueError, match="model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight"):
        from_hf(str(src))


def _config(family, tmp_path):
    src = tmp_path / family
    make_model(family, src)
    return read_config(src)


def test_gpt_oss_refusals(tmp_path):
    hf = _config("gpt_oss", tmp_path)
    for change, message in [
        (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5; teratron's quick GELU gate is x \\* sigmoid\\(1.702 x\\)"),
        (dict(attention_bias=False), "attention_bias=false while gpt-oss's router and experts keep their biases"),
        (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types must give 3"),
        (dict(quantization_config={"quant_method": "mxfp4"}), "the weights are mxfp4 \\(quantization_config\\)"),
        (dict(rope_parameters={**YARN, "attention_factor": 2.0}), "YaRN with attention_factor=2.0 does not convert"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope type 'linear'"),
    ]:
        with pytest.raises(ValueError, match=f"^cfg: {message}"):
            model_args_from_hf({**hf, **change}, "cfg")
    args = model_args_from_hf(hf, "cfg")
    for change, message in [
        (dict(glu_linear_offset=0.0), "the checkpoint's model has glu_linear_offset=0.0; gpt-oss needs 1.0"),
        (dict(moe_layer_freq=[0, 1, 1]), "the checkpoint's model has dense layers"),
        (dict(activation_func_clamp_value=None), "the checkpoint's model has activation_func_clamp_value=None"),
        (dict(mscale=2.0), "the checkpoint's YaRN has mscale=2.0 with mscale_all_dim=0.0; transformers uses mscale"),
    ]:
        with pytest.raises(ValueError, match=f"^{message}"):
            hf_config_from_model_args({**args, **change})


def test_deepseek_refusals(tmp_path):
    hf = _config("deepseek_v3", tmp_path)
    for change, message in [
        (dict(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=4"),
        (dict(topk_group=1), "n_group=4, topk_group=1 with 8 experts and top-4"),
        (dict(moe_layer_freq=2), "moe_layer_freq=2; transformers' deepseek_v3 ignores it"),
        (dict(attention_bias=True), "attention_bias=true"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (dict(rope_parameters={**YARN, "truncate": False}), "YaRN with truncate=false"),
        (dict(rope_parameters={**YARN, "mscale_all_dim": 1.0}), "YaRN mscale_all_dim=1.0 without mscale"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ]:
        with pytest.raises(ValueError, match=f"^cfg: {message}"):
            model_args_from_hf({**hf, **change}, "cfg")
    with pytest.warns(UserWarning, match="rms_norm_eps=1e-05: transformers normalises the MLA latents with eps 1e-06"):
        model_args_from_hf({**hf, "rms_norm_eps": 1e-5}, "cfg")
    args = model_args_from_hf(hf, "cfg")
    for change, message in [
        (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
         "the checkpoint's MLA model has moe_router_score_function='softmax'; DeepSeek-V3 needs 'sigmoid'"),
        (dict(moe_layer_freq=[1, 0, 1]), "the checkpoint's MoE layout \\(moe_layer_freq=\\[1, 0, 1\\]"),
        (dict(moe_shared_expert_intermediate_size=24), "the checkpoint's MoE layout"),
        (dict(qk_layernorm=False), "the checkpoint's MLA model has qk_layernorm=False"),
    ]:
        with pytest.raises(ValueError, match=f"^{message}"):
            hf_config_from_model_args({**args, **change})
    # Group-limited routing has no Mixtral / Qwen3-MoE counterpart.
    qwen = {**args, "multi_latent_attention": False, "moe_router_score_function": "softmax",
            "moe_router_enable_expert_bias": False, "moe_shared_expert_intermediate_size": None,
            "moe_router_topk_scaling_factor": None}
    with pytest.raises(ValueError, match="moe_router_num_groups=4; Mixtral and Qwen3-MoE need None"):
        hf_config_from_model_args(qwen)


# The training flags of the tiny models above: the run's model must be the imported one.
TRAINING_SHAPES = {
    "gpt_oss": (
        "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "8", "--ffn-hidden-size", "24", "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-5", "--untie-embeddings-and-output-weights", "--max-position-embeddings", "64",
        "--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7",
        "--softmax-type", "learnable",
        "--window-size", "3,0", "--window-attn-skip-freq", "[1,0,1]", "--position-embedding-type", "yarn",
        "--rotary-base", "1000", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "16",
        "--no-yarn-correction-range-round-to-int", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "24", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"),
    "deepseek_v3": (
        "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "48",
        "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--untie-embeddings-and-output-weights",
        "--max-position-embeddings", "64", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--rope-type", "yarn",
        "--rotary-base", "1000", "--rotary-scaling-factor", "4", "--mscale", "1", "--mscale-all-dim", "0.8",
        "--yarn-original-max-position-embeddings", "16", "--num-experts", "8", "--moe-ffn-hidden-size", "16",
        "--moe-router-topk", "4", "--moe-layer-freq", "[0,1,1]", "--moe-shared-expert-intermediate-size", "32",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
        "--moe-router-load-balancing-type", "none", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"),
}


@pytest.mark.parametrize("family", sorted(TRAINING_SHAPES))
def test_finetune_an_imported_model_and_export_it(family, tmp_path):
    """import-hf -> `teratron train --load --finetune` with Megatron's flags for the model (the run
    refuses another model) -> export-hf: transformers loads the trained weights (DeepSeek's expert
    bias moved by its update rule, its MTP layer trained too) and agrees with teratron's logits."""
    src, ckpt, trained, out = (tmp_path / n for n in ("hf", "ckpt", "trained", "out"))
    make_model(family, src)
    if family == "deepseek_v3":
        add_mtp_layer(src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    finetune(ckpt, trained, shape=TRAINING_SHAPES[family])
    convert("export-hf", "--load", str(trained), "--out", str(out))
    changed = ["model.layers.2.mlp.experts.down_proj" if family == "gpt_oss" else
               "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"]
    if family == "deepseek_v3":
        changed += ["model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.3.eh_proj.weight"]
    for name in changed:
        assert not torch.equal(hf_tensors(out)[name], hf_tensors(src)[name]), name
    if family == "gpt_oss":
        assert read_config(out)["router_aux_loss_coef"] == 0.01
    model, _ = from_hf(str(out))
    with torch.no_grad():
        ours = model(*ids_and_positions())
    assert_close(hf_logits(str(out)), ours, rtol=0, atol=1e-4)
