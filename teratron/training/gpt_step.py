"""One GPT micro-batch: fetch it, run the model, define its loss (Megatron's pretrain_gpt.py)."""

from functools import partial

import torch

from teratron.packed_seq_params import packed_rows
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection
from teratron.training.telemetry import NO_TELEMETRY
from teratron.transformer.context_parallel import cp_token_index
from teratron.transformer.multi_token_prediction import pop_mtp_losses
from teratron.utils import HostCopy


def get_batch(data_iterator, device, pg_collection=None):
    """Next micro-batch as tensors on `device`, cut to this context-parallel rank's tokens
    (`get_batch_on_this_cp_rank`). Every rank of a data-parallel replica reads the same samples
    (the sampler is keyed by DP rank only), so nothing is broadcast. In particular every pipeline
    stage (and virtual stage, from its own iterator) gets the batch's position_ids and documents,
    which RoPE and attention need in the middle of the model too when --reset-position-ids /
    --reset-attention-mask make them differ from the default. Documents (the samples'
    `cu_seqlens`, or a packed micro-batch's own) become the batch's "packed_seq_params"."""
    batch = next(data_iterator)
    packed = batch.get("packed_seq_params")  # a packed 'thd' micro-batch (--sequence-packing)
    if "cu_seqlens" in batch:  # rows with documents (--reset-attention-mask)
        packed = packed_rows(batch["cu_seqlens"])
    batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()
             if isinstance(value, torch.Tensor) and key != "cu_seqlens"}
    if packed is not None:
        batch["packed_seq_params"] = packed.to(device)
    return get_batch_on_this_cp_rank(batch, resolve_pg_collection(pg_collection).cp)


def get_batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """Megatron's: the micro-batch's [b, s] tensors cut to this CP rank's tokens, chunks r and
    2 x CP - 1 - r of the 2 x CP chunks of every row (of every document of a packed 'thd'
    batch). The packed documents stay whole: attention needs to know where every token sits."""
    cp_size = get_pg_size(cp_group)
    if cp_size == 1:
        return batch
    if "attention_mask" in batch:
        raise ValueError("context parallelism takes no dense attention mask; documents come as packed sequences "
                         "(--reset-attention-mask) and causal attention needs no mask")
    tokens, packed = batch["tokens"], batch.get("packed_seq_params")
    bounds = packed.boundaries.tolist() if packed is not None and packed.qkv_format == "thd" else None
    index = cp_token_index(tokens.shape[1], cp_size, get_pg_rank(cp_group), bounds, device=tokens.device)
    return {key: value.index_select(1, index) if isinstance(value, torch.Tensor) and value.shape == tokens.shape
            else value for key, value in batch.items()}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, mtp_losses=()):
    """(sum of masked per-token losses, token count, log) for one micro-batch.

    The schedule turns the sum into the micro-batch mean; the log keeps [sum, count] so the
    training loop can average over micro-batches and data-parallel ranks by tokens. The
    multi-token-prediction depths' [sum, count] (`mtp_losses`, already in the gradient through
    the model's output) are logged as "mtp_{k} loss".
    """
    losses = output_tensor.float().reshape(-1)  # [b * s]
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}
    report.update({f"mtp_{k} loss": depth for k, depth in enumerate(mtp_losses, 1)})
    return loss, num_tokens, report


def forward_step(data_iterator, model, device, pg_collection=None, telemetry=NO_TELEMETRY):
    """Megatron's forward_step_func: (output_tensor, loss_func bound to this batch's mask and,
    on the stage holding them, its multi-token-prediction losses). `telemetry` spans the batch's
    fetch ("data") and the forward ("forward")."""
    with telemetry.span("data"):
        batch = get_batch(data_iterator, device, pg_collection)
    pop_mtp_losses()  # none left by a forward outside this schedule
    with telemetry.span("forward"):
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                       labels=batch["labels"], loss_mask=batch["loss_mask"],
                       packed_seq_params=batch.get("packed_seq_params"))
    return output, partial(loss_func, batch["loss_mask"], mtp_losses=pop_mtp_losses())


def reduce_log_dicts(log_dicts: list, device, on_host: bool = True, pg_collection=None) -> dict:
    """Average the schedule's per-micro-batch logs over micro-batches and data-parallel ranks.

    [sum, count] pairs are averaged by count; anything else by micro-batch. Call on every rank of
    the last pipeline stage; returns {} elsewhere. Floats, or with on_host=False 0-d device
    tensors (no wait for the GPU; `LossesInFlight` brings them to the host later).
    """
    if not log_dicts:
        return {}
    keys = sorted(log_dicts[0])
    totals = []
    for key in keys:
        values = torch.stack([d[key].detach().float().reshape(-1) for d in log_dicts]).to(device)
        totals.append(values.sum(0) if values.shape[1] == 2 else
                      torch.stack([values.mean(), torch.ones((), device=device)]))
    stacked = torch.stack(totals)  # [keys, 2]
    group = resolve_pg_collection(pg_collection).dp_cp
    if group is not None:
        torch.distributed.all_reduce(stacked, group=group)
    means = _with_mtp_mean(dict(zip(keys, stacked[:, 0] / stacked[:, 1])))
    return LossesInFlight(means).get() if on_host else means


def _with_mtp_mean(means: dict) -> dict:
    """"mtp loss": the mean over the depths' "mtp_{k} loss" (which stay with two or more depths)."""
    depths = [key for key in means if key.startswith("mtp_") and key.endswith(" loss")]
    if not depths:
        return means
    out = {key: value for key, value in means.items() if key not in depths or len(depths) > 1}
    out["mtp loss"] = torch.stack([means[key] for key in depths]).mean()
    return out


class LossesInFlight:
    """reduce_log_dicts' device tensors, and optionally a device flag, on their way to the host
    (`HostCopy`): queued before the optimizer step, waited for after it, so the GPU goes from the
    backward to the optimizer and on to the next step without idling while the host checks and
    logs."""

    def __init__(self, losses: dict, flag: torch.Tensor | None = None):
        self.keys = list(losses)
        values = [v.reshape(()).float() for v in losses.values()]
        if flag is not None:
            values.append(flag.reshape(()).float())
        self.has_flag = flag is not None
        self.flag = False   # the flag's value, after get()
        self.copy = HostCopy(torch.stack(values)) if values else None

    def get(self) -> dict:
        """{key: float}; sets `self.flag`."""
        values = self.copy.get() if self.copy is not None else []
        if self.has_flag:
            self.flag = bool(values.pop())
        return dict(zip(self.keys, values))
