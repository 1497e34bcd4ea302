"""`teratron train` with context parallelism and packed sequences under torchrun (gloo, CPU)
against the single process: every iteration's loss and grad norm, and the final evaluation, must
equal it.

Each cp_comm_type at CP 2 in a composition (p2p with DP 2 and the distributed optimizer, which
also saves a checkpoint; all_gather with interleaved PP 2 and full recompute; a2a with TP 2 and
sequence parallelism), a2a+p2p at CP 4 (2 x 2) with selective recompute and activation
offloading, a MoE model with EP 2 (its aux losses and tokens per
expert too), multi-latent attention, and packed documents (--reset-attention-mask
--reset-position-ids --eod-mask-loss, so CP ranks hold different numbers of loss tokens) with
1F1B PP 2. The CP 2 checkpoint loads into one process and continues with the same losses.
Multi-token prediction under CP 2 x DP 2 (its label shift runs along the whole sequence), and on
packed documents with QK-clip and per-token loss (the shift stays inside documents; the max
logit is max-reduced over CP ranks).
Sequence packing (documents as samples, balanced over DP ranks by tokens, packed into THD rows)
under CP 2 x DP 2: each document split into 2 x CP chunks.
"""

import pytest

from teratron.training.arguments import parse_train_args
from teratron.training.config import run_config_from_args
from train_runs import assert_same_losses, train, training_records, write_documents

TINY = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-2", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
        "--num-workers", "0", "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--train-iters", "3"]
