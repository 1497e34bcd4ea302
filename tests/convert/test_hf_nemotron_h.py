"""Hugging Face conversion of NVIDIA's Nemotron-H (transformers' nemotron_h): tiny random hybrid
models built offline with transformers (every weight random, the expert bias included), pattern
M * - E M * (Mamba-2, attention without position embedding, relu^2 MLP, MoE with group-limited
sigmoid routing, expert bias, scaling and a shared expert). Imported logits equal transformers'
(fp32) with either expert class, also loaded straight into TP 2 + SP and EP 2 models;
import-hf -> export-hf gives back the same tensors and config.json, and transformers loads the
export with the same logits; an import fine-tuned by `teratron train` with Megatron's flags
exports too. transformers' lower clamp of dt at time_step_min, which teratron's mixer does not
have, is shown to be the only difference where it bites; a tied teratron model exports with
lm_head a copy of its embedding; unsupported configs and models are refused with one line."""

import pytest
import torch
import transformers
from torch.testing import assert_close

from convert.hf_testing import (TOKENIZER_FILES, VOCAB, convert, finetune, hf_logits, hf_tensors,
                                ids_and_positions, read_config, save_random_hf_model)
from dist import run_distributed
from teratron import parallel_state as ps
from teratron.convert.hf import from_hf, load_hf_weights
from teratron.convert.hf_config import hf_config_from_model_args, model_args_from_hf
from teratron.dist_checkpointing import save_checkpoint, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.models.gpt.builder import build_gpt_model, build_model_chunks
from teratron.transformer.mlp import squared_relu

LAYERS = ["linear_attention", "full_attention", "mlp", "moe", "linear_attention", "full_attention"]
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, layers_block_type=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=64,
              ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, chunk_size=8,
              n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
              moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, layer_norm_epsilon=1e-5)


def make_model(path, **changes):
    return save_random_hf_model("NemotronHConfig", "NemotronHForCausalLM", {**CONFIG, **changes}, path,
                                max_shard_size="30KB")


def test_import_export_round_trip(tmp_path):
    src = tmp_path / "hf"
    reference = make_model(src)
    for grouped in (False, True):
        model, config = from_hf(str(src), moe_grouped_gemm=grouped)
        with torch.no_grad():
            assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-5)
    assert (config.hybrid_layer_pattern, config.activation_func, config.gated_linear_unit) == (
        "M*-EM*", squared_relu, False)
    assert (config.mamba_state_dim, config.mamba_head_dim, config.mamba_num_groups, config.mamba_num_heads) == (
        8, 8, 2, 8)
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias, config.moe_router_num_groups,
            config.moe_router_group_topk, config.moe_router_topk_scaling_factor) == ("sigmoid", True, 4, 2, 2.5)
    assert model.position_embedding_type == "none" and config.moe_shared_expert_intermediate_size == 24

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), "--tensor-model-parallel-size", "2",
            "--expert-model-parallel-size", "2")
    args = storage.read_metadata(storage.resolve_checkpoint_dir(str(ckpt)))["model_args"]
    assert (args["hybrid_layer_pattern"], args["squared_relu"], args["padded_vocab_size"]) == ("M*-EM*", True, 256)
    convert("export-hf", "--load", str(ckpt), "--out", str(out), "--max-shard-size", "40KB")
    original, exported = hf_tensors(src), hf_tensors(out)
    assert set(original) == set(exported)
    for name in original:
        assert torch.equal(original[name], exported[name]), name
    assert read_config(out) == read_config(src)
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-5)


