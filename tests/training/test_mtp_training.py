"""`teratron train` with multi-token prediction (--mtp-num-layers): the LM loss, the MTP loss and
the grad norm of every iteration under TP 2 + SP, PP 2 (the default placement, and an interleaved
layout with the MTP layers on a last stage of their own), TP 2 x PP 2, PP 2 x DP 2 with the
distributed optimizer, EP 2 (an MoE MTP layer) and, for a multi-latent-attention model (an MLA MTP
layer), TP 2 x PP 2 equal the single process's; a TP 2 checkpoint resumes at TP 1 and at PP 2
with the single process's next losses and, loaded by `load_for_inference`, drafts for itself in
the engine (no draft model); MTP-only training (--freeze-base-model-for-mtp) of a model
checkpointed without MTP changes only the MTP layers; bad flag combinations fail with one line
naming the flag."""

import json

import pytest
import torch

from teratron import cli
from train_runs import assert_same_losses, train, training_records

# 2 layers, hidden 32, seq 16, no dropout, mock data, RoPE (MTP refuses learned positions).
# Global batch 8: 4 micro-batches per step alone, 2 per rank at DP 2.
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "2",
        "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0",
        "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4"]
# Layer 2 is MoE, so the MTP layer (the last layer's spec) is too; expert bias moves every step.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "[0,1]",
       "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01", "--moe-per-layer-logging",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.05"]


def _train(args, tmp_path, name, nproc=None):
    """Runs `teratron train` (under torchrun when nproc is given); its training records."""
    return training_records(train(TINY + args, tmp_path, name, nproc, timeout=240)[0])


def _assert_equal(reference, run, name, keys):
    assert_same_losses(reference, run, name, keys)


def test_dense_mtp_layouts_and_resharding_equal_single_process(tmp_path):
    mtp = ["--mtp-num-layers", "2"]
    keys = ["lm_loss", "mtp_1_loss", "mtp_2_loss", "mtp_loss", "grad_norm"]
    reference = _train(mtp, tmp_path, "single")
    assert all({"mtp_1_loss", "mtp_2_loss", "mtp_loss"} <= r.keys() for r in reference)
    assert all(r["mtp_loss"] == pytest.approx((r["mtp_1_loss"] + r["mtp_2_loss"]) / 2) for r in reference)
    assert reference[-1]["mtp_loss"] < reference[0]["mtp_loss"]
    checkpoint = tmp_path / "tp2-ckpt"
    runs = {
        "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", str(checkpoint),
                    "--save-interval", "2"], 2),
        # Interleaved: virtual stages E | t | t | mmL on ranks 0, 1, 0, 1 (the MTP layers on a stage of their own).
        "pp2-vpp2-layout": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|t|t|mmL"],
                            2),
        "tp2-pp2-sp-distopt": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--sequence-parallel", "--use-distributed-optimizer"], 4),
    }
    for name, (extra, nproc) in runs.items():
        _assert_equal(reference, _train(mtp + extra, tmp_path, name, nproc), name, keys)
    # The TP 2 checkpoint of iteration 2 (MTP weights included) reshards to TP 1, and to PP 2, where
    # the last stage's copy of the embedding loads from the first stage's.
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _train(mtp + ["--load", str(checkpoint)], tmp_path, "tp1-resumed")
    _assert_equal(reference, resumed, "tp1-resumed", keys)
    assert [r["iteration"] for r in resumed] == [3, 4]
    resumed = _train(mtp + ["--load", str(checkpoint), "--pipeline-model-parallel-size", "2"], tmp_path,
                     "pp2-resumed", 2)
    _assert_equal(reference, resumed, "pp2-resumed", keys)
    # The checkpoint records its MTP layers: inference rebuilds them and they draft for the model.
    from teratron.inference.config import InferenceConfig
    from teratron.inference.engines import DynamicInferenceEngine
    from teratron.inference.engines.mtp_proposer import MTPProposer
    from teratron.inference.loading import load_for_inference
    from teratron.inference.sampling_params import SamplingParams

    model, tokenizer = load_for_inference(str(checkpoint), device="cpu")
    assert len(model.mtp.layers) == 2
    config = InferenceConfig(buffer_size_gb=0.01, block_size=4, num_speculative_tokens=2)
    greedy = SamplingParams(temperature=0, num_tokens_to_generate=8, ignore_eod=True)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    plain = [o.token_ids for o in DynamicInferenceEngine(model, tokenizer, InferenceConfig(
        buffer_size_gb=0.01, block_size=4)).generate(prompts, greedy)]
    engine = DynamicInferenceEngine(model, tokenizer, config)  # no draft model: the MTP layers draft
    assert isinstance(engine.draft, MTPProposer)
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == plain
    assert engine.num_draft_tokens_proposed > 0


def test_untied_mtp_with_recompute_under_pipeline_and_data_parallel(tmp_path):
    """One depth, an untied output layer (the MTP stage's embedding copy is then a parameter of its
    own, synced with the first stage's) and full recompute (the MTP layer recomputed too)."""
    flags = ["--mtp-num-layers", "1", "--untie-embeddings-and-output-weights", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    reference = _train(flags, tmp_path, "single")
    assert "mtp_1_loss" not in reference[0]  # one depth: its loss is the mtp loss
    run = _train(flags + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], tmp_path,
                 "pp2-dp2", 4)
    _assert_equal(reference, run, "pp2-dp2", ["lm_loss", "mtp_loss", "grad_norm"])


