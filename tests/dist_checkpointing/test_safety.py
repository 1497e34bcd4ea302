"""Crash safety and background saving.

- A save killed half-way (SIGKILL while ranks write) leaves the previous checkpoint loadable and
  the tracker unchanged; the next save of that iteration succeeds.
- A save that fails on one rank (writing, or rank 0 publishing) raises on every rank and
  publishes nothing.
- An async save equals a sync save of the same state, even when training changes the
  parameters while it writes; it is published only by `finalize`.
- Saving an iteration again keeps the old folder until the new one is in place.
- A checkpoint missing a data file refuses to load with one error naming the file (checksums) or,
  read without them, its folder.
- A state holding NaN/Inf on any rank is not saved (every rank raises before anything is
  written); `teratron train --lr inf` stops with one line instead of publishing NaN checkpoints.
- Checksums are checked by the ranks in shares, and a damaged file one rank finds is reported by
  every rank.
"""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from teratron import cli
from teratron import parallel_state as ps
from teratron.dist_checkpointing import (DamagedCheckpointError, NonFiniteStateError, load_checkpoint, load_full,
                                         save_checkpoint, serialization, start_async_save, storage)
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.models.gpt.builder import build_gpt_model
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer
from teratron.process_groups import ProcessGroupCollection

ARGS = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=2,
            kv_channels=4, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
            add_qkv_bias=False, qk_layernorm=False, position_embedding_type="rope", rotary_base=10000,
            rotary_percent=1.0, rotary_interleaved=False, untie_embeddings_and_output_weights=False,
            max_position_embeddings=16, vocab_size=32, padded_vocab_size=32, num_experts=None,
            moe_ffn_hidden_size=None, moe_router_topk=None)


def model_and_optimizer(seed, tp=1):
    torch.manual_seed(seed)
    pg = None if dist.is_initialized() else ProcessGroupCollection()
    model = build_gpt_model(gpt_config_from_model_args(ARGS, tensor_model_parallel_size=tp), pg_collection=pg)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1), [model])
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(seed))
    model(ids[:, :-1], torch.arange(8).expand(2, 8), labels=ids[:, 1:]).mean().backward()
    optimizer.step()
    return model, optimizer


def _save_then_get_killed(root, marker):
    model, optimizer = model_and_optimizer(1)
    save_checkpoint(root, 1, [model], optimizer)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, marker + ".expected")
    original = serialization.dcp.FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):
        result = original(self, plan, planner)
        open(marker, "w").close()
        time.sleep(600)  # killed here: data written, nothing published
        return result

    serialization.dcp.FileSystemWriter.write_data = write_then_hang
    model.embedding.word_embeddings.weight.data.add_(1.0)
    save_checkpoint(root, 2, [model], optimizer)


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    root, marker = str(tmp_path / "ckpt"), str(tmp_path / "writing")
    child = mp.get_context("fork").Process(target=_save_then_get_killed, args=(root, marker))
    child.start()
    deadline = time.time() + 60
    while not os.path.exists(marker) and time.time() < deadline and child.is_alive():
        time.sleep(0.05)
    assert os.path.exists(marker), "the child never reached the middle of its save"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert storage.read_tracker(root) == 1
    assert sorted(os.listdir(root)) == [".tmp_iter_0000002", "iter_0000001", storage.TRACKER_FILENAME]
    fresh, optimizer = model_and_optimizer(5)
    load_checkpoint(storage.resolve_checkpoint_dir(root), [fresh], optimizer)
    expected = torch.load(marker + ".expected")
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    save_checkpoint(root, 2, [fresh], optimizer)  # the stale attempt is cleared, the retry publishes
    assert storage.read_tracker(root) == 2
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", storage.TRACKER_FILENAME]


def _fail_on_rank_1(root):
    ps.initialize_model_parallel(2)
    model, optimizer = model_and_optimizer(1, tp=2)
    save_checkpoint(root, 1, [model], optimizer)
    write_data = serialization.dcp.FileSystemWriter.write_data
    if dist.get_rank() == 1:
        serialization.dcp.FileSystemWriter.write_data = lambda *a: (_ for _ in ()).throw(OSError(28, "disk full"))
    messages = []
    try:
        save_checkpoint(root, 2, [model], optimizer)
    except OSError as e:
        messages.append(str(e))
    serialization.dcp.FileSystemWriter.write_data = write_data
    if dist.get_rank() == 0:  # rank 0 cannot publish: every rank hears it instead of waiting forever
        storage.publish = lambda *a: (_ for _ in ()).throw(OSError(13, "permission denied"))
    try:
        save_checkpoint(root, 3, [model], optimizer)
    except OSError as e:
        messages.append(str(e))
    return messages


