"""`teratron train` of a hybrid model (`--hybrid-layer-pattern`) under torchrun (gloo, CPU) against
the single process: every iteration's loss and grad norm must equal it.

The pattern mixes every layer kind: Mamba-2 (M), Gated DeltaNet (G), attention (*), MLP (-), MoE (E); multi-latent
attention layers (+) stand in for attention under TP 2 + SP, PP 2 and CP 2. Layouts: TP 2
with sequence parallelism, PP 2 placed by the pattern's '|' (MG*-E|MG*-E), DP 2 with the distributed optimizer,
EP 2, CP 2 and TP 2 + SP x CP 2 (the recurrent layers on all-to-all'd head shares; at TP 2 x CP 2 each B / C
group and key head is repeated on two CP ranks), full recompute; a checkpoint saved at TP 2 loads into one process
and continues alike; packed documents (each a zero state in the Mamba and Gated DeltaNet layers) under TP 2 + SP,
PP 2, DP 2 and CP 2; Gated Delta Product layers (Megatron's gdp_stack_spec) in the M places under the same layouts.
"""

import pytest

from teratron import cli
from train_runs import assert_same_losses, train, training_records, write_documents

PATTERN = "MG*-EMG*-E"
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "100", "--eval-iters",
        "1", "--num-workers", "0", "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--disable-bias-linear", "--init-method-std", "0.1", "--train-iters", "4", "--ffn-hidden-size", "48",
        "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--linear-key-head-dim", "8",
        "--linear-value-head-dim", "8", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-aux-loss-coeff", "0.1"]
MODEL = TINY + ["--hybrid-layer-pattern", PATTERN]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6", "--q-lora-rank", "16", "--qk-layernorm", "--rope-type", "yarn", "--rotary-scaling-factor",
       "4", "--mscale", "0.8", "--mscale-all-dim", "1", "--yarn-original-max-position-embeddings", "8"]


def _train(args, tmp_path, name, nproc=None):
    return training_records(train(args, tmp_path, name, nproc)[0])