def test_moe_mtp_layer_under_expert_parallelism(tmp_path):
    keys = ["lm_loss", "mtp_loss", "grad_norm", "load_balancing_loss", "z_loss", "load_balancing_loss_layer_3",
            "z_loss_layer_3", "moe_load_imbalance_layer_3"]
    reference = _train(["--mtp-num-layers", "1"] + MOE, tmp_path, "single")
    # The MTP layer is global layer 3: its routing statistics are logged with the decoder's.
    assert all(sum(r["tokens_per_expert_layer_3"]) == 8 * 16 * 2 for r in reference)
    run = _train(["--mtp-num-layers", "1", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                  "alltoall"] + MOE, tmp_path, "ep2", 2)
    _assert_equal(reference, run, "ep2", keys)
    assert [r["tokens_per_expert_layer_3"] for r in run] == [r["tokens_per_expert_layer_3"] for r in reference]


def test_mla_mtp_layers_under_tensor_and_pipeline_parallelism(tmp_path):
    """Multi-latent attention (compressed queries, YaRN, latent norms): the MTP layer is an MLA
    layer like the last one; TP 2 x PP 2 with sequence parallelism and mla_up_proj recompute
    (the MTP stage's MLA layer recomputed too) equals the single process."""
    flags = ["--mtp-num-layers", "1", "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12",
             "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "4",
             "--mscale", "0.8", "--mscale-all-dim", "1", "--yarn-original-max-position-embeddings", "8",
             "--qk-layernorm", "--disable-bias-linear"]
    reference = _train(flags, tmp_path, "single")
    assert reference[-1]["mtp_loss"] < reference[0]["mtp_loss"]
    run = _train(flags + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--sequence-parallel", "--recompute-granularity", "selective", "--recompute-modules",
                          "mla_up_proj", "core_attn"], tmp_path, "tp2-pp2-sp-recompute", 4)
    _assert_equal(reference, run, "tp2-pp2-sp-recompute", ["lm_loss", "mtp_loss", "grad_norm"])


def test_mtp_only_training_of_a_pretrained_model_changes_only_the_mtp_layers(tmp_path):
    """A model pretrained without MTP, then --freeze-base-model-for-mtp --finetune on its checkpoint:
    the MTP layers start from their initialisation; after three steps every parameter and buffer
    outside them (the expert biases included) is bit-identical to the checkpoint's, every MTP
    parameter has moved (the MTP layer's expert bias too), and the MTP loss falls. Without
    --finetune / --no-load-optim the checkpoint's missing MTP layers are refused."""
    from teratron.models.gpt.builder import build_gpt_model
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import build_run_config
    from teratron.training.training import pretrain

    def state_after(argv):
        state = {}
        pretrain(build_run_config(parse_train_args(TINY + MOE + argv), 1),
                 after_training=lambda trainer: state.update(trainer.model[0].module.state_dict()))
        return state

    base = state_after(["--train-iters", "3", "--save", str(tmp_path / "base")])
    mtp = ["--mtp-num-layers", "1", "--freeze-base-model-for-mtp", "--load", str(tmp_path / "base"), "--lr", "5e-2",
           "--train-iters", "3", "--metrics-file", str(tmp_path / "frozen.jsonl")]
    with pytest.raises(ValueError, match="the checkpoint has no MTP layers; add --finetune or --no-load-optim"):
        state_after(mtp)
    trained = state_after(mtp + ["--finetune"])
    run = build_run_config(parse_train_args(TINY + MOE + mtp), 1)
    torch.manual_seed(run.training.seed)  # as the Trainer builds it
    initial = build_gpt_model(run.model).state_dict()
    assert {name for name in trained if not name.startswith("mtp.")} == set(base)
    assert all(torch.equal(trained[name], base[name]) for name in base)
    moved = {name for name in trained if name.startswith("mtp.") and not torch.equal(initial[name], trained[name])}
    mtp_parameters = {name for name, _ in build_gpt_model(run.model).named_parameters() if name.startswith("mtp.")}
    assert moved == mtp_parameters | {"mtp.layers.0.transformer_layer.mlp.router.expert_bias"}
    records = [json.loads(line) for line in (tmp_path / "frozen.jsonl").read_text().splitlines() if "lr" in line]
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"]


def test_bad_mtp_flags_in_process(tmp_path, capsys):
    cases = {
        "freeze without MTP": (["--freeze-base-model-for-mtp"],
                               "--freeze-base-model-for-mtp is set but --mtp-num-layers is None"),
        "scaling factor without MTP": (["--mtp-loss-scaling-factor", "0.3"],
                                       "--mtp-loss-scaling-factor is set but --mtp-num-layers is None"),
        "learned positions": (["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"],
                              "--mtp-num-layers needs --position-embedding-type 'rope' or 'none'"),
        "zero depths": (["--mtp-num-layers", "0"], "--mtp-num-layers must be a positive integer or None, got 0"),
    }
    for name, (flags, phrase) in cases.items():
        status = cli.main(["train"] + TINY + flags)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and lines[0].startswith("teratron: error: "), (name, err)
        assert phrase in lines[0], (name, lines[0])
    # Layouts, for two processes.
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args

    pp2 = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout"]
    for flags, phrase in [
            (["--mtp-num-layers", "1"] + pp2 + ["Ettm|L"], "places mtp layers 'm' outside the last stage"),
            (pp2 + ["Et|tmL"], "names 1 mtp layers 'm' but mtp_num_layers is None"),
            (["--mtp-num-layers", "2"] + pp2 + ["Et|tmL"], "names 1 mtp layers 'm' but mtp_num_layers is 2")]:
        with pytest.raises(ValueError, match="--pipeline-model-parallel-layout") as error:
            run_config_from_args(parse_train_args(TINY + flags), 2, 100)
        assert phrase in str(error.value) and "\n" not in str(error.value), flags
