"""Checkpoints Megatron-LM wrote (fixtures/megatron_core: Megatron Core's own `dist_checkpointing.save`
of its GPTModel at TP 1 and TP 2, with the logits of its own forward of a fixed batch; made by
megatron/make_megatron_fixture.py) load into teratron under TP 1 and TP 2 and give Megatron's
logits: the key translation (layers stacked, norms under fused names) and the row layouts (grouped
QKV, SwiGLU halves) are Megatron's."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state as ps
from teratron.dist_checkpointing import storage
from teratron.dist_checkpointing.megatron_format import (is_megatron_checkpoint, load_megatron_checkpoint,
                                                         read_common_state)
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from teratron.process_groups import ProcessGroupCollection
from teratron.transformer.transformer_config import TransformerConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_core")
LAYERS, VOCAB, SEQ = 2, 64, 8


def _folder(saved_tp: int) -> str:
    return os.path.join(FIXTURES, f"tp{saved_tp}", "iter_0000005")


def _model(tp: int, moe: dict | None = None, mtp: bool = False):
    config = TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
                               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, tensor_model_parallel_size=tp, use_cpu_initialization=True,
                               mtp_num_layers=1 if mtp else None, **(moe or {}))
    torch.manual_seed(123)  # other weights than Megatron's: the load must replace every one
    pg = None if dist.is_initialized() else ProcessGroupCollection()
    spec = get_gpt_decoder_block_spec(config, normalization="RMSNorm") if moe else get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(config, normalization="RMSNorm") if mtp else None
    return GPTModel(config, spec, VOCAB, SEQ, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", pg_collection=pg, mtp_block_spec=mtp_spec).eval()


def _logits_after_load(saved_tp: int, tp: int) -> torch.Tensor:
    """This TP layout's full-vocabulary logits of the fixture's batch, after loading the
    checkpoint Megatron saved at `saved_tp`."""
    model = _model(tp)
    common = load_megatron_checkpoint(_folder(saved_tp), [model], LAYERS)
    assert common["iteration"] == 5 and common["args"].tensor_model_parallel_size == saved_tp
    batch = torch.load(os.path.join(FIXTURES, f"tp{saved_tp}", "logits.pt"))
    with torch.no_grad():
        logits = model(batch["tokens"], None)  # [b, s, V/tp]
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits)
        logits = torch.cat(parts, dim=-1)
    return logits, batch["logits"]


@pytest.mark.parametrize("saved_tp", [1, 2])
def test_megatron_checkpoint_gives_megatrons_logits_in_one_process(saved_tp):
    assert is_megatron_checkpoint(_folder(saved_tp))
    logits, megatron_logits = _logits_after_load(saved_tp, 1)
    torch.testing.assert_close(logits, megatron_logits, rtol=1e-5, atol=1e-5)


def test_megatron_checkpoints_give_megatrons_logits_under_tensor_parallelism():
    for logits, megatron_logits in [pair for results in run_distributed(_both_fixtures_at_tp2, 2) for pair in results]:
        torch.testing.assert_close(logits, megatron_logits, rtol=1e-5, atol=1e-5)


def _both_fixtures_at_tp2():
    ps.initialize_model_parallel(2, 1)
    return [_logits_after_load(saved_tp, 2) for saved_tp in (1, 2)]


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)


@pytest.mark.parametrize("grouped", [False, True])
def test_megatron_moe_checkpoint_gives_megatrons_logits(grouped, tmp_path):
    """Megatron's experts, one [layers, experts, out, in] tensor per weight, load into teratron's
    SequentialMLP (one module per expert) and GroupedMLP ([experts, in, out]); written back, the
    keys and shapes are Megatron's (plus the MLP norm under Transformer Engine's MoE name)."""
    folder = os.path.join(FIXTURES, "moe_tp1", "iter_0000005")
    model = _model(1, dict(MOE, moe_grouped_gemm=grouped))
    load_megatron_checkpoint(folder, [model], LAYERS)
    batch = torch.load(os.path.join(FIXTURES, "moe_tp1", "logits.pt"))
    with torch.no_grad():
        logits = model(batch["tokens"], None)
    torch.testing.assert_close(logits, batch["logits"], rtol=1e-5, atol=1e-5)
    from teratron.dist_checkpointing import save_checkpoint

    saved = save_checkpoint(str(tmp_path), 5, [model], common={}, metadata={}, ckpt_format="torch_dist")
    ours, megatron = _model_keys(saved), _model_keys(folder)
    assert {k: ours[k] for k in megatron} == megatron
    assert set(ours) - set(megatron) == {"decoder.layers.pre_mlp_layernorm.weight"}


def test_megatron_moe_checkpoint_under_expert_parallelism():
    for logits, megatron_logits in run_distributed(_moe_at_ep2, 2):
        torch.testing.assert_close(logits, megatron_logits, rtol=1e-5, atol=1e-5)


def _moe_at_ep2():
    """Each rank holds two of the four experts (and the same tokens: data parallel over EP)."""
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    model = _model(1, dict(MOE, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall"))
    load_megatron_checkpoint(os.path.join(FIXTURES, "moe_tp1", "iter_0000005"), [model], LAYERS)
    batch = torch.load(os.path.join(FIXTURES, "moe_tp1", "logits.pt"))
    with torch.no_grad():
        return model(batch["tokens"], None), batch["logits"]


def _main_and_mtp_logits(model, tokens):
    """The model's logits of `tokens` and its MTP depths' ([depths, b, s, V]), as Megatron's loss
    computes them (one process)."""
    depths = []
    hook = model.mtp.register_forward_hook(lambda module, args, out: depths.extend(out))
    with torch.no_grad():
        logits = model(tokens, None)
        model(tokens, None, labels=tokens)  # the MTP block runs with the loss
        mtp_logits = torch.stack([model.output_logits(h).transpose(0, 1) for h in depths])
    hook.remove()
    return logits, mtp_logits


def test_a_megatron_mtp_checkpoint_gives_megatrons_logits_and_mtp_logits():
    """Megatron's MTP depth (`mtp.layers.0.*`, its layer's norms under the fused names) loads into
    teratron's and predicts the token after next as Megatron's does."""
    folder = os.path.join(FIXTURES, "mtp_tp1", "iter_0000005")
    model = _model(1, mtp=True)
    load_megatron_checkpoint(folder, [model], LAYERS)
    batch = torch.load(os.path.join(FIXTURES, "mtp_tp1", "logits.pt"))
    logits, mtp_logits = _main_and_mtp_logits(model, batch["tokens"])
    torch.testing.assert_close(logits, batch["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mtp_logits, batch["mtp_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("moe", [False, True])
def test_teratron_writes_the_mtp_keys_megatron_writes(moe, tmp_path):
    """--ckpt-format torch_dist of a model with an MTP depth has the keys, shapes and `_extra_state`
    objects of Megatron Core's own save (dense: the mtp_tp1 fixture; MoE: the key list of its
    save of the MoE model with one MTP depth), and reads back into teratron unchanged."""
    from teratron.dist_checkpointing import save_checkpoint, serialization

    moe_args = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24) if moe else None
    model = _model(1, moe_args, mtp=True)
    folder = save_checkpoint(str(tmp_path), 5, [model], common={"iteration": 5}, metadata={"model_args": {}},
                             ckpt_format="torch_dist")
    ours = {key: shape for key, shape in serialization.saved_keys(folder).items() if not key.startswith("common_state")}
    if moe:
        with open(os.path.join(FIXTURES, "moe_mtp_tp1_keys.json")) as f:
            theirs = {key: tuple(shape) if shape else None for key, shape in json.load(f)["keys"].items()}
        # teratron also writes an MoE layer's MLP norm under its own name (Transformer Engine's layers' name)
        ours = {key: shape for key, shape in ours.items() if "pre_mlp_layernorm" not in key}
    else:
        theirs = {key: shape for key, shape in
                  serialization.saved_keys(os.path.join(FIXTURES, "mtp_tp1", "iter_0000005")).items()
                  if not key.startswith("common_state")}
    assert ours == theirs
    loaded = _model(1, moe_args, mtp=True)
    for p in loaded.parameters():
        p.data.normal_()
    load_megatron_checkpoint(folder, [loaded], LAYERS)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_teratron_and_megatron_folders_are_told_apart(tmp_path):
    assert not is_megatron_checkpoint(str(tmp_path))
    (tmp_path / storage.METADATA_FILENAME).write_text('{"format": "teratron", "sharded_backend": "torch_dist"}')
    assert not is_megatron_checkpoint(str(tmp_path))
    assert read_common_state(_folder(1))["checkpoint_version"] == 3.0


def test_another_architecture_is_named_in_one_line():
    config = TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                               add_bias_linear=False, use_cpu_initialization=True)  # no GQA: another QKV shape
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", pg_collection=ProcessGroupCollection())
    with pytest.raises(ValueError, match=r"does not match: .*linear_qkv.weight: saved \(2, 64, 32\), expected \(2, 96, 32\)") as error:
        load_megatron_checkpoint(_folder(1), [model], LAYERS)
    assert "\n" not in str(error.value)


TRAIN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "48", "--swiglu", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
         "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "64",
         "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer", "--mock-data",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "7", "--lr", "1e-3",
         "--log-interval", "1", "--eval-iters", "0", "--no-progress-bar"]


def _train(tmp_path, *flags):
    import shutil
    import subprocess
    import sys

    load = tmp_path / "load"
    if not load.exists():
        shutil.copytree(os.path.join(FIXTURES, "tp1"), load)
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, "-m", "teratron", "train", *TRAIN, "--load", str(load),
                           "--metrics-file", str(metrics), *flags], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, metrics


def test_training_continues_a_megatron_checkpoint_at_its_iteration(tmp_path):
    import json

    proc, metrics = _train(tmp_path, "--no-load-optim")
    assert proc.returncode == 0, proc.stderr
    assert "loaded torch_dist (Megatron-LM layout) checkpoint" in proc.stdout
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [6, 7]
    proc, metrics = _train(tmp_path, "--finetune", "--train-iters", "1")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()][-1] == 1


def test_a_checkpoint_without_readable_optimizer_state_is_refused_in_one_line(tmp_path):
    proc, _ = _train(tmp_path)  # Megatron Core's model-only save: no distributed-optimizer state
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("teratron: error: --load ")
    assert "--dist-ckpt-optim-fully-reshardable" in proc.stderr and "add --no-load-optim" in proc.stderr


# ----- a Megatron-LM run (fixtures/megatron_lm: pretrain_gpt.py's iteration-4 save, its optimizer
# state included, the data it trained on and the losses it logged; SOURCE.json says how) -------------

MEGATRON_LM = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_lm")


def _megatron_lm_run():
    import json

    with open(os.path.join(MEGATRON_LM, "SOURCE.json")) as f:
        return json.load(f)


def _train_like_megatron_lm(tmp_path, name, *flags):
    import json
    import subprocess
    import sys

    metrics = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "teratron", "train", *_megatron_lm_run()["flags"],
                           "--data-path", os.path.join(MEGATRON_LM, "docs"), "--data-cache-path",
                           str(tmp_path / "cache"), "--metrics-file", str(metrics),
                           *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    return {r["iteration"]: r for r in map(json.loads, metrics.read_text().splitlines())}


def test_a_megatron_lm_run_continues_with_megatrons_losses(tmp_path):
    """teratron resumes Megatron-LM's iteration-4 checkpoint (weights, Adam moments and fp32 masters
    of its distributed optimizer, step count, schedule, consumed samples) and logs the losses
    Megatron-LM logged for iterations 5-8. Megatron ran bf16 on an H200, this runs bf16 on the CPU:
    they agree to 6e-5; a fresh optimizer misses by 1e-2 at iteration 6."""
    logged = _megatron_lm_run()["logged"]
    resumed = _train_like_megatron_lm(tmp_path, "resumed", "--load", MEGATRON_LM)
    assert sorted(resumed) == [5, 6, 7, 8]
    for iteration, record in resumed.items():
        assert record["lm_loss"] == pytest.approx(logged["lm_loss"][str(iteration)], abs=2e-4), iteration
        assert record["lr"] == pytest.approx(logged["learning_rate"][str(iteration)], rel=1e-6), iteration


def test_teratron_writes_the_optimizer_state_megatron_lm_writes(tmp_path):
    """--ckpt-format torch_dist of the same run has every key and shape Megatron-LM's save has (model,
    `_extra_state` objects, the optimizer's `param`, `exp_avg`, `exp_avg_sq`), and its optimizer
    common state is Megatron's: the same param groups (what each is, its hyper-parameters at
    iteration 4, the step count) and the fully_reshardable layout."""
    from teratron.dist_checkpointing import serialization

    _train_like_megatron_lm(tmp_path, "saved", "--exit-interval", "4", "--save", str(tmp_path / "ckpt"),
                            "--save-interval", "4")
    ours, theirs = str(tmp_path / "ckpt" / "iter_0000004"), os.path.join(MEGATRON_LM, "iter_0000004")
    not_written = ("rng_state", "rerun_state_machine_state")  # the RNG is not carried in this layout
    assert serialization.saved_keys(ours) == {key: shape for key, shape in serialization.saved_keys(theirs).items()
                                              if not key.startswith(not_written)}
    ours_common, theirs_common = read_common_state(ours)["optimizer"], read_common_state(theirs)["optimizer"]
    assert ours_common["param_state_sharding_type"] == theirs_common["param_state_sharding_type"]
    compared = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "max_lr", "min_lr", "weight_decay",
                "betas", "eps", "decoupled_weight_decay", "step")
    groups = [[{key: group[key] for key in compared} for group in state["optimizer"]["param_groups"]]
              for state in (ours_common, theirs_common)]
    assert groups[0] == groups[1]
    for ours_group, theirs_group in zip(ours_common["optimizer"]["param_groups"],
                                        theirs_common["optimizer"]["param_groups"]):
        assert ours_group["lr"] == pytest.approx(theirs_group["lr"], rel=1e-12)
    assert read_common_state(ours)["opt_param_scheduler"] == read_common_state(theirs)["opt_param_scheduler"]


def test_a_torch_dist_save_resumes_with_the_same_losses(tmp_path):
    """--ckpt-format torch_dist writes Megatron-LM's layout; teratron resumes it (model, optimizer,
    scheduler, consumed samples) and continues with the losses of an uninterrupted run (no dropout:
    that layout holds no RNG states)."""
    import json
    import subprocess
    import sys

    def train(name, *flags):
        metrics = tmp_path / f"{name}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "teratron", "train", *TRAIN, "--train-iters", "4",
                               "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--hidden-dropout", "0",
                               "--attention-dropout", "0", "--metrics-file", str(metrics),
                               *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr
        return {r["iteration"]: r for r in map(json.loads, metrics.read_text().splitlines())}

    whole = train("whole")
    train("first", "--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--exit-interval", "2",
          "--ckpt-format", "torch_dist")
    assert is_megatron_checkpoint(str(tmp_path / "ckpt" / "iter_0000002"))
    resumed = train("resumed", "--load", str(tmp_path / "ckpt"))
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        for key in ("lm_loss", "grad_norm", "lr"):
            assert resumed[iteration][key] == pytest.approx(whole[iteration][key], rel=1e-6), (iteration, key)


# ----- writing Megatron-LM's layout (--ckpt-format torch_dist) -------------------------------------

def _save_megatron_layout(root, tp=1):
    from teratron.dist_checkpointing import save_checkpoint

    model = _model(tp)
    common = {"iteration": 5, "consumed_train_samples": 40, "consumed_valid_samples": 8}
    metadata = {"model_args": {"num_layers": LAYERS, "hidden_size": 32}}
    folder = save_checkpoint(str(root), 5, [model], common=common, metadata=metadata, ckpt_format="torch_dist")
    return model, folder


def _model_keys(folder):
    from teratron.dist_checkpointing import serialization

    return {key: shape for key, shape in serialization.saved_keys(folder).items()
            if shape is not None and "_extra_state" not in key}


def test_teratron_writes_the_keys_and_shapes_megatron_writes(tmp_path):
    _, folder = _save_megatron_layout(tmp_path)
    assert is_megatron_checkpoint(folder)
    assert _model_keys(folder) == _model_keys(_folder(1))  # Megatron Core's own save of this architecture
    assert not os.path.exists(os.path.join(folder, storage.COMMON_FILENAME))
    common = read_common_state(folder)
    assert (common["iteration"], common["checkpoint_version"]) == (5, 3.0)
    assert (common["args"].consumed_train_samples, common["args"].num_layers) == (40, LAYERS)


def test_multi_latent_attention_norms_take_megatrons_names(tmp_path):
    """Megatron's Transformer Engine MLA layer (megatron/core/models/gpt/gpt_layer_specs.py): the input
    norm is a module of its own, the latent norms are fused into linear_q_up_proj / linear_kv_up_proj;
    a save under those names loads back whole."""
    from teratron.dist_checkpointing import save_checkpoint
    from teratron.transformer import MLATransformerConfig

    def mla_model(seed):
        config = MLATransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, q_lora_rank=16,
                                      kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                                      ffn_hidden_size=48, qk_layernorm=True, normalization="RMSNorm",
                                      add_bias_linear=False, use_cpu_initialization=True)
        torch.manual_seed(seed)
        spec = get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm")
        return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope",
                        pg_collection=ProcessGroupCollection())

    model = mla_model(1)
    folder = save_checkpoint(str(tmp_path), 5, [model], common={"iteration": 5}, metadata={"model_args": {}},
                             ckpt_format="torch_dist")
    keys = _model_keys(folder)
    for name in ("input_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
                 "self_attention.linear_kv_up_proj.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"):
        assert f"decoder.layers.{name}" in keys, name
    assert not [key for key in keys if "linear_qkv" in key or "q_layernorm" in key or "kv_layernorm" in key]
    loaded = mla_model(2)
    load_megatron_checkpoint(folder, [loaded], LAYERS)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_megatron_layout_round_trips_under_any_tensor_parallel_size(tmp_path):
    saved, folder = _save_megatron_layout(tmp_path)
    loaded = _model(1)
    torch.manual_seed(7)
    for p in loaded.parameters():
        p.data.normal_()
    load_megatron_checkpoint(folder, [loaded], LAYERS)
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    full = {name: t.clone() for name, t in saved.state_dict().items()}
    for shards in run_distributed(_load_at_tp2, 2, folder):
        for name, (dim, shard, rank) in shards.items():
            expected = full[name] if dim is None else full[name].chunk(2, dim)[rank]
            if name.endswith("linear_fc1.weight"):  # SwiGLU: each rank holds its gate and up rows
                gate, up = full[name].chunk(2, 0)
                expected = torch.cat([gate.chunk(2, 0)[rank], up.chunk(2, 0)[rank]])
            assert torch.equal(shard, expected), name


def _load_at_tp2(folder):
    ps.initialize_model_parallel(2, 1)
    model = _model(2)
    load_megatron_checkpoint(folder, [model], LAYERS)
    return {name: (getattr(t, "partition_dim", None) if getattr(t, "tensor_model_parallel", False) else None,
                   t.detach().clone(), dist.get_rank()) for name, t in model.state_dict(keep_vars=True).items()}
