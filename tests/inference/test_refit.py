"""refit_weights: a live training model's weights into inference models of other layouts.

Each distributed run trains a tiny GPT two steps with `teratron train`'s own code (pretrain on 4
gloo ranks) and saves it. After training, every rank refits the live chunks into inference models
of other layouts (TP 1 or 2, PP 1, on every rank or on some) built from other seeds, and reports
their tensors and logits. The test reads the saved checkpoint's global tensors itself
(`load_full`) and requires every refitted tensor to equal them bit for bit (TP shards cut with
`shard_tensor`, vocabulary rows cut or zero-padded as a checkpoint load does); it loads the
checkpoint into a single-process TP = 1 model and requires the refitted models' logits to equal
that model's (bit for bit at TP = 1), and, in fp32, the training model's own pipeline logits up to
float reduction order.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from teratron.dist_checkpointing import load_checkpoint, load_full, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
from teratron.dist_checkpointing.model_state import is_model_key
from teratron.inference.refit import refit_weights
from teratron.models.gpt.builder import build_gpt_model
from teratron.pipeline_parallel import get_forward_backward_func
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel import shard_tensor
from teratron.tensor_parallel.utils import pad_vocab_size
from teratron.topology import Topology
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.training import pretrain

VOCAB, SEQ = 40, 16  # padded to 64 at TP 2 and 48 at TP 1 (multiples of 16 x TP)
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "16", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
        "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2",
        "--lr-warmup-iters", "1", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--save-interval", "2"]
TOKENS = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(11))


@dataclasses.dataclass(frozen=True)
class Target:
    """An inference model to refit into: its TP size, the ranks that hold one, its dtype."""
    tp: int
    ranks: tuple = (0, 1, 2, 3)
    dtype: torch.dtype = torch.float32
    num_layers: int | None = None  # another architecture: the refit must refuse it
    groups: str | None = None  # "given": both models' groups passed in; "none": the inference model's
    # passed as groups of one, which misdescribes its TP shards: the refit must refuse it

    @property
    def refused(self) -> bool:
        return self.num_layers is not None or self.groups == "none"


def _inference_config(model_config, target: Target, padded_vocab=None):
    record = model_args_from_config(model_config)
    if target.num_layers is not None:
        record["num_layers"] = target.num_layers
    padded = padded_vocab or pad_vocab_size(VOCAB, 16, target.tp)
    return gpt_config_from_model_args(record, padded_vocab_size=padded, tensor_model_parallel_size=target.tp,
                                      params_dtype=target.dtype)


def _report(model) -> dict:
    """state-dict name -> (partition dim or None, stride, tp rank, tp size, tensor)."""
    tp = model.pg_collection.tp
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        parallel = getattr(tensor, "tensor_model_parallel", False)
        out[name] = (tensor.partition_dim if parallel else None, getattr(tensor, "partition_stride", 1),
                     dist.get_rank(tp), dist.get_world_size(tp), tensor.detach().clone())
    return out


def _training_logits(trainer):
    """The training chunks' full logits [1, s, V] of TOKENS through the pipeline (last stage),
    else None."""
    for chunk in trainer.model:
        chunk.eval()

    def step(data, model):
        logits = model(next(data), None, runtime_gather_output=True)
        return logits, lambda out: (out.sum() * 0, {"logits": out.detach().clone()})

    stored = get_forward_backward_func()(
        forward_step_func=step, data_iterator=[iter([TOKENS, TOKENS]) for _ in trainer.model], model=trainer.model,
        num_microbatches=2, seq_length=SEQ, micro_batch_size=1, forward_only=True)
    return stored[0]["logits"] if stored else None


def _train_and_refit(argv, save, targets):
    """On every rank: train, then refit into each target; returns {target index: report and
    logits, or the refusal's message}, plus the training logits."""
    out = {}

    def after_training(trainer):
        for index, target in enumerate(targets):
            pg = Topology.build(tensor_model_parallel_size=target.tp).pg_collection()
            model = None
            if dist.get_rank() in target.ranks:
                torch.manual_seed(1000 + index)  # not the training model's initial weights
                model = build_gpt_model(_inference_config(trainer.run.model, target), pg_collection=pg).eval()
            groups = {"given": (trainer.pg_collection, pg), "none": (None, ProcessGroupCollection())}
            try:
                refit_weights(model, trainer.model, *groups.get(target.groups, ()))
            except ValueError as e:
                out[index] = str(e)
                continue
            if model is not None:
                with torch.no_grad():
                    out[index] = (_report(model), model(TOKENS, None, runtime_gather_output=True))
        out["training"] = _training_logits(trainer)

    pretrain(build_run_config(parse_train_args(TINY + argv + ["--save", save])), after_training=after_training)
    return out


def _fit_rows(tensor, rows):
    """A vocabulary tensor cut or zero-padded to `rows` rows, as a checkpoint load does."""
    if rows <= tensor.shape[0]:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0],) + tuple(tensor.shape[1:]))])


