"""`teratron convert gpt-to-hybrid | hybrid-to-gpt`: a trained GPT checkpoint becomes a hybrid one
whose attention (*, or + for multi-latent attention) and MLP (-) layers hold the GPT layers' halves.
The pattern that only splits each GPT layer gives the GPT model's logits exactly; with Mamba layers
(M) added the kept halves are the GPT weights and the new layers are Mamba-2's initialisation; the
translated model trains through `teratron train --finetune`; back to GPT returns the original
weights bit for bit."""

import pytest
import torch

from teratron import cli
from teratron.dist_checkpointing import load_checkpoint, load_full, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.dist_checkpointing.model_state import is_model_key
from teratron.models.gpt.builder import build_gpt_model
from train_runs import train, training_records

GPT = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
       "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
       "--global-batch-size", "4", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
       "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
       "--ffn-hidden-size", "48"]
MAMBA = ["--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2"]


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    train(GPT + ["--train-iters", "2", "--save", str(root / "gpt"), "--save-interval", "2"], root, "gpt")
    return root / "gpt"


def _model(folder):
    folder = storage.resolve_checkpoint_dir(str(folder))
    model = build_gpt_model(gpt_config_from_model_args(storage.read_metadata(folder)["model_args"]))
    load_checkpoint(folder, [model], load_rng=False)
    return model.eval()


def _logits(model):
    tokens = torch.arange(32).reshape(2, 16) % 100
    with torch.no_grad():
        return model(tokens, torch.arange(16).expand(2, 16), None)


def _convert(*argv):
    assert cli.main(["convert", *argv]) == 0


def test_splitting_each_gpt_layer_gives_the_gpt_logits(gpt_checkpoint, tmp_path):
    _convert("gpt-to-hybrid", "--load", str(gpt_checkpoint), "--save", str(tmp_path / "split"),
             "--hybrid-layer-pattern", "*-*-")
    assert torch.equal(_logits(_model(tmp_path / "split")), _logits(_model(gpt_checkpoint)))


def test_mamba_layers_are_new_and_the_rest_round_trips(gpt_checkpoint, tmp_path):
    _convert("gpt-to-hybrid", "--load", str(gpt_checkpoint), "--save", str(tmp_path / "hybrid"),
             "--hybrid-layer-pattern", "M*-M*-", *MAMBA)
    gpt = load_full(storage.resolve_checkpoint_dir(str(gpt_checkpoint)), is_model_key)
    hybrid_dir = storage.resolve_checkpoint_dir(str(tmp_path / "hybrid"))
    hybrid = load_full(hybrid_dir, is_model_key)
    for gpt_layer, (attention, mlp) in enumerate(((1, 2), (4, 5))):
        for key, value in gpt.items():
            prefix = f"decoder.layers.{gpt_layer}."
            if key.startswith(prefix):
                rest = key[len(prefix):]
                place = attention if rest.startswith(("input_layernorm.", "self_attention.")) else mlp
                assert torch.equal(hybrid[f"decoder.layers.{place}.{rest}"], value), key
    outside_layers = [key for key in gpt if not key.startswith("decoder.layers.")]
    assert "embedding.word_embeddings.weight" in outside_layers and "decoder.final_layernorm.weight" in outside_layers
    for key in outside_layers:
        assert torch.equal(hybrid[key], gpt[key]), key
    a_log = hybrid["decoder.layers.0.mixer.A_log"]
    assert a_log.shape == (8,) and bool(((a_log.exp() >= 1) & (a_log.exp() <= 16)).all())  # Mamba-2's A in [1, 16]
    assert storage.read_metadata(hybrid_dir)["model_args"]["hybrid_layer_pattern"] == "M*-M*-"

    records = training_records(train(GPT + MAMBA + ["--hybrid-layer-pattern", "M*-M*-", "--train-iters", "2",
                                                    "--load", str(tmp_path / "hybrid"), "--finetune"],
                                     tmp_path, "finetune")[0])
    assert [r["iteration"] for r in records] == [1, 2] and records[-1]["lm_loss"] < records[0]["lm_loss"]

    _convert("hybrid-to-gpt", "--load", str(tmp_path / "hybrid"), "--save", str(tmp_path / "back"))
    back = load_full(storage.resolve_checkpoint_dir(str(tmp_path / "back")), is_model_key)
    assert back.keys() == gpt.keys() and all(torch.equal(back[k], gpt[k]) for k in gpt)