def test_hybrid_model_under_every_layout_and_a_resharded_checkpoint(tmp_path):
    reference = _train(MODEL, tmp_path, "single")
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    runs = {
        "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", str(tmp_path / "tp2"),
                    "--save-interval", "2"], 2),
        "pp2-by-pattern": (TINY + ["--hybrid-layer-pattern", "MG*-E|MG*-E", "--pipeline-model-parallel-size", "2"], 2),
        "dp2-distributed-optimizer": (["--use-distributed-optimizer"], 2),
        "ep2": (["--expert-model-parallel-size", "2"], 2),
        "cp2": (["--context-parallel-size", "2"], 2),
        "tp2-sp-cp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"], 4),
        "recompute-full": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "2"], None),
    }
    for name, (extra, nproc) in runs.items():
        args = extra if extra[:len(TINY)] == TINY else MODEL + extra
        assert_same_losses(reference, _train(args, tmp_path, name, nproc), name)
    (tmp_path / "tp2" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _train(MODEL + ["--load", str(tmp_path / "tp2")], tmp_path, "tp1-from-tp2")
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert_same_losses(reference, resumed, "tp1-from-tp2")


def test_mtp_depths_from_the_pattern_under_tensor_and_pipeline_parallelism(tmp_path):
    """'/' depths (Mamba + MoE layers each) on the last stage: LM and MTP losses equal the single
    process's under TP 2 + SP, PP 2 (the layout puts the depths after the last segment) and CP 2."""
    keys = ("lm_loss", "mtp_loss", "grad_norm", "load_balancing_loss")
    reference = _train(TINY + ["--hybrid-layer-pattern", "MG*-EMG*-E/ME/ME"], tmp_path, "mtp-single")
    assert all(r["mtp_loss"] > 0 for r in reference)
    tp2 = _train(TINY + ["--hybrid-layer-pattern", "MG*-EMG*-E/ME/ME", "--tensor-model-parallel-size", "2",
                         "--sequence-parallel"], tmp_path, "mtp-tp2-sp", 2)
    pp2 = _train(TINY + ["--hybrid-layer-pattern", "MG*-E|MG*-E/ME/ME", "--pipeline-model-parallel-size", "2"],
                 tmp_path, "mtp-pp2", 2)
    cp2 = _train(TINY + ["--hybrid-layer-pattern", "MG*-EMG*-E/ME/ME", "--context-parallel-size", "2"], tmp_path,
                 "mtp-cp2", 2)
    for name, run in (("mtp-tp2-sp", tp2), ("mtp-pp2", pp2), ("mtp-cp2", cp2)):
        assert_same_losses(reference, run, name, keys)


def test_multi_latent_attention_layers_under_tensor_pipeline_and_context_parallelism(tmp_path):
    """'+' layers (MLA with YaRN, query compression and its norms), one in the MTP depth too: LM, MTP and
    load-balancing losses equal the single process's under TP 2 + SP, PP 2 and CP 2."""
    keys = ("lm_loss", "mtp_loss", "grad_norm", "load_balancing_loss")
    reference = _train(TINY + MLA + ["--hybrid-layer-pattern", "MG+-EMG+-E/+-"], tmp_path, "mla-single")
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    runs = {"mla-tp2-sp": ["--hybrid-layer-pattern", "MG+-EMG+-E/+-", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"],
            "mla-pp2": ["--hybrid-layer-pattern", "MG+-E|MG+-E/+-", "--pipeline-model-parallel-size", "2"],
            "mla-cp2": ["--hybrid-layer-pattern", "MG+-EMG+-E/+-", "--context-parallel-size", "2"]}
    for name, extra in runs.items():
        assert_same_losses(reference, _train(TINY + MLA + extra, tmp_path, name, 2), name, keys)


GDP = ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "gdp_stack_spec", "--gdp-num-householder", "2"]


def test_gated_delta_product_layers_under_every_layout(tmp_path):
    """Megatron's gdp_stack_spec: the M layers (one in the MTP depth too) are Gated Delta Product mixers.
    LM, MTP and load-balancing losses equal the single process's under TP 2 + SP, PP 2, DP 2 with the
    distributed optimizer, CP 2, TP 2 + SP x CP 2, full recompute, and on packed documents under CP 2."""
    keys = ("lm_loss", "mtp_loss", "grad_norm", "load_balancing_loss")
    model = TINY + GDP + ["--hybrid-layer-pattern", "MG*-EMG*-E/ME"]
    reference = _train(model, tmp_path, "gdp-single")
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    runs = {
        "gdp-tp2-sp": (model + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
        "gdp-pp2": (TINY + GDP + ["--hybrid-layer-pattern", "MG*-E|MG*-E/ME", "--pipeline-model-parallel-size", "2"],
                    2),
        "gdp-dp2": (model + ["--use-distributed-optimizer"], 2),
        "gdp-cp2": (model + ["--context-parallel-size", "2"], 2),
        "gdp-tp2-sp-cp2": (model + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--context-parallel-size", "2"], 4),
        "gdp-recompute-full": (model + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "2"], None),
    }
    for name, (args, nproc) in runs.items():
        assert_same_losses(reference, _train(args, tmp_path, name, nproc), name, keys)
    write_documents(str(tmp_path / "docs"))
    rows = TINY[1:] + GDP + ["--data-path", str(tmp_path / "docs"), "--split", "90,5,5", "--eod-mask-loss",
                             "--reset-attention-mask", "--reset-position-ids", "--hybrid-layer-pattern", "MG*-EMG*-E"]
    docs_reference = _train(rows, tmp_path, "gdp-docs-single")
    assert_same_losses(docs_reference, _train(rows + ["--context-parallel-size", "2"], tmp_path, "gdp-docs-cp2", 2),
                       "gdp-docs-cp2")


def test_packed_documents_under_tensor_pipeline_and_data_parallelism(tmp_path):
    """Rows of several documents (--reset-attention-mask; tests/ssm checks that each document runs in
    the recurrent layers as alone) train to the single process's losses under TP 2 + SP, PP 2, DP 2 and
    CP 2; so do --sequence-packing's THD rows under DP 2 and CP 2 x DP 2, which pack other rows than the
    single process (CP pads every document to a multiple of 2 x CP)."""
    write_documents(str(tmp_path / "docs"))
    data = TINY[1:] + ["--data-path", str(tmp_path / "docs"), "--split", "90,5,5", "--eod-mask-loss"]
    rows = data + ["--reset-attention-mask", "--reset-position-ids", "--hybrid-layer-pattern", PATTERN]
    reference = _train(rows, tmp_path, "docs-single")
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    for name, extra in (("docs-tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("docs-dp2", ["--use-distributed-optimizer"]), ("docs-cp2", ["--context-parallel-size", "2"])):
        assert_same_losses(reference, _train(rows + extra, tmp_path, name, 2), name)
    pp2 = data + ["--reset-attention-mask", "--reset-position-ids", "--hybrid-layer-pattern", "MG*-E|MG*-E",
                  "--pipeline-model-parallel-size", "2"]
    assert_same_losses(reference, _train(pp2, tmp_path, "docs-pp2", 2), "docs-pp2")
    # Each rank packs its own documents into rows: rows differ from the single process's, so only
    # per-document layers give its losses (no MoE: its auxiliary loss is per micro-batch).
    no_moe = data[:data.index("--num-experts")] + data[data.index("--moe-aux-loss-coeff") + 2:]
    packing = no_moe + ["--hybrid-layer-pattern", "MG*-MG*-", "--sequence-packing", "--calculate-per-token-loss",
                        "--micro-batch-size", "1"]
    packed_reference = _train(packing, tmp_path, "packing-single")
    assert_same_losses(packed_reference, _train(packing, tmp_path, "packing-dp2", 2), "packing-dp2")
    cp2 = _train(packing + ["--context-parallel-size", "2"], tmp_path, "packing-cp2-dp2", 4)
    assert_same_losses(packed_reference, cp2, "packing-cp2-dp2")


@pytest.mark.parametrize("flags, phrase", [
    (["--hybrid-layer-pattern", "M*X"], "'X' is not a layer symbol"),
    (["--hybrid-layer-pattern", "M*D"], "DeepSeek sparse attention layers (D) are not supported yet"),
    (["--hybrid-layer-pattern", "M+-E"], "has multi-latent attention layers (+) but --multi-latent-attention is off"),
    (["--hybrid-layer-pattern", "M*+E"] + MLA, "standard attention layers (*) next to multi-latent attention (+)"),
    (["--hybrid-layer-pattern", "M*/M-/-M"], "every multi-token-prediction depth after '/' must repeat one"),
    (["--hybrid-layer-pattern", "/M-"], "has no decoder layers before '/'"),
    (["--hybrid-layer-pattern", "M*/M-", "--mtp-num-layers", "2"], "--mtp-num-layers 2 but --hybrid-layer-pattern "
                                                                     "has 1 depths after '/'"),
    (["--hybrid-layer-pattern", "M||*", "--pipeline-model-parallel-size", "2"], "a pipeline segment between '|' has"),
    (["--hybrid-layer-pattern", "M*-"], "--num-experts is set but --hybrid-layer-pattern has no MoE layer (E)"),
    (["--hybrid-layer-pattern", "M*|-E", "--pipeline-model-parallel-layout", "Et|ttL",
      "--pipeline-model-parallel-size", "2"], "drop --pipeline-model-parallel-layout or the '|'"),
    (["--hybrid-layer-pattern", "ME", "--mamba-num-groups", "3"], "do not split into 3 groups"),
    (["--hybrid-layer-pattern", "ME", "--spec", "my.specs", "custom_spec"], "takes only 'megatron.core.models."),
    (["--hybrid-layer-pattern", "ME", "--gdp-num-householder", "0"], "--gdp-num-householder must be a positive"),
    (["--num-layers", "2", "--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "gdp_stack_spec"],
     "Gated Delta Product mixers are the pattern's M layers"),
    (["--hybrid-layer-pattern", "ME", "--gdp-cutedsl-kernel"], "the CuTeDSL Gated Delta Product kernel package"),
])
def test_bad_patterns_are_one_line(tmp_path, capsys, monkeypatch, flags, phrase):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train"] + TINY + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("teratron: error: ") and phrase in err[0], err
