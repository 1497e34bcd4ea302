"""Hybrid models in Megatron-LM's layout (`--ckpt-format torch_dist`): the names and part tensors
Megatron Core's HybridModel saves, and a save under one layout that resumes under another.

Megatron's names, read in its source (NVIDIA/Megatron-LM, megatron/core): the hybrid stack's layers
are Transformer Engine's (models/hybrid/hybrid_layer_specs.py: a Mamba layer's and a Gated DeltaNet
layer's norm fused into their in_proj, `TELayerNormColumnParallelLinear`, so saved as
`in_proj.layer_norm_weight`), each saved under its own layer number (hybrid_block.py), the final norm
`final_norm`; MambaMixer.sharded_state_dict (ssm/mamba_mixer.py) stores in_proj.weight as the parts
z, x, B, C, dt and conv1d's weight and bias as x, B, C, each a tensor `<name>.<part>`
(ssm/utils.py `_split_tensor_factory`); Gated DeltaNet (ssm/gated_delta_net/common.py, gdn.py) its
in_proj.weight as query, key, value, z, beta, alpha and conv1d.weight as query, key, value; a hybrid
MTP depth keeps its layers in `mtp_model_layer`, a hybrid stack (transformer/multi_token_prediction.py).
Gated Delta Product layers (`--spec megatron.core.models.hybrid.hybrid_layer_specs gdp_stack_spec`: a
MambaLayer whose mixer is GatedDeltaProductMixer, ssm/gated_delta_product.py, its in_proj a
TELayerNormColumnParallelLinear too) store in_proj.weight as z, V0 .. V{M-1}, K0 .. K{M-1}, Q,
b0 .. b{M-1}, a and conv1d.weight (no bias) as V0 .. V{M-1}, K0 .. K{M-1}, Q, M the Householder
substeps (`_get_in_proj_checkpoint_split_layout`, `_get_conv_checkpoint_split_layout`), with dt_bias,
A_log and norm.weight but no D; Megatron's args carry `spec` and `gdp_num_householder`.
No Megatron-written hybrid checkpoint is among the fixtures (Megatron's hybrid layers need Transformer
Engine, mamba_ssm and causal_conv1d).
"""

import torch

from test_hybrid_training import TINY
from train_runs import assert_same_losses, train, training_records

PATTERN = "MG*-E/MG"  # every layer kind, and an MTP depth of a Mamba and a Gated DeltaNet layer
MODEL = TINY + ["--hybrid-layer-pattern", PATTERN]
H = 32  # TINY's sizes: hidden 32; Mamba: 8 heads (2 x 32 / 8) of 8, 2 groups of state 8; Gated DeltaNet:
MAMBA = dict(z=64, x=64, B=16, C=16, dt=8)  # 2 key heads, 4 value heads, of 8
GDN = dict(query=16, key=16, value=32, z=32, beta=4, alpha=4)


def _mamba_keys(layer: str) -> dict:
    keys = {f"{layer}.mixer.in_proj.layer_norm_weight": (H,), f"{layer}.mixer.dt_bias": (8,),
            f"{layer}.mixer.A_log": (8,), f"{layer}.mixer.D": (8,), f"{layer}.mixer.norm.weight": (64,),
            f"{layer}.mixer.out_proj.weight": (H, 64)}
    keys.update({f"{layer}.mixer.in_proj.weight.{part}": (rows, H) for part, rows in MAMBA.items()})
    for part in ("x", "B", "C"):
        keys[f"{layer}.mixer.conv1d.weight.{part}"] = (MAMBA[part], 1, 4)
        keys[f"{layer}.mixer.conv1d.bias.{part}"] = (MAMBA[part],)
    return keys


def _gdn_keys(layer: str) -> dict:
    keys = {f"{layer}.self_attention.in_proj.layer_norm_weight": (H,), f"{layer}.self_attention.dt_bias": (4,),
            f"{layer}.self_attention.A_log": (4,), f"{layer}.self_attention.out_norm.weight": (8,),
            f"{layer}.self_attention.out_proj.weight": (H, 32)}
    keys.update({f"{layer}.self_attention.in_proj.weight.{part}": (rows, H) for part, rows in GDN.items()})
    keys.update({f"{layer}.self_attention.conv1d.weight.{part}": (GDN[part], 1, 4) for part in ("query", "key", "value")})
    return keys