def _load_in_layouts(src):
    """On 2 ranks, the folder loaded straight into a TP 2 model (Mamba's heads and groups, the
    attention heads and the experts split; sequence parallel) and an EP 2 model, every value from
    the files; their logits."""
    model_args = model_args_from_hf(read_config(src), "cfg", 128, 2)
    logits = []
    for tp, ep in ((2, 1), (1, 2)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=tp)
        chunks = build_model_chunks(gpt_config_from_model_args(
            model_args, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
            sequence_parallel=tp > 1, moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather"))
        with torch.no_grad():
            for tensor in chunks[0].state_dict().values():  # garbage: every value must come from the files
                tensor.fill_(7.0)
        load_hf_weights(src, chunks)
        chunks[0].parallel_output = False
        with torch.no_grad():
            logits.append(chunks[0](*ids_and_positions())[..., :VOCAB])
        ps.destroy_model_parallel()
    return logits


def test_load_straight_into_parallel_layouts(tmp_path):
    src = tmp_path / "hf"
    reference = make_model(src)
    for rank_logits in (t for per_rank in run_distributed(_load_in_layouts, 2, str(src)) for t in per_rank):
        assert_close(rank_logits, reference, rtol=0, atol=1e-5)


# Megatron's flags for CONFIG's model.
TRAINING_SHAPE = (
    "--hybrid-layer-pattern", "M*-EM*", "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8", "--ffn-hidden-size", "48",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--untie-embeddings-and-output-weights",
    "--max-position-embeddings", "64", "--squared-relu", "--disable-bias-linear", "--position-embedding-type", "none",
    "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--mamba-num-heads", "8",
    "--num-experts", "8", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "4",
    "--moe-shared-expert-intermediate-size", "24", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4",
    "--moe-router-group-topk", "2", "--moe-router-load-balancing-type", "none")


def test_finetune_an_imported_model_and_export_it(tmp_path):
    """import-hf -> `teratron train --load --finetune` with Megatron's flags for the model ->
    export-hf: transformers loads the trained weights (the expert bias moved by its update rule)
    and agrees with teratron's logits."""
    src, ckpt, trained, out = (tmp_path / n for n in ("hf", "ckpt", "trained", "out"))
    make_model(src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    finetune(ckpt, trained, shape=TRAINING_SHAPE)
    convert("export-hf", "--load", str(trained), "--out", str(out))
    for name in ("backbone.layers.0.mixer.A_log", "backbone.layers.1.mixer.o_proj.weight",
                 "backbone.layers.2.mixer.up_proj.weight", "backbone.layers.3.mixer.experts.3.down_proj.weight",
                 "backbone.layers.3.mixer.gate.e_score_correction_bias"):
        assert not torch.equal(hf_tensors(out)[name], hf_tensors(src)[name]), name
    model, _ = from_hf(str(out))
    with torch.no_grad():
        ours = model(*ids_and_positions())
    assert_close(hf_logits(str(out)), ours, rtol=0, atol=1e-5)


def _without_dt_clamp(model):
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            layer.mixer.time_step_limit = (0.0, float("inf"))


def test_transformers_dt_clamp_is_the_one_difference(tmp_path):
    """With dt_bias so low that softplus(dt + dt_bias) < time_step_min: transformers before 5.25
    clamps dt up to time_step_min whatever the config says, and teratron's mixer (Megatron's) does
    not: the logits then differ, and equal transformers' with its clamp lifted. From 5.25
    transformers clamps at the config's time_step_limit, (0, inf) here: no clamp, the same logits."""
    src = tmp_path / "hf"
    make_model(src, layers_block_type=["linear_attention", "full_attention", "mlp"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.layers[0].mixer.dt_bias.fill_(-12.0)  # softplus: 6e-6, below time_step_min 1e-3
        hf.model.layers[0].mixer.D.zero_()  # leaves the scan's output alone in y
    hf.save_pretrained(tmp_path / "low_dt")
    model, _ = from_hf(str(tmp_path / "low_dt"))
    ids = ids_and_positions()[0]
    clamps = hf.model.layers[0].mixer.time_step_limit[0] > 0  # transformers < 5.25
    with torch.no_grad():
        as_installed = hf(ids).logits
        _without_dt_clamp(hf)
        unclamped = hf(ids).logits
        ours = model(*ids_and_positions())
    if clamps:
        assert (as_installed - unclamped).abs().max() > 1e-3
    else:
        assert torch.equal(as_installed, unclamped)
    assert_close(ours, unclamped, rtol=0, atol=1e-5)


def test_a_tied_model_exports_lm_head_as_a_copy(tmp_path):
    """transformers' nemotron_h never ties lm_head: a tied teratron model writes its embedding twice
    and says tie_word_embeddings false; transformers then gives teratron's logits."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_model(src, layers_block_type=["linear_attention", "full_attention", "mlp"])
    model_args = {**model_args_from_hf(read_config(src), "cfg"), "untie_embeddings_and_output_weights": False}
    torch.manual_seed(0)
    model = build_gpt_model(gpt_config_from_model_args(model_args)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        logits = model(*ids_and_positions())
    save_checkpoint(str(ckpt), 1, [model], metadata={"model_args": model_args})
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    tensors = hf_tensors(out)
    assert torch.equal(tensors["lm_head.weight"], tensors["backbone.embeddings.weight"])
    assert read_config(out)["tie_word_embeddings"] is False
    assert_close(hf_logits(str(out)), logits, rtol=0, atol=1e-5)


def _config(tmp_path):
    make_model(tmp_path / "hf")
    return read_config(tmp_path / "hf")


def test_refusals(tmp_path):
    hf = _config(tmp_path)
    for change, message in [
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act='silu'; teratron converts nemotron_h's squared-ReLU MLPs only, "
                                      "so only mlp_hidden_act='relu2' converts"),
        (dict(conv_kernel=3), "conv_kernel=3; teratron's Mamba convolution has 4 taps"),
        (dict(moe_latent_size=16), "moe_latent_size=16; teratron's MoE has no latent projections"),
        (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers=1; nemotron_h's multi-token-prediction"),
        (dict(use_bias=True), "use_bias=True; teratron puts biases on all linear layers or none"),
        (dict(time_step_limit=[0.001, 0.1]), "time_step_limit=\\[0.001, 0.1\\]; teratron's Mamba mixer \\(Megatron's\\) "
                                             "does not clamp dt"),
        (dict(time_step_limit=None), "time_step_limit=None; teratron's Mamba mixer"),
        (dict(layers_block_type=["linear_attention", "sliding_attention"]),
         "layers_block_type has 'sliding_attention'; nemotron_h's layers are linear_attention, full_attention"),
        (dict(layers_block_type=None, hybrid_override_pattern="MG"),
         "hybrid_override_pattern has 'G'; nemotron_h's layers are linear_attention, full_attention, mlp, moe "
         "\\(M\\*-E in hybrid_override_pattern\\)$"),
        (dict(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=4"),
        (dict(n_group=2, topk_group=1), "n_group=2, topk_group=1 with 8 experts and top-4"),
    ]:
        with pytest.raises(ValueError, match=f"^cfg: {message}") as raised:
            model_args_from_hf({**hf, **change}, "cfg")
        assert "\n" not in str(raised.value)
    for no_clamp in ([0.0, float("inf")], [0, {"__float__": "Infinity"}]):  # JSON's Infinity; transformers' own
        model_args_from_hf({**hf, "time_step_limit": no_clamp}, "cfg")
    # older configs' names, read in place of the current ones as transformers reads them
    legacy = {k: v for k, v in hf.items() if k != "n_groups"}
    assert model_args_from_hf({**legacy, "mamba_n_groups": hf["n_groups"]}, "cfg") == model_args_from_hf(hf, "cfg")
    for change, message in [(dict(mamba_d_conv=3), "conv_kernel=3; "), (dict(mamba_dt_limit=[0.0, 0.1]),
                                                                          "time_step_limit=\\[0.0, 0.1\\]; ")]:
        with pytest.raises(ValueError, match=f"^cfg: {message}"):
            model_args_from_hf({**hf, **change}, "cfg")
    old = {k: v for k, v in hf.items() if k != "layers_block_type"}
    assert model_args_from_hf({**old, "hybrid_override_pattern": "M*-EM*"}, "cfg")["hybrid_layer_pattern"] == "M*-EM*"
    with pytest.raises(ValueError, match="^cfg: config.json lacks layers_block_type"):
        model_args_from_hf(old, "cfg")
    bare = model_args_from_hf({k: v for k, v in hf.items() if k not in ("head_dim", "num_key_value_heads")}, "cfg")
    defaults = transformers.NemotronHConfig()  # what transformers reads where config.json is silent
    assert (bare["kv_channels"], bare["num_query_groups"]) == (defaults.head_dim, defaults.num_key_value_heads)

    args = model_args_from_hf(hf, "cfg")
    for change, message in [
        (dict(hybrid_layer_pattern="MG*-"),
         "the checkpoint's hybrid pattern 'MG\\*-' has both Mamba-2 \\(M\\) and Gated DeltaNet \\(G\\) layers"),
        (dict(hybrid_layer_pattern=args["hybrid_layer_pattern"].replace("*", "+")),
         "the checkpoint's hybrid model has multi-latent attention layers \\(\\+ in"),
        (dict(squared_relu=False, swiglu=True), "the checkpoint's hybrid model has squared_relu=False; nemotron_h "
                                                "needs True"),
        (dict(position_embedding_type="rope"), "the checkpoint's hybrid model has position_embedding_type='rope'"),
        (dict(moe_shared_expert_intermediate_size=None), "the checkpoint's MoE layers have shared experts of None"),
        (dict(moe_router_score_function="softmax"), "the checkpoint's hybrid model has "
                                                    "moe_router_score_function='softmax'"),
    ]:
        with pytest.raises(ValueError, match=f"^{message}") as raised:
            hf_config_from_model_args({**args, **change})
        assert "\n" not in str(raised.value)
    assert hf_config_from_model_args(args, hf) == hf  # the imported model writes its config back


def test_the_cli_refuses_with_one_line(tmp_path, capsys):
    from teratron import cli

    src = tmp_path / "hf"
    make_model(src, layers_block_type=["linear_attention", "full_attention"], conv_kernel=2)
    assert cli.main(["convert", "import-hf", "--hf-path", str(src), "--save", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"teratron: error: --hf-path {src}: conv_kernel=2; teratron's Mamba convolution has 4 taps, so only "
        "conv_kernel=4 converts")


GDP_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "gdp_stack_spec"]
NO_GDP_FAMILY = ("Gated Delta Product M layers (gdp_layers: Megatron's --spec ... gdp_stack_spec), which no Hugging "
                 "Face family holds (nemotron_h's M layers are Mamba-2, qwen3_next's are Gated DeltaNet)")


def test_gated_delta_product_models_are_refused_both_ways(tmp_path, capsys):
    """Hugging Face has no Gated Delta Product model: exporting a checkpoint whose M layers are GDP mixers
    (as either hybrid family), filling a GDP model from an HF folder, and fine-tuning an import as a GDP
    model are each refused with one line naming the problem and the way out; nothing is written."""
    from teratron import cli

    src, gdp, imported = tmp_path / "hf", tmp_path / "gdp", tmp_path / "imported"
    make_model(src)
    gdp_args = {**model_args_from_hf(read_config(src), "cfg"), "spec": GDP_SPEC}
    export_refusal = (f"the checkpoint's hybrid model has {NO_GDP_FAMILY}; it does not export: keep it as a teratron "
                      "checkpoint, or save it with --ckpt-format torch_dist for Megatron-LM")
    for base in (None, {"model_type": "qwen3_next"}):
        with pytest.raises(ValueError) as raised:
            hf_config_from_model_args(gdp_args, base)
        assert str(raised.value) == export_refusal
    model = build_gpt_model(gpt_config_from_model_args(gdp_args))
    assert type(model.decoder.layers[0].mixer).__name__ == "GatedDeltaProductMixer"
    save_checkpoint(str(gdp), 1, [model], metadata={"model_args": gdp_args})
    capsys.readouterr()
    assert cli.main(["convert", "export-hf", "--load", str(gdp), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"teratron: error: {export_refusal}"]
    assert not (tmp_path / "out").exists()

    with pytest.raises(ValueError) as raised:
        load_hf_weights(str(src), [model])
    assert str(raised.value) == (f"--hf-path {src}: the model to fill has {NO_GDP_FAMILY}; build it from the "
                                 "folder's config.json (model_args_from_hf), without gdp_layers")

    convert("import-hf", "--hf-path", str(src), "--save", str(imported))
    capsys.readouterr()
    train = ["train", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *TRAINING_SHAPE,
             "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-2", "--eval-iters", "0",
             "--num-workers", "0", "--no-progress-bar", "--load", str(imported), "--finetune",
             "--save", str(tmp_path / "trained"), "--spec", *GDP_SPEC]
    assert cli.main(train) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"teratron: error: --load {storage.iteration_dir(str(imported), 0)}: the checkpoint holds another model: "
        f"--spec (saved unset, now {GDP_SPEC}); pass the architecture flags it was saved with, or "
        "--use-checkpoint-args to take them from it")
    assert storage.read_tracker(str(tmp_path / "trained")) is None