MLA = ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6", "--q-lora-rank", "16", "--qk-layernorm"]


def test_a_multi_latent_attention_model_translates_to_plus_layers(tmp_path):
    """An MLA GPT checkpoint: '+-+-' gives its logits exactly, M+-M+- trains and returns its weights;
    a '*' layer is refused in one line."""
    train(GPT + MLA + ["--train-iters", "1", "--save", str(tmp_path / "gpt"), "--save-interval", "1"], tmp_path, "gpt")
    _convert("gpt-to-hybrid", "--load", str(tmp_path / "gpt"), "--save", str(tmp_path / "split"),
             "--hybrid-layer-pattern", "+-+-")
    assert torch.equal(_logits(_model(tmp_path / "split")), _logits(_model(tmp_path / "gpt")))
    _convert("gpt-to-hybrid", "--load", str(tmp_path / "gpt"), "--save", str(tmp_path / "hybrid"),
             "--hybrid-layer-pattern", "M+-M+-", *MAMBA)
    records = training_records(train(GPT + MLA + MAMBA + ["--hybrid-layer-pattern", "M+-M+-", "--train-iters", "1",
                                                          "--load", str(tmp_path / "hybrid"), "--finetune"],
                                     tmp_path, "finetune")[0])
    assert [r["iteration"] for r in records] == [1]
    _convert("hybrid-to-gpt", "--load", str(tmp_path / "hybrid"), "--save", str(tmp_path / "back"))
    gpt = load_full(storage.resolve_checkpoint_dir(str(tmp_path / "gpt")), is_model_key)
    back = load_full(storage.resolve_checkpoint_dir(str(tmp_path / "back")), is_model_key)
    assert back.keys() == gpt.keys() and all(torch.equal(back[k], gpt[k]) for k in gpt)
    assert cli.main(["convert", "gpt-to-hybrid", "--load", str(tmp_path / "gpt"), "--save", str(tmp_path / "out"),
                     "--hybrid-layer-pattern", "*-+-"]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("pattern, phrase", [
    ("*-*", "the pattern has 2 attention (*) and 1 MLP ('-') layers; the GPT model has 2 layers"),
    ("*-*E", "the pattern has MoE (E) layers but the GPT model's MLPs are dense; use '-'"),
    ("*-G*-", "Gated DeltaNet layers (G), which a GPT layer cannot hold"),
    ("+-+-", "the GPT model's attention is standard; use '*' for its attention layers"),
    ("*-Q*-", "'Q' is not a layer symbol"),
    ("*-*-/M-", "multi-token-prediction depths ('/') are not translated; give the decoder's layers only"),
])
def test_patterns_that_do_not_fit_are_one_line(gpt_checkpoint, tmp_path, capsys, pattern, phrase):
    assert cli.main(["convert", "gpt-to-hybrid", "--load", str(gpt_checkpoint), "--save", str(tmp_path / "out"),
                     "--hybrid-layer-pattern", pattern]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_hybrid_with_mtp_depths_is_not_translated_to_gpt(tmp_path, capsys):
    hybrid = tmp_path / "hybrid"
    train(GPT + MAMBA + ["--hybrid-layer-pattern", "M*-/*-", "--train-iters", "1", "--save", str(hybrid),
                         "--save-interval", "1"], tmp_path, "hybrid-mtp")
    assert cli.main(["convert", "hybrid-to-gpt", "--load", str(hybrid), "--save", str(tmp_path / "gpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the hybrid pattern 'M*-/*-' has multi-token-prediction depths ('/')" in err[0], err
    assert not (tmp_path / "gpt").exists()


GDP_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "gdp_stack_spec"]
GDP = ["--spec", *GDP_SPEC, "--gdp-num-householder", "2"]


def test_gated_delta_product_m_layers_are_new_and_the_rest_round_trips(gpt_checkpoint, tmp_path, capsys):
    """With Megatron's gdp_stack_spec the pattern's M layers are new Gated Delta Product mixers (of 2
    substeps, A in [0, 16] and no D, as Megatron initialises them), the record says so and rebuilds a GDP
    model, the kept halves are the GPT weights, the model trains with its flags, and back to
    GPT drops the GDP layers (saying so) and returns the GPT weights bit for bit; a spec teratron does not
    build is refused in one line."""
    _convert("gpt-to-hybrid", "--load", str(gpt_checkpoint), "--save", str(tmp_path / "gdp"),
             "--hybrid-layer-pattern", "M*-M*-", *MAMBA, *GDP)
    assert cli.main(["convert", "gpt-to-hybrid", "--load", str(gpt_checkpoint), "--save", str(tmp_path / "other"),
                     "--hybrid-layer-pattern", "M*-M*-", "--spec", "my.specs", "my_stack_spec"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--spec my.specs my_stack_spec: teratron builds its layers without Megatron's specs" in \
        err[0] and not (tmp_path / "other").exists()
    folder = storage.resolve_checkpoint_dir(str(tmp_path / "gdp"))
    record = storage.read_metadata(folder)["model_args"]
    assert (record["spec"], record["gdp_num_householder"], record["hybrid_layer_pattern"]) == (GDP_SPEC, 2, "M*-M*-")
    mixer = _model(tmp_path / "gdp").decoder.layers[3].mixer
    assert (type(mixer).__name__, mixer.num_householder) == ("GatedDeltaProductMixer", 2)
    gpt = load_full(storage.resolve_checkpoint_dir(str(gpt_checkpoint)), is_model_key)
    gdp = load_full(folder, is_model_key)
    for gpt_layer, place in ((0, 1), (1, 4)):  # each GPT layer's attention half on its '*' layer
        for key, value in gpt.items():
            if key.startswith(f"decoder.layers.{gpt_layer}.self_attention."):
                assert torch.equal(gdp[key.replace(f"layers.{gpt_layer}.", f"layers.{place}.")], value), key
    # 8 heads (2 x 32 / 8) of 8, 2 groups of state 8: z, V0, V1 (64 each), K0, K1, Q (16 each), b0, b1, a (8 each)
    assert gdp["decoder.layers.0.mixer.in_proj.weight"].shape == (64 * 3 + 16 * 3 + 8 * 3, 32)
    assert "decoder.layers.0.mixer.D" not in gdp and "decoder.layers.0.mixer.conv1d.bias" not in gdp
    a = gdp["decoder.layers.0.mixer.A_log"].exp()
    assert bool(((a >= 0) & (a <= 16)).all()) and bool((a < 1).any())  # Megatron's GDP A ~ U(0, 16)

    records = training_records(train(GPT + MAMBA + GDP + ["--hybrid-layer-pattern", "M*-M*-", "--train-iters", "1",
                                                          "--load", str(tmp_path / "gdp"), "--finetune"],
                                     tmp_path, "finetune")[0])
    assert [r["iteration"] for r in records] == [1]

    capsys.readouterr()
    _convert("hybrid-to-gpt", "--load", str(tmp_path / "gdp"), "--save", str(tmp_path / "back"))
    assert "NOTE: 2 Gated Delta Product layer(s) of M*-M*- have no GPT counterpart" in capsys.readouterr().out
    back_dir = storage.resolve_checkpoint_dir(str(tmp_path / "back"))
    back = load_full(back_dir, is_model_key)
    assert back.keys() == gpt.keys() and all(torch.equal(back[k], gpt[k]) for k in gpt)
    assert storage.read_metadata(back_dir)["model_args"]["spec"] is None