def _expected(saved, name, dim, stride, tp_rank, tp_size, like):
    full = saved["embedding.word_embeddings.weight" if name == "output_layer.weight" and name not in saved else name]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = _fit_rows(full, like.shape[0] * (tp_size if dim == 0 else 1))
    if dim is not None:
        full = shard_tensor(full, dim, stride, tp_rank, tp_size)
    return full.to(like.dtype)


def _reference_logits(checkpoint, metadata, dtype):
    """Logits of TOKENS from the checkpoint loaded into a single-process TP = 1 model."""
    config = gpt_config_from_model_args(metadata["model_args"], padded_vocab_size=pad_vocab_size(VOCAB, 16, 1),
                                        params_dtype=dtype)
    torch.manual_seed(99)
    model = build_gpt_model(config, pg_collection=ProcessGroupCollection()).eval()
    load_checkpoint(checkpoint, [model], load_optimizer=False, load_rng=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: the same GEMM kernels, the same sums
    try:
        with torch.no_grad():
            return model(TOKENS, None, runtime_gather_output=True)
    finally:
        torch.set_num_threads(threads)


def _check_run(tmp_path, argv, targets, training_logits=True):
    save = str(tmp_path / "ckpt")
    results = run_distributed(_train_and_refit, 4, argv, save, targets, timeout=600)
    checkpoint = storage.iteration_dir(save, 2)
    saved = load_full(checkpoint, is_model_key)
    metadata = storage.read_metadata(checkpoint)
    reference = {dtype: _reference_logits(checkpoint, metadata, dtype) for dtype in {t.dtype for t in targets}}
    training = [r["training"] for r in results if r["training"] is not None]
    assert training, "no rank computed the training logits"
    for index, target in enumerate(targets):
        if target.refused:
            continue  # the test checks the message
        for rank, result in enumerate(results):
            if rank not in target.ranks:
                assert index not in result
                continue
            report, logits = result[index]
            assert report, "the inference model has no tensors"
            for name, (dim, stride, tp_rank, tp_size, tensor) in report.items():
                expected = _expected(saved, name, dim, stride, tp_rank, tp_size, tensor)
                assert torch.equal(tensor, expected), (index, rank, name)
            ref = reference[target.dtype]
            assert logits.shape[-1] == pad_vocab_size(VOCAB, 16, target.tp)
            assert torch.isinf(logits[..., VOCAB:]).all()
            if target.tp == 1:
                assert torch.equal(logits, ref), (index, rank)
            else:  # TP = 2 sums the row-parallel products in another order
                torch.testing.assert_close(logits[..., :VOCAB], ref[..., :VOCAB])
            if training_logits:
                for train in training:
                    torch.testing.assert_close(logits[..., :VOCAB], train[..., :VOCAB])
    return results


def test_refit_from_tp2_pp2_vpp_into_tp1_and_tp2(tmp_path):
    """Tied embeddings (the last stage's copy is not a source), GQA, SwiGLU's strided fc1,
    interleaved stages; vocabulary 64 rows in training, 48 at TP 1. Targets on every rank, on one
    rank only, at TP 2 (the same padding; its groups given explicitly), and two that every rank
    refuses: another depth, and a TP 2 model described by groups of one."""
    targets = (Target(tp=1), Target(tp=2, groups="given"), Target(tp=1, ranks=(3,)), Target(tp=1, num_layers=2),
               Target(tp=2, groups="none"))
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1"]
    results = _check_run(tmp_path, argv, targets)
    for result in results:  # the refused refit, on every rank
        message = result[3]
        assert re.match(r"refit: the inference model does not match the training model \(\d+ tensors missing from "
                        r"the inference model: decoder\.layers\.2\.", message), message
        assert "\n" not in message
        assert re.match(r"refit: the inference model does not match the training model \(\d+ tensors with other "
                        r"shapes: decoder\.layers\.0\.mlp\.linear_fc1\.bias: training \(96,\), inference "
                        r"\(48,\);", result[4]), result[4]


def test_refit_from_distributed_optimizer_bf16_untied(tmp_path):
    """DP 2 with the distributed optimizer (each rank steps a slice; the params are gathered) and
    bf16 params; untied output layer; vocabulary 48 rows in training (TP 1), 64 at TP 2 (rows
    past 48 become zeros); into fp32 (a cast) at TP 2 and at TP 1 on two ranks, and bf16 at TP 1."""
    targets = (Target(tp=2), Target(tp=1, ranks=(0, 1)), Target(tp=1, dtype=torch.bfloat16))
    argv = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
            "--untie-embeddings-and-output-weights"]
    _check_run(tmp_path, argv, targets, training_logits=False)