def test_teratron_writes_the_names_and_parts_megatrons_hybrid_model_saves(tmp_path):
    from teratron.dist_checkpointing import serialization
    from teratron.dist_checkpointing.megatron_format import is_megatron_checkpoint

    train(MODEL + ["--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--exit-interval", "1",
                   "--ckpt-format", "torch_dist"], tmp_path, "saved")
    folder = str(tmp_path / "ckpt" / "iter_0000001")
    assert is_megatron_checkpoint(folder)
    saved = {key: shape for key, shape in serialization.saved_keys(folder).items() if not key.startswith("optimizer.")}
    expected = {**_mamba_keys("decoder.layers.0"), **_gdn_keys("decoder.layers.1"),
                **_mamba_keys("mtp.layers.0.mtp_model_layer.layers.0"),
                **_gdn_keys("mtp.layers.0.mtp_model_layer.layers.1"),
                "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight": (H,),
                "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": (H,), "decoder.final_norm.weight": (H,),
                "mtp.layers.0.final_layernorm.weight": (H,)}
    for key, shape in expected.items():
        assert saved.get(key) == shape, (key, saved.get(key), shape)
    # nothing under teratron's own names where Megatron's differ
    assert not [key for key in saved if key.endswith((".norm.weight", "input_layernorm.weight", "in_proj.weight",
                                                       "conv1d.weight", "conv1d.bias")) and "mixer.norm" not in key]
    assert "decoder.final_layernorm.weight" not in saved
    assert not [key for key in saved if ".transformer_layer." in key]
    split = {key: shape for key, shape in serialization.saved_keys(folder).items()
             if key.startswith("optimizer.state.exp_avg.decoder.layers.0.mixer.in_proj.weight")}
    assert split == {f"optimizer.state.exp_avg.decoder.layers.0.mixer.in_proj.weight.{part}": (rows, H)
                     for part, rows in MAMBA.items()}


def test_a_torch_dist_save_at_tp2_resumes_at_tp1_and_pp2_with_the_same_losses(tmp_path):
    """Saved by two tensor-parallel ranks with the distributed optimizer (each part of in_proj and
    conv1d a box per rank), read back by one process (each parameter gathered from its parts, its Adam
    moments and fp32 masters too) and by two pipeline stages (the MTP depth on the last): the losses of
    an uninterrupted single-process run."""
    reference = training_records(train(MODEL, tmp_path, "single")[0])
    train(MODEL + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
                   "--save", str(tmp_path / "tp2"), "--save-interval", "2", "--exit-interval", "2",
                   "--ckpt-format", "torch_dist"], tmp_path, "tp2", nproc=2)
    records, stdout = train(MODEL + ["--load", str(tmp_path / "tp2")], tmp_path, "tp1-from-tp2")
    assert "holds no optimizer state" not in stdout  # every parameter's state found under Megatron's names
    resumed = training_records(records)
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert_same_losses(reference, resumed, "tp1-from-tp2")
    staged = TINY + ["--hybrid-layer-pattern", PATTERN.replace("*-", "*|-"), "--pipeline-model-parallel-size", "2",
                     "--load", str(tmp_path / "tp2")]
    assert_same_losses(reference, training_records(train(staged, tmp_path, "pp2-from-tp2", nproc=2)[0]), "pp2-from-tp2")


GDP_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "gdp_stack_spec"]
GDP_MODEL = MODEL + ["--spec", *GDP_SPEC, "--gdp-num-householder", "2"]


def _gdp_keys(layer: str, householder: int = 2) -> dict:
    """Megatron's keys of a Gated Delta Product layer at TINY's sizes (Mamba's: 8 heads of 8, d_inner 64, 2
    groups of state 8), its parts named by Megatron's rule for `householder` substeps."""
    d_inner, keys_rows, heads = 64, 2 * 8, 8
    in_proj = {"z": d_inner, **{f"V{i}": d_inner for i in range(householder)},
               **{f"K{i}": keys_rows for i in range(householder)}, "Q": keys_rows,
               **{f"b{i}": heads for i in range(householder)}, "a": heads}
    conv1d = {part: rows for part, rows in in_proj.items() if part[0] in "VKQ"}
    keys = {f"{layer}.mixer.in_proj.layer_norm_weight": (H,), f"{layer}.mixer.dt_bias": (heads,),
            f"{layer}.mixer.A_log": (heads,), f"{layer}.mixer.norm.weight": (d_inner,),
            f"{layer}.mixer.out_proj.weight": (H, d_inner)}
    keys.update({f"{layer}.mixer.in_proj.weight.{part}": (rows, H) for part, rows in in_proj.items()})
    keys.update({f"{layer}.mixer.conv1d.weight.{part}": (rows, 1, 4) for part, rows in conv1d.items()})
    return keys


