"""Throughput accounting and the three outputs of a logged iteration.

Each logged iteration goes to: the console (a tqdm progress bar plus Megatron's log line),
`--metrics-file` (one JSON object per line, keys as in ARCHITECTURE.md) and, when asked,
TensorBoard (`--tensorboard-dir`). Each evaluation goes to the same three: its own metrics
record holds the iteration and the split's losses (`val_lm_loss`, `test_lm_loss`, ...). Only
the logging rank (the last rank, which holds the loss) writes any of them.

A resumed run appends to the metrics file after removing the interrupted run's records past the
iteration it resumes from (`drop_records_after`), so the file holds one record per iteration.
"""

import json
import math
import os
import resource
import shutil
import sys
import time
from typing import Optional

import torch
from tqdm import tqdm

from teratron.distributed.copy_engine import bytes_outside_allocator

# Dense bf16 tensor-core peak, TFLOP/s per GPU, by device-name substring.
_PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def num_floating_point_operations(model, seq_length: int, batch_size: int) -> float:
    """Training FLOPs of `batch_size` sequences of `model` (a GPTModelConfig), by Megatron-LM's `num_floating_point_operations`.

    Counts matrix multiplies only. Each GEMM runs three times (forward, weight gradient, input
    gradient) and a [m, n] x [n, k] GEMM costs 2mnk, hence the factor 3 * 2 = 6 per
    multiply-accumulate. Per token and layer, with q = kv_channels * heads and
    k = v = kv_channels * query_groups:
      attention = 6 * (h * (q + k + v)          QKV projection
                       + q * s / 2 * 2          QK^T and PV; a causal mask halves the s x s work
                       + q * h)                 output projection
      mlp       = 6 * h * (3 if SwiGLU else 2) * (ffn in a dense layer; in an MoE layer
                  moe_ffn * experts routed to + shared-expert ffn)
    with MoE layers where --moe-layer-freq puts them, plus the output layer,
    6 * h * padded_vocab, once per token. Multi-latent attention: see `_mla_attention_flops`.
    Each of the --mtp-num-layers multi-token-prediction depths adds a layer like the last one
    (MoE when it is, MLA with the model's), its eh_proj, 6 * (2 * h * h + 3 * h) (Megatron
    counts the three norms too), and another pass through the output layer.
    """
    if model.transformer.hybrid_layer_pattern is not None:
        return _hybrid_flops(model, seq_length, batch_size)
    fb_fma = 3 * 2
    t = model.transformer
    h, s = t.hidden_size, seq_length
    mtp = t.mtp_num_layers or 0
    q_size = t.kv_channels * t.num_attention_heads
    kv_size = t.kv_channels * t.num_query_groups
    attention = fb_fma * (h * (q_size + 2 * kv_size) + q_size * s / 2 * 2 + q_size * h)
    if t.multi_latent_attention:
        attention = _mla_attention_flops(t, s)

    ffn_factor = 3 if t.gated_linear_unit else 2
    moe_layers = 0
    moe_ffn = 0
    if t.num_moe_experts:
        from teratron.transformer.moe.moe_logging import moe_layer_indices

        moe_layers = len(moe_layer_indices(t))  # the MTP layers' included
        moe_ffn = t.moe_ffn_hidden_size * t.moe_router_topk + (t.moe_shared_expert_intermediate_size or 0)
    dense_layers = t.num_layers + mtp - moe_layers
    mlp = fb_fma * h * ffn_factor * (t.ffn_hidden_size * dense_layers + moe_ffn * moe_layers)

    mtp_projection = fb_fma * mtp * (2 * h * h + 3 * h)
    logits = fb_fma * h * model.padded_vocab_size * (1 + mtp)
    return batch_size * s * ((t.num_layers + mtp) * attention + mlp + mtp_projection + logits)


