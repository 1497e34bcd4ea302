"""`teratron train` of multi-latent-attention models under torchrun (gloo, CPU) against the single
process: every iteration's loss and grad norm must equal it.

Model A: compressed queries, YaRN (concentration factor != 1, softmax scale corrected), latent
norms, MoE in layers 1 and 3 of 4: TP 2 with sequence parallelism (and 'mla_up_proj' +
'core_attn' recompute), PP 2, EP 2 (x DP 2), TP 2 x PP 2. A checkpoint saved at TP 2 loads at
TP 1 and continues with the same losses. Model B: uncompressed queries, YaRN, dense: TP 2 with
sequence parallelism. The flags reach MLATransformerConfig; flags without
--multi-latent-attention are refused.
"""

import re

import pytest

from teratron import cli
from train_runs import assert_same_losses, train, training_records

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "4",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0", "--no-progress-bar", "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--seed", "7", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--disable-bias-linear", "--init-method-std", "0.1", "--train-iters", "4"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6", "--rotary-scaling-factor", "4", "--mscale", "0.8", "--mscale-all-dim", "1",
       "--yarn-original-max-position-embeddings", "8", "--qk-layernorm"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.1"]
MODEL_A = TINY + MLA + ["--q-lora-rank", "16"] + MOE
MODEL_B = TINY + MLA


def _train(args, tmp_path, name, nproc=None):
    return training_records(train(args, tmp_path, name, nproc)[0])


_assert_same_losses = assert_same_losses


def test_mla_moe_model_under_every_layout_and_a_resharded_checkpoint(tmp_path):
    reference = _train(MODEL_A, tmp_path, "single")
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    runs = {
        "tp2-sp-recompute": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj",
                              "core_attn", "--save", str(tmp_path / "tp2"), "--save-interval", "2"], 2),
        "pp2": (["--pipeline-model-parallel-size", "2"], 2),
        "ep2": (["--expert-model-parallel-size", "2"], 2),
        "tp2-pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--sequence-parallel"], 4),
    }
    for name, (extra, nproc) in runs.items():
        _assert_same_losses(reference, _train(MODEL_A + extra, tmp_path, name, nproc), name)
    # The TP 2 checkpoint of iteration 2 loads into one process and continues as the others did.
    (tmp_path / "tp2" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _train(MODEL_A + ["--load", str(tmp_path / "tp2")], tmp_path, "tp1-from-tp2")
    assert [r["iteration"] for r in resumed] == [3, 4]
    _assert_same_losses(reference, resumed, "tp1-from-tp2")


def test_mla_without_query_compression_under_tp_and_sp(tmp_path):
    """linear_q_proj (column-parallel, gathering the hidden state under SP) in place of the
    query down/up projections; pipelining does not depend on it (model A covers PP)."""
    reference = _train(MODEL_B, tmp_path, "single")
    extra = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _assert_same_losses(reference, _train(MODEL_B + extra, tmp_path, "tp2-sp", 2), "tp2-sp")


def test_mla_flags_reach_the_config():
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args
    from teratron.transformer import MLATransformerConfig

    run = run_config_from_args(parse_train_args(TINY + MLA + ["--yarn-beta-fast", "16", "--rotary-base", "500"]), 1,
                               100, cuda=False)
    t = run.transformer
    assert type(t) is MLATransformerConfig and t.multi_latent_attention and t.qk_layernorm and t.gated_linear_unit
    assert (t.q_lora_rank, t.kv_lora_rank, t.qk_head_dim, t.qk_pos_emb_head_dim, t.v_head_dim) == (None, 12, 8, 4, 6)
    assert (t.rope_type, t.rotary_scaling_factor, t.mscale, t.mscale_all_dim) == ("yarn", 4.0, 0.8, 1.0)
    assert (t.original_max_position_embeddings, t.beta_fast, t.beta_slow, t.rotary_base) == (8, 16.0, 1, 500)
    plain = run_config_from_args(parse_train_args(TINY), 1, 100, cuda=False)
    assert type(plain.transformer) is not MLATransformerConfig and not plain.transformer.multi_latent_attention


def test_mla_flag_errors(capsys):
    cases = [
        (["--q-lora-rank", "16"], "--q-lora-rank set without --multi-latent-attention"),
        (["--rope-type", "yarn", "--mscale", "2"], "--rope-type, --mscale set without --multi-latent-attention"),
        (MLA + ["--group-query-attention"], "--group-query-attention does not apply to --multi-latent-attention"),
        (MLA + ["--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim .3. must be even"),
        (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
         "--recompute-modules contains 'mla_up_proj' but --multi-latent-attention is False"),
        (MLA + ["--torch-compile"], "--torch-compile on the CPU cannot compile multi-latent attention whose "
                                    "--v-head-dim differs"),
    ]
    for extra, message in cases:
        assert cli.main(["train"] + TINY + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("teratron: error: ") and len(err.strip().splitlines()) == 1, err
        assert re.search(message, err), (message, err)
