"""Hugging Face conversion of Qwen3-Next: a tiny random Qwen3NextForCausalLM (Gated DeltaNet and
gated-attention layers, MoE with a gated shared expert and one dense MLP layer; every weight
random; and one without experts) built offline with transformers. Imported logits equal
transformers' (fp32) with either expert class; import-hf -> export-hf gives back the same tensors
and config, and transformers loads the export with the same logits; a TP 2 load of the import
gives them too; the inference engine decodes transformers' greedy tokens; configs teratron
cannot convert are refused with one line."""

import pytest
import torch
import transformers
from torch.testing import assert_close

from convert.hf_testing import (VOCAB, convert, hf_logits, hf_tensors, ids_and_positions, read_config,
                                save_random_hf_model)
from dist import run_distributed
from teratron import parallel_state as ps
from teratron.convert.hf import from_hf
from teratron.convert.hf_config import hf_config_from_model_args, model_args_from_hf
from teratron.dist_checkpointing import load_checkpoint, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.tokenizers.null_tokenizer import NullTokenizer

# 4 layers: DeltaNet, DeltaNet, attention, DeltaNet; layer 1 a dense MLP, the others MoE.
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
              shared_expert_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
PATTERN = "GEG-*EGE"


def make_qwen3_next(path, **changes):
    """A random tiny Qwen3-Next saved to `path`; its logits. The DeltaNets' output-norm weights are
    drawn from [0.5, 1.5), where their w - 1 storage round-trips exactly (hf_qwen3_next)."""
    logits = save_random_hf_model("Qwen3NextConfig", "Qwen3NextForCausalLM", {**CONFIG, **changes}, path,
                                  max_shard_size="30KB")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("linear_attn.norm.weight"):
                t.copy_(0.5 + torch.rand(t.shape, generator=generator))
        model.save_pretrained(path, max_shard_size="30KB")
        logits = model(ids_and_positions()[0]).logits
    return logits


def test_import_export_round_trip(tmp_path):
    src = tmp_path / "hf"
    reference = make_qwen3_next(src)
    for grouped in (False, True):
        model, config = from_hf(str(src), moe_grouped_gemm=grouped)
        with torch.no_grad():
            assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    # Each Gated DeltaNet over 150 tokens (several of the delta rule's 64-token chunks) equals
    # transformers' layer (|output| up to ~20). Whole random models over so long a sequence drift
    # apart by ~1e-4 through amplified fp32 rounding (each drifts more from its own float64 run).
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    x = torch.randn(2, 150, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        for i in (0, 1, 3):
            ours, _ = model.decoder.layers[2 * i].self_attention(x.transpose(0, 1).contiguous())
            assert_close(ours.transpose(0, 1), hf_model.model.layers[i].linear_attn(x), rtol=0, atol=1e-4)
    assert (config.hybrid_layer_pattern, config.num_layers) == (PATTERN, 8)
    assert config.layernorm_zero_centered_gamma and config.attention_output_gate and config.qk_layernorm
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim) == (2, 4, 12)
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (40, True)
    assert config.moe_router_pre_softmax is False
    assert model.rotary_pos_emb.inv_freq.numel() == 2  # rotary_percent 0.25 of head_dim 16: 4 rotated channels
    hf_norm = hf_tensors(src)["model.layers.0.linear_attn.norm.weight"]
    assert torch.equal(model.decoder.layers[0].self_attention.out_norm.weight, hf_norm - 1)

    original = hf_tensors(src)
    assert not any(name.startswith("mtp.") for name in original)
    for grouped in (False, True):
        ckpt, out = tmp_path / f"ckpt{grouped}", tmp_path / f"out{grouped}"
        convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), *(["--moe-grouped-gemm"] if grouped else []))
        convert("export-hf", "--load", str(ckpt), "--out", str(out))
        exported = hf_tensors(out)
        assert set(original) == set(exported)
        for name in original:
            assert torch.equal(original[name], exported[name]), name
        assert read_config(out) == read_config(src)  # the config comes back as it was
        assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


def _tensor_parallel_logits(ckpt):
    """The import loaded at TP 2 (its Gated DeltaNet key heads, gated attention groups and experts
    split over the ranks): the logits."""
    checkpoint_dir = storage.resolve_checkpoint_dir(ckpt)
    model_args = storage.read_metadata(checkpoint_dir)["model_args"]
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build_gpt_model(gpt_config_from_model_args(model_args, padded_vocab_size=256,
                                                       tensor_model_parallel_size=2))
    model.parallel_output = False
    load_checkpoint(checkpoint_dir, [model], load_optimizer=False)
    with torch.no_grad():
        logits = model(*ids_and_positions())[..., :VOCAB]
    ps.destroy_model_parallel()
    return logits