def _hybrid_flops(model, seq_length: int, batch_size: int) -> float:
    """A hybrid model's training FLOPs, Megatron-LM's `hybrid_flops`: per token, each layer of the
    pattern counts as its kind (attention, MLP and MoE as in a GPT layer above, multi-latent
    attention as `_mla_attention_flops`: Megatron-LM's count leaves `+` layers out), and
      Mamba = 6 * (h * (2 d_inner + 2 groups * state + heads) + d_inner * h) + 3 * 7 * d_inner * state
              (in and out projections; the scan, Megatron's rough 7 FLOPs per channel and state)
      Gated DeltaNet = 6 * (h * (2 qk + 2 v + 2 v_heads) + conv * (2 qk + v) + 4 v_heads * v_head^2 + v * h)
              (qk = key heads * key head size, v = value heads * value head size)
      Gated Delta Product (the M layers with gdp_layers): `_gated_delta_product_flops`
    plus the output layer, 6 * h * padded_vocab; each MTP depth ('/') adds its layers, its eh_proj
    and the output layer as a GPT model's depth does."""
    from teratron.models.hybrid import Symbols, parse_hybrid_pattern
    from teratron.ssm.mamba_mixer import mamba_num_heads

    t, h, s = model.transformer, model.transformer.hidden_size, seq_length
    fb_fma = 3 * 2
    q_size, kv_size = t.kv_channels * t.num_attention_heads, t.kv_channels * t.num_query_groups
    ffn_factor = 3 if t.gated_linear_unit else 2
    heads = mamba_num_heads(t)
    d_inner, groups_state = heads * t.mamba_head_dim, t.mamba_num_groups * t.mamba_state_dim
    per_layer = {
        Symbols.ATTENTION: fb_fma * (h * (q_size + 2 * kv_size) + q_size * s / 2 * 2 + q_size * h),
        Symbols.MLP: fb_fma * h * ffn_factor * t.ffn_hidden_size,
        Symbols.MAMBA: fb_fma * (h * (2 * d_inner + 2 * groups_state + heads) + d_inner * h)
        + 3 * 7 * d_inner * t.mamba_state_dim,
    }
    if t.gdp_layers:
        per_layer[Symbols.MAMBA] = _gated_delta_product_flops(t, heads)
    if t.num_moe_experts:
        moe_ffn = t.moe_ffn_hidden_size * t.moe_router_topk + (t.moe_shared_expert_intermediate_size or 0)
        per_layer[Symbols.MOE] = fb_fma * h * ffn_factor * moe_ffn
    if t.multi_latent_attention:
        per_layer[Symbols.MLA] = _mla_attention_flops(t, s)
    if Symbols.GDN in t.hybrid_layer_pattern:
        qk = t.linear_key_head_dim * t.linear_num_key_heads
        v = t.linear_value_head_dim * t.linear_num_value_heads
        per_layer[Symbols.GDN] = fb_fma * (h * (2 * qk + 2 * v + 2 * t.linear_num_value_heads)
                                           + t.linear_conv_kernel_dim * (2 * qk + v)
                                           + 4 * t.linear_num_value_heads * t.linear_value_head_dim ** 2 + v * h)
    pattern = parse_hybrid_pattern(t.hybrid_layer_pattern)
    layers = sum(per_layer[symbol] for symbol in pattern.layers + pattern.mtp_layers * pattern.mtp_depths)
    mtp_projection = fb_fma * pattern.mtp_depths * (2 * h * h + 3 * h)  # as a GPT model's MTP depths
    return batch_size * s * (layers + mtp_projection + fb_fma * h * model.padded_vocab_size * (1 + pattern.mtp_depths))


def _gated_delta_product_flops(t, heads: int) -> float:
    """Per token, a Gated Delta Product mixer of M = gdp_num_householder substeps, Megatron-LM's
    `gated_delta_product_layer_flops` (d_inner = heads * head_dim, gn = groups * state):
      6 * (h * (M + 1) * (d_inner + gn + heads)   in_proj: z and V_m; K_m and Q; b_m and a
           + D_CONV * (M d_inner + (M + 1) gn)     the depthwise convolution over [V_m; K_m; Q]
           + d_inner * h)                          out_proj
      + 3 * (4 M + 3) * d_inner * state            the rule: per substep k^T S and the rank-one update
                                                   (2 FLOPs each per state entry), per token the decay and
                                                   the readout S q (Megatron's best-case count, not the
                                                   chunked kernels' extra work)"""
    from teratron.ssm.mamba_mixer import D_CONV

    m, h = t.gdp_num_householder, t.hidden_size
    d_inner, gn = heads * t.mamba_head_dim, t.mamba_num_groups * t.mamba_state_dim
    projections = h * (m + 1) * (d_inner + gn + heads) + D_CONV * (m * d_inner + (m + 1) * gn) + d_inner * h
    return 3 * 2 * projections + 3 * (4 * m + 3) * d_inner * t.mamba_state_dim