MOCK = ["--mock-data"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01", "--moe-per-layer-logging"]
MOE_KEYS = ["load_balancing_loss", "z_loss", "moe_load_imbalance"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6", "--q-lora-rank", "16", "--disable-bias-linear"]
DOCUMENTS = ["--split", "90,5,5", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
CP2 = ["--context-parallel-size", "2"]


def _train(args, tmp_path, name, nproc=None):
    """(training records, evaluation records, stdout) of `teratron train` (torchrun with nproc)."""
    records, stdout = train(TINY + args, tmp_path, name, nproc)
    return training_records(records), [r for r in records if "lr" not in r], stdout


def _assert_equal(reference, run, name, keys=("lm_loss", "grad_norm")):
    (ref_train, ref_eval, _), (train_records, evals, _) = reference, run
    assert_same_losses(ref_train, train_records, name, keys)
    for a, b in zip(ref_eval[-len(evals):], evals):
        for key in a.keys() - {"iteration"}:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (name, key, a[key], b[key])


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    run = _train(MOCK, tmp_path_factory.mktemp("dense"), "single")
    assert run[0][-1]["lm_loss"] < run[0][0]["lm_loss"] and len(run[1]) == 2
    return run


def test_p2p_with_data_parallel_distributed_optimizer_and_a_checkpoint_loaded_without_cp(dense_reference, tmp_path):
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    run = _train(MOCK + CP2 + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
                 + save, tmp_path, "cp2-dp2", nproc=4)
    assert "(TP 1 x PP 1 x CP 2 x DP 2, 4 process(es))" in run[2]
    _assert_equal(dense_reference, run, "cp2-dp2")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _train(MOCK + ["--load", str(tmp_path / "ckpt")], tmp_path, "cp1-from-cp2")
    assert [r["iteration"] for r in resumed[0]] == [3]
    _assert_equal(dense_reference, resumed, "cp1-from-cp2")


def test_all_gather_with_interleaved_pipeline_and_full_recompute(dense_reference, tmp_path):
    run = _train(MOCK + CP2 + ["--cp-comm-type", "all_gather", "--pipeline-model-parallel-size", "2",
                               "--num-layers-per-virtual-pipeline-stage", "1", "--recompute-granularity", "full",
                               "--recompute-method", "uniform", "--recompute-num-layers", "1"],
                 tmp_path, "cp2-ag-vpp", nproc=4)
    _assert_equal(dense_reference, run, "cp2-ag-vpp")


def test_a2a_with_tensor_and_sequence_parallel(dense_reference, tmp_path):
    run = _train(MOCK + CP2 + ["--cp-comm-type", "a2a", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                 tmp_path, "cp2-a2a-tp2", nproc=4)
    _assert_equal(dense_reference, run, "cp2-a2a-tp2")


def test_hierarchical_a2a_p2p_at_cp4_with_selective_recompute_and_offloading(dense_reference, tmp_path):
    run = _train(MOCK + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                         "--hierarchical-context-parallel-sizes", "2", "2", "--recompute-granularity", "selective",
                         "--fine-grained-activation-offloading", "--offload-modules", "qkv_linear", "attn_proj"],
                 tmp_path, "cp4-a2a-p2p", nproc=4)
    _assert_equal(dense_reference, run, "cp4-a2a-p2p")


def test_moe_with_expert_parallel(tmp_path):
    reference = _train(MOCK + MOE, tmp_path, "moe-single")
    run = _train(MOCK + MOE + CP2 + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
                 tmp_path, "moe-cp2-ep2", nproc=4)
    _assert_equal(reference, run, "moe-cp2-ep2", keys=["lm_loss", "grad_norm"] + MOE_KEYS)
    for a, b in zip(reference[0], run[0]):
        for n in (1, 3):
            assert b[f"tokens_per_expert_layer_{n}"] == a[f"tokens_per_expert_layer_{n}"], (a["iteration"], n)


def test_multi_latent_attention(tmp_path):
    reference = _train(MOCK + MLA, tmp_path, "mla-single")
    _assert_equal(reference, _train(MOCK + MLA + CP2, tmp_path, "mla-cp2", nproc=2), "mla-cp2")


def test_packed_documents_with_pipeline(tmp_path):
    write_documents(str(tmp_path / "docs"))
    data = ["--data-path", str(tmp_path / "docs")] + DOCUMENTS
    reference = _train(data, tmp_path, "docs-single")
    run = _train(data + CP2 + ["--pipeline-model-parallel-size", "2"], tmp_path, "docs-cp2-pp2", nproc=4)
    _assert_equal(reference, run, "docs-cp2-pp2")


MTP = ["--mtp-num-layers", "2"]
MTP_KEYS = ["lm_loss", "mtp_1_loss", "mtp_2_loss", "mtp_loss", "grad_norm"]
QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "0.03", "--log-max-attention-logit"]


def test_multi_token_prediction_with_data_parallel_distributed_optimizer(tmp_path):
    reference = _train(MOCK + MTP, tmp_path, "mtp-single")
    run = _train(MOCK + MTP + CP2 + ["--use-distributed-optimizer"], tmp_path, "mtp-cp2-dp2", nproc=4)
    _assert_equal(reference, run, "mtp-cp2-dp2", keys=MTP_KEYS)


def test_multi_token_prediction_with_a_comm_type_per_layer(tmp_path):
    """A per-layer --cp-comm-type list: the MTP depths' layers exchange as the last decoder layer (a2a)."""
    reference = _train(MOCK + MTP, tmp_path, "mtp-single")
    run = _train(MOCK + MTP + CP2 + ["--cp-comm-type", "p2p", "a2a", "p2p", "a2a"], tmp_path, "mtp-cp2-layers", nproc=2)
    _assert_equal(reference, run, "mtp-cp2-layers", keys=MTP_KEYS)


def test_multi_token_prediction_and_qk_clip_on_packed_documents_with_per_token_loss(tmp_path):
    """The MTP shift stays inside each document and runs along the whole sequence across CP
    ranks; QK-clip's max logit is each head's over its documents' keys, max-reduced over CP."""
    write_documents(str(tmp_path / "docs"))
    data = ["--data-path", str(tmp_path / "docs")] + DOCUMENTS + MTP + QK_CLIP + ["--calculate-per-token-loss"]
    reference = _train(data, tmp_path, "mtp-docs-single")
    assert reference[0][0]["max_attention_logit"] > 0.03  # the threshold: the clip acts
    run = _train(data + CP2, tmp_path, "mtp-docs-cp2", nproc=2)
    _assert_equal(reference, run, "mtp-docs-cp2", keys=MTP_KEYS + ["max_attention_logit"])


PACKING = ["--sequence-packing", "--calculate-per-token-loss", "--micro-batch-size", "1", "--eod-mask-loss",
           "--split", "90,5,5"]


def test_sequence_packing_over_data_and_context_parallel_ranks(tmp_path):
    write_documents(str(tmp_path / "docs"))
    data = ["--data-path", str(tmp_path / "docs")] + PACKING
    reference = _train(data, tmp_path, "packed-single")
    run = _train(data + CP2, tmp_path, "packed-cp2-dp2", nproc=4)
    _assert_equal(reference, run, "packed-cp2-dp2")


def test_sequence_packing_needs_per_token_loss_and_one_row_micro_batches():
    def config(*flags):
        return run_config_from_args(parse_train_args(TINY + MOCK + list(flags)), 1, 100, cuda=False)
    with pytest.raises(ValueError, match="--sequence-packing needs --calculate-per-token-loss"):
        config("--sequence-packing", "--micro-batch-size", "1")
    with pytest.raises(ValueError, match="use --micro-batch-size 1"):
        config("--sequence-packing", "--calculate-per-token-loss")
    assert config(*PACKING[:4]).data.sequence_packing