def test_refit_from_expert_parallel_moe(tmp_path):
    """MoE with EP 2 and expert TP 2 (experts saved by their global index) into TP 1 EP 1."""
    argv = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--disable-bias-linear", "--num-layers", "2"]
    _check_run(tmp_path, argv, (Target(tp=1),))


def test_refit_in_one_process():
    """Without torch.distributed: a plain model into another of the same shape, the vocabulary
    padded to more rows (zeros); another architecture is refused in one line."""
    from teratron.models.gpt.gpt_config import GPTModelConfig
    from teratron.transformer.transformer_config import TransformerConfig

    config = GPTModelConfig(TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                                              hidden_dropout=0.0, attention_dropout=0.0),
                            vocab_size=30, max_position_embeddings=SEQ, position_embedding_type="rope",
                            padded_vocab_size=32)
    none = ProcessGroupCollection()
    torch.manual_seed(1)
    training = build_gpt_model(config, pg_collection=none)
    torch.manual_seed(2)
    inference = build_gpt_model(dataclasses.replace(config, padded_vocab_size=40), pg_collection=none)
    refit_weights(inference, [training])
    got, want = inference.state_dict(), training.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        expected = _fit_rows(want[name], 40) if name == "embedding.word_embeddings.weight" else want[name]
        assert torch.equal(tensor, expected), name
    assert got["embedding.word_embeddings.weight"][32:].abs().sum() == 0

    other = build_gpt_model(dataclasses.replace(config, transformer=dataclasses.replace(config.transformer,
                                                                                       hidden_size=32)),
                            pg_collection=none)
    with pytest.raises(ValueError, match=r"^refit: the inference model does not match the training model \(\d+ "
                                         r"tensors with other shapes: decoder\.") as error:
        refit_weights(other, training)
    assert "\n" not in str(error.value)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_refit_over_nccl():
    script = os.path.join(os.path.dirname(__file__), "refit_gpu_check.py")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", script], check=True,
                   timeout=600)