def _mla_attention_flops(t, s: int) -> float:
    """Per token and layer, Megatron's MLA count (n heads, q_head = qk_head_dim + qk_pos_emb_head_dim):
      6 * (q_lora * (h + n * q_head + 1)   query down and up projections (+1: Megatron's norm term;
                                           without q_lora_rank h * n * q_head)
           + kv_lora * (h + n * (qk_head_dim + v_head_dim) + 1) + h * qk_pos_emb_head_dim
                                           key/value down and up projections, the RoPE key
           + n * v_head_dim * h            output projection
           + n * (q_head + v_head_dim) * s / 2)   QK^T and PV, a causal mask halving the s x s work
    """
    heads, q_head = t.num_attention_heads, t.qk_head_dim + t.qk_pos_emb_head_dim
    h = t.hidden_size
    if t.q_lora_rank is None:
        query = h * heads * q_head
    else:
        query = t.q_lora_rank * (h + heads * q_head + 1)
    key_value = t.kv_lora_rank * (h + heads * (t.qk_head_dim + t.v_head_dim) + 1) + h * t.qk_pos_emb_head_dim
    core = heads * (q_head + t.v_head_dim) * s / 2
    return 3 * 2 * (query + key_value + heads * t.v_head_dim * h + core)


def device_peak_tflops() -> Optional[float]:
    """Dense bf16 peak of this process's GPU, or None (CPU or an unlisted device)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in _PEAK_BF16_TFLOPS.items() if key in name), None)


def peak_memory_gib() -> float:
    """Peak allocated GPU memory (with symmetric memory the caching allocator does not count),
    or on CPU the process's peak resident set size."""
    if torch.cuda.is_available():
        return (torch.cuda.max_memory_allocated() + bytes_outside_allocator()) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def drop_records_after(path: str, iteration: int) -> int:
    """Remove the records at the end of the metrics file whose iteration is past `iteration`
    (what an interrupted run logged after the checkpoint a resume starts from; a torn last line
    too), keeping everything before them: earlier runs that share the file keep their records.
    The shortened file replaces the old one by a rename, so a crash leaves one or the other.
    Returns how many lines were removed."""
    try:
        with open(path) as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    keep = len(lines)
    while keep and _past(lines[keep - 1], iteration):
        keep -= 1
    if keep == len(lines):
        return 0
    replacement = f"{path}.tmp-{os.getpid()}"
    with open(replacement, "w") as f:
        f.writelines(lines[:keep])
    os.replace(replacement, path)
    return len(lines) - keep


def _past(line: str, iteration: int) -> bool:
    """A record after `iteration`, or a line without its newline (the end of a killed writer)."""
    if not line.endswith("\n"):
        return True
    try:
        return json.loads(line)["iteration"] > iteration
    except (ValueError, KeyError, TypeError):
        return False  # not a record of ours: the walk stops here


def _open_metrics_file(path: str):
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return open(path, "a")
    except OSError as e:
        raise OSError(f"--metrics-file {path}: cannot append to it ({e.strerror}); pass a writable "
                      "file path") from None


def _open_tensorboard(path: str):
    from torch.utils.tensorboard import SummaryWriter

    try:
        return SummaryWriter(log_dir=path)
    except OSError as e:
        raise OSError(f"--tensorboard-dir {path}: cannot write there ({e.strerror}); pass a writable "
                      "directory") from None


# Metrics-file key prefix of each evaluated split.
_SPLIT_KEYS = {"validation": "val", "test": "test"}


def _tag(key: str) -> str:
    return key.replace(" ", "_")