def _async_vs_sync(sync_root, async_root):
    ps.initialize_model_parallel(2)
    model, optimizer = model_and_optimizer(1, tp=2)
    save_checkpoint(sync_root, 3, [model], optimizer, common={"note": "sync"})
    pending = start_async_save(async_root, 3, [model], optimizer, common={"note": "async"})
    with torch.no_grad():  # training goes on while the background thread writes
        for p in model.parameters():
            p.add_(1.0)
    published_early = storage.read_tracker(async_root) is not None
    while not pending.finalize(blocking=False):
        time.sleep(0.01)
    return published_early


def test_failure_on_one_rank_and_async_equals_sync(tmp_path):
    messages = run_distributed(_fail_on_rank_1, 2, str(tmp_path / "fail"))
    assert all(len(m) == 2 and "iteration 2 failed" in m[0] and "rank 1: OSError: [Errno 28] disk full" in m[0]
               for m in messages), messages
    assert "publishing checkpoint iteration 3 failed (PermissionError: [Errno 13] permission denied)" in messages[0][1]
    assert "publishing checkpoint iteration 3 failed (on rank 0)" in messages[1][1]
    assert storage.read_tracker(str(tmp_path / "fail")) == 1
    assert sorted(os.listdir(tmp_path / "fail")) == [".tmp_iter_0000003", "iter_0000001", storage.TRACKER_FILENAME]

    sync_root, async_root = str(tmp_path / "sync"), str(tmp_path / "async")
    published_early = run_distributed(_async_vs_sync, 2, sync_root, async_root)
    assert published_early == [False, False]
    assert storage.read_tracker(async_root) == 3
    sync = load_full(storage.resolve_checkpoint_dir(sync_root), lambda k: True)
    done = load_full(storage.resolve_checkpoint_dir(async_root), lambda k: True)
    assert set(sync) == set(done) and any(k.startswith("optimizer.state.exp_avg.") for k in sync)
    for key, value in sync.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, done[key]), key
    common = torch.load(os.path.join(storage.resolve_checkpoint_dir(async_root), "common.pt"), weights_only=False)
    assert common["note"] == "async"


def test_a_missing_data_file_is_one_error_naming_the_folder(tmp_path):
    model, _ = model_and_optimizer(1)
    folder = save_checkpoint(str(tmp_path), 1, [model], with_rng=False)
    for name in os.listdir(folder):
        if name.endswith(".distcp"):
            os.remove(os.path.join(folder, name))
    with pytest.raises(OSError, match=f"{folder}: reading the checkpoint failed .*distcp"):
        load_full(folder, lambda key: True)
    with pytest.raises(DamagedCheckpointError, match=f"{folder}/__0_0.distcp: missing"):
        load_checkpoint(folder, [model_and_optimizer(2)[0]], load_rng=False)


def test_saving_an_iteration_again_keeps_the_old_one_until_the_new_is_in_place(tmp_path, monkeypatch):
    first, _ = model_and_optimizer(1)
    folder = save_checkpoint(str(tmp_path), 1, [first], with_rng=False)
    second, _ = model_and_optimizer(2)
    rename = os.rename

    def failing_rename(src, dst):
        if os.path.basename(src) == os.path.basename(storage.temporary_dir(str(tmp_path), 1)):
            raise OSError("rename failed")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="rename failed"):
        save_checkpoint(str(tmp_path), 1, [second], with_rng=False)
    monkeypatch.undo()
    assert storage.read_tracker(str(tmp_path)) == 1 and not any(n.startswith(".replaced") for n in os.listdir(tmp_path))
    saved = load_full(folder, lambda k: True)
    assert saved and all(torch.equal(v, first.state_dict()[k]) for k, v in saved.items())
    folder = save_checkpoint(str(tmp_path), 1, [second], with_rng=False)  # a working save replaces it
    saved = load_full(folder, lambda k: True)
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in saved.items())
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))