def test_tensor_parallel_load_of_the_import(tmp_path):
    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    reference = make_qwen3_next(src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), "--tensor-model-parallel-size", "2")
    for logits in run_distributed(_tensor_parallel_logits, 2, str(ckpt)):
        assert_close(logits, reference, rtol=0, atol=1e-4)


def test_engine_greedy_output_equals_transformers_generate(tmp_path):
    """The imported model served by the inference engine (paged KV cache for the gated attention,
    a recurrent state per request for the DeltaNets, two requests batched) decodes transformers'
    greedy tokens."""
    src = tmp_path / "hf"
    make_qwen3_next(src)
    model, _ = from_hf(str(src))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id, hf_model.generation_config.pad_token_id = None, 0
    prompts = [[5, 17, 3, 59, 42, 7], [8, 2]]
    with torch.no_grad():
        expected = [hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, len(p):].tolist()
                    for p in prompts]
    engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB), InferenceConfig(buffer_size_gb=0.01, block_size=4,
                                                                                 max_seq_length=64))
    greedy = SamplingParams(temperature=0, num_tokens_to_generate=8, ignore_eod=True)
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == expected


def test_derived_layer_types_tied_embeddings_and_refusals(tmp_path):
    """Without layer_types every full_attention_interval-th layer is attention (transformers' rule);
    unconvertible configs and models are refused with one line."""
    src = tmp_path / "hf"
    make_qwen3_next(src, layer_types=None, full_attention_interval=2, mlp_only_layers=[], norm_topk_prob=False,
                    tie_word_embeddings=True)
    hf = read_config(src)
    args = model_args_from_hf(hf, "cfg")
    assert (args["hybrid_layer_pattern"], args["moe_router_pre_softmax"]) == ("GE*EGE*E", True)
    assert not args["untie_embeddings_and_output_weights"]
    exported = hf_config_from_model_args(args, None)
    assert (exported["layer_types"], exported["tie_word_embeddings"]) == (hf["layer_types"], True)

    dense = tmp_path / "dense"  # no experts: every MLP dense
    reference = make_qwen3_next(dense, num_experts=0)
    model, config = from_hf(str(dense))
    assert (config.hybrid_layer_pattern, config.num_moe_experts) == ("G-G-*-G-", None)
    with torch.no_grad():
        assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    assert hf_config_from_model_args(model_args_from_hf(read_config(dense), "cfg"), None)["num_experts"] == 0

    for change, message in [(dict(attention_bias=True), "^cfg: attention_bias=true; teratron's Qwen3-Next has no"),
                            (dict(layer_types=["linear_attention"]), "^cfg: layer_types must give one of"),
                            (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "^cfg: rope type 'yarn'")]:
        with pytest.raises(ValueError, match=message) as error:
            model_args_from_hf({**hf, **change}, "cfg")
        assert "\n" not in str(error.value)
    for change, message in [
        (dict(hybrid_layer_pattern="GEG"), "^the checkpoint's hybrid pattern 'GEG' is not Qwen3-Next's"),
        (dict(hybrid_layer_pattern="GE*E/GE", mtp_num_layers=1),
         "^the checkpoint's hybrid pattern 'GE\*E/GE' has multi-token-prediction depths \('/'\); the nemotron_h"),
        (dict(hybrid_layer_pattern="MEGE"), "^the checkpoint's hybrid pattern 'MEGE' has both Mamba-2 \\(M\\) and "
                                            "Gated DeltaNet \\(G\\) layers; no Hugging Face family holds both"),
        (dict(layernorm_zero_centered_gamma=False),
         "^the checkpoint's hybrid model has layernorm_zero_centered_gamma=False; Qwen3-Next needs True"),
        (dict(attention_output_gate=False), "^the checkpoint's hybrid model has attention_output_gate=False"),
        (dict(moe_shared_expert_intermediate_size=None),
         "^the checkpoint's hybrid model has MoE layers without shared"),
    ]:
        with pytest.raises(ValueError, match=message) as error:
            hf_config_from_model_args({**args, **change})
        assert "\n" not in str(error.value)