class TrainingLogger:
    """Console, metrics-file and TensorBoard output of the training loop."""

    def __init__(self, run, is_logging_rank: bool, start_iteration: int):
        self.run = run
        self.train_iters = run.training.train_iters
        self.enabled = is_logging_rank
        self.world_size = run.distributed.world_size
        self.peak_tflops = device_peak_tflops()
        self.metrics_file = None
        self.writer = None
        self.bar = None
        if not self.enabled:
            return
        log = run.logging
        if log.metrics_file:
            if start_iteration:
                self._drop_records_after(log.metrics_file, start_iteration)
            self.metrics_file = _open_metrics_file(log.metrics_file)
        if log.tensorboard_dir:
            self.writer = _open_tensorboard(log.tensorboard_dir)
        # Without a terminal the log lines already show progress; a bar would only add noise.
        # shutil's width falls back to 80 where a terminal reports 0 columns (tqdm then prints nothing).
        self.bar = tqdm(total=self.train_iters, initial=start_iteration, desc="train", unit="it",
                        ncols=shutil.get_terminal_size().columns,
                        disable=None if log.progress_bar else True)

    @staticmethod
    def _drop_records_after(path: str, iteration: int) -> None:
        try:
            dropped = drop_records_after(path, iteration)
        except OSError as e:
            raise OSError(f"--metrics-file {path}: cannot rewrite it for the resume ({e.strerror}); pass a "
                          "writable file path") from None
        if dropped:
            print(f"--metrics-file {path}: removed {dropped} record(s) past iteration {iteration}, logged "
                  "after the checkpoint this run resumes from", flush=True)

    def print(self, line: str) -> None:
        if self.enabled:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()

    def log_iteration(self, iteration: int, losses: dict, grad_norm, lr: float, elapsed_s: float,
                      iters: int, samples: int, global_batch_size: int, consumed_samples: int,
                      skipped: int, loss_scale: Optional[float] = None,
                      moe_metrics: Optional[dict] = None, max_attention_logit: Optional[float] = None) -> dict:
        """Log the last `iters` iterations, which trained `samples` samples in `elapsed_s` seconds
        (losses and MoE metrics already averaged over them); `skipped` of them skipped their
        step (per window, as Megatron's log line counts them). `max_attention_logit`: the largest
        of the iterations' max attention logits (with qk_clip / log_max_attention_logit)."""
        seq_length = self.run.training.seq_length
        time_per_iter = elapsed_s / max(iters, 1)
        tokens_per_sec = samples * seq_length / elapsed_s
        flops = num_floating_point_operations(self.run.model, seq_length, samples)
        tflops_per_gpu = flops / (elapsed_s * self.world_size * 1e12)
        record = {
            "iteration": iteration,
            "lm_loss": losses.get("lm loss"),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "lr": lr,
            "tokens_per_sec": tokens_per_sec,
            "tflops_per_gpu": tflops_per_gpu,
            "mfu": None if self.peak_tflops is None else tflops_per_gpu / self.peak_tflops,
            "mem_peak_gib": peak_memory_gib(),
            "skipped": skipped,
        }
        record.update({_tag(k): v for k, v in losses.items() if k != "lm loss"})
        record.update(moe_metrics or {})
        if max_attention_logit is not None:
            record["max_attention_logit"] = max_attention_logit
        if not self.enabled:
            return record
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.writer:
            # Scalars only: per-expert token counts (lists) are in the metrics file.
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, iteration)
            self.writer.flush()
        self.print(self._console_line(record, time_per_iter, global_batch_size,
                                      consumed_samples, loss_scale, moe_metrics or {}, losses))
        return record

    def _console_line(self, r, time_per_iter, global_batch_size, consumed_samples, loss_scale, moe_metrics,
                      losses):
        tflops = r["tflops_per_gpu"]
        parts = [
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {r['iteration']:8d}/"
            f"{self.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {time_per_iter * 1000:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.{1 if tflops >= 10 else 3}f}",
            f"tokens/s: {r['tokens_per_sec']:.0f}",
            f"learning rate: {r['lr']:.6E}",
            f"global batch size: {global_batch_size:5d}",
        ]
        if r["lm_loss"] is not None:
            parts.append(f"lm loss: {r['lm_loss']:.6E}")
        parts += [f"{key}: {value:.6E}" for key, value in losses.items() if key != "lm loss"]  # mtp loss
        # The MoE means over layers; the per-layer values go to the metrics file and TensorBoard.
        parts += [f"{key}: {value:.6E}" for key, value in moe_metrics.items() if "_layer_" not in key]
        if loss_scale is not None:
            parts.append(f"loss scale: {loss_scale:.1f}")
        if r["grad_norm"] is not None:
            parts.append(f"grad norm: {r['grad_norm']:.3f}")
        if "max_attention_logit" in r:
            parts.append(f"max attention logit: {r['max_attention_logit']:.3f}")
        parts.append(f"number of skipped iterations: {r['skipped']:3d}")
        return " | ".join(parts) + " |"

    def log_eval(self, iteration: int, losses: dict, split: str = "validation",
                 prefix: Optional[str] = None) -> None:
        """Megatron's " validation loss at {prefix} | ..." line (prefix: "iteration N" unless
        given), TensorBoard scalars under `split/`, and a metrics record of `{key}_{loss}`."""
        if not self.enabled:
            return
        if self.metrics_file:
            key = _SPLIT_KEYS[split]
            record = {"iteration": iteration, **{f"{key}_{_tag(k)}": v for k, v in losses.items()}}
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        pieces = []
        for key, value in losses.items():
            ppl = math.exp(min(20.0, value))
            pieces.append(f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E}")
            if self.writer:
                self.writer.add_scalar(f"{split}/{_tag(key)}", value, iteration)
                self.writer.add_scalar(f"{split}/{_tag(key)}_ppl", ppl, iteration)
        line = f" validation loss at {prefix or f'iteration {iteration}'} | " + " | ".join(pieces)
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))

    def advance(self, iteration: int, loss: Optional[float]) -> None:
        if self.bar is not None:
            self.bar.n = iteration
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics_file:
            self.metrics_file.close()
        if self.writer:
            self.writer.close()