def test_gated_delta_product_layers_in_megatrons_layout_reshard_from_tp2_to_tp1(tmp_path):
    """A GDP hybrid (M layers Gated Delta Product mixers of 2 substeps, in the decoder and the MTP depth)
    saved in Megatron's layout by two tensor-parallel ranks: every GDP layer's tensors under exactly
    Megatron's keys and part names (and no Mamba part, D or conv1d bias), Megatron's args naming the
    stack; resumed by one process taking the architecture from those args (no --spec given), the
    losses of an uninterrupted single-process run."""
    from teratron.dist_checkpointing import serialization
    from teratron.dist_checkpointing.megatron_format import read_common_state

    reference = training_records(train(GDP_MODEL + ["--save", str(tmp_path / "own"), "--save-interval", "2"],
                                       tmp_path, "single")[0])
    train(GDP_MODEL + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
                       "--save", str(tmp_path / "tp2"), "--save-interval", "2", "--exit-interval", "2",
                       "--ckpt-format", "torch_dist"], tmp_path, "tp2", nproc=2)
    folder = str(tmp_path / "tp2" / "iter_0000002")
    saved = serialization.saved_keys(folder)
    layers = [("decoder.layers.0", _gdp_keys), ("mtp.layers.0.mtp_model_layer.layers.0", _gdp_keys),
              ("decoder.layers.1", _gdn_keys), ("mtp.layers.0.mtp_model_layer.layers.1", _gdn_keys)]
    for layer, keys in layers:
        expected = keys(layer)
        assert {key: saved[key] for key in saved if key.startswith(layer + ".")} == expected, layer
        moments = {key: saved[key] for key in saved if key.startswith(f"optimizer.state.exp_avg.{layer}.")}
        assert moments == {f"optimizer.state.exp_avg.{key}": shape for key, shape in expected.items()}, layer
    args = read_common_state(folder)["args"]
    assert (args.spec, args.gdp_num_householder, args.hybrid_layer_pattern) == (GDP_SPEC, 2, PATTERN)
    assert args.mamba_num_heads == 8  # resolved: Megatron's GDP mixer needs it given
    # the parts' values, in Megatron's order, are the rows of the single process's whole tensors (teratron's
    # own layout, saved at the same iteration): no part is written under another's name
    for name in ("in_proj.weight", "conv1d.weight"):
        whole = serialization.load_full(str(tmp_path / "own" / "iter_0000002"),
                                        lambda key: key == f"decoder.layers.0.mixer.{name}")
        parts = serialization.load_full(folder, lambda key: key.startswith(f"decoder.layers.0.mixer.{name}."))
        order = [key for key in _gdp_keys("decoder.layers.0") if key.startswith(f"decoder.layers.0.mixer.{name}.")]
        torch.testing.assert_close(torch.cat([parts[key] for key in order]),
                                   whole[f"decoder.layers.0.mixer.{name}"], rtol=1e-4, atol=1e-5)

    resumed, stdout = train(MODEL + ["--load", str(tmp_path / "tp2"), "--use-checkpoint-args"], tmp_path, "tp1")
    assert "holds no optimizer state" not in stdout
    resumed = training_records(resumed)
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert_same_losses(reference, resumed, "tp1-from-tp2")


def test_mamba_projections_have_no_biases_as_megatrons():
    """Megatron's MambaMixer has bias=False whatever add_bias_linear says (its HybridModel keeps it): a
    hybrid model with linear biases has them on attention and MLP layers, none on in_proj / out_proj."""
    from teratron.models.gpt.builder import build_gpt_model
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import build_run_config

    args = parse_train_args([flag for flag in MODEL if flag != "--disable-bias-linear"])
    vars(args).update(use_cpu_initialization=True)
    names = set(dict(build_gpt_model(build_run_config(args, 1).model).named_parameters()))
    assert "decoder.layers.2.self_attention.linear_qkv.bias" in names and "decoder.layers.3.mlp.linear_fc2.bias" in names
    assert not [name for name in names if ".mixer." in name and name.endswith(("in_proj.bias", "out_proj.bias"))]
    assert "decoder.layers.0.mixer.conv1d.bias" in names