def test_how_torch_steps_is_not_restored(tmp_path):
    """fused / foreach are this run's choice (fused Adam on CUDA), not checkpointed hyper-parameters:
    a checkpoint from a foreach run loads into a fused optimizer (and back) keeping the loader's
    choice, its step counts where the fused kernel wants them, and the next step matches."""
    root = str(tmp_path / "ckpt")
    model, optimizer = model_and_optimizer(1)
    save_checkpoint(root, 1, [model], optimizer)
    expected_model, expected_opt = model_and_optimizer(2)
    fused_model, fused_opt = model_and_optimizer(2)
    for group in fused_opt.param_groups:
        group["fused"], group["foreach"] = True, None  # torch's fused Adam runs on CPU too
    for m, opt in ((expected_model, expected_opt), (fused_model, fused_opt)):
        load_checkpoint(storage.resolve_checkpoint_dir(root), [m], opt)
    assert all(g["fused"] is True and g["foreach"] is None for g in fused_opt.param_groups)
    assert all(g.get("fused") is not True for g in expected_opt.param_groups)
    for main, state in fused_opt.chained_optimizers[0].optimizer.state.items():
        assert state["step"].device == main.device
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(3))
    for m, opt in ((expected_model, expected_opt), (fused_model, fused_opt)):
        m(ids[:, :-1], torch.arange(8).expand(2, 8), labels=ids[:, 1:]).mean().backward()
        opt.step()
    for (name, p), q in zip(expected_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)


def _non_finite_and_damage_on_one_rank(root):
    """TP = 2: NaN/Inf on rank 1 only stops every rank's save before anything is written; then a
    shard only rank 1 checksums is damaged, and every rank reports it."""
    ps.initialize_model_parallel(2)
    model, optimizer = model_and_optimizer(1, tp=2)
    save_checkpoint(root, 1, [model], optimizer)
    messages = []
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    exp_avg = optimizer.chained_optimizers[0].optimizer.state[weight]["exp_avg"]
    for tensor, value, save in ((weight, float("nan"), save_checkpoint), (exp_avg, float("inf"), start_async_save)):
        kept = tensor.detach().clone()
        if dist.get_rank() == 1:
            tensor.detach()[0, 0] = value
        try:
            save(root, 2, [model], optimizer)
        except NonFiniteStateError as e:
            messages.append(str(e))
        tensor.detach().copy_(kept)
    listing = sorted(os.listdir(root))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(storage.iteration_dir(root, 1), "__1_0.distcp"), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    try:
        load_checkpoint(storage.iteration_dir(root, 1), [model], optimizer)
    except DamagedCheckpointError as e:
        messages.append(str(e))
    return messages, listing


def test_non_finite_state_is_not_saved_and_damage_is_found_by_any_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_non_finite_and_damage_on_one_rank, 2, root)
    for rank, (messages, listing) in enumerate(results):
        assert len(messages) == 3, messages
        assert listing == ["iter_0000001", storage.TRACKER_FILENAME]  # no iteration 2, no temporary folder
        for message, key in zip(messages, ("decoder.layers.0.mlp.linear_fc1.weight",
                                           "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight")):
            assert message.startswith("iteration 2: the model or optimizer state holds NaN/Inf"), message
            assert (key if rank == 1 else "on another rank") in message, message
        assert messages[2].startswith(f"{storage.iteration_dir(root, 1)}/__1_0.distcp: its bytes changed")


def test_training_whose_weights_turn_nan_publishes_no_nan_checkpoint(tmp_path, capsys, monkeypatch):
    """Weights that turn NaN in a step (here poisoned after each step; --lr inf used to do it, and is
    now refused when the flags are read) were saved as NaN checkpoints, with --skip-nan-steps
    every one and exit 0. Now the first save stops the run, naming the iteration."""
    from teratron.training.trainer import Trainer

    step = Trainer.step

    def poisoned_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        with torch.no_grad():
            next(self.model[0].parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(Trainer, "step", poisoned_step)
    save = tmp_path / "ckpt"
    argv = ["train", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "30", "--num-layers", "1",
            "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--num-workers", "0", "--no-progress-bar", "--train-iters", "3", "--skip-nan-steps",
            "--save", str(save), "--save-interval", "1"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teratron: error: iteration 1: the model or optimizer state "
                                                   "holds NaN/Inf"), err
    assert not save.exists() or os.listdir(save) == []
