"""QK-clip (Kimi K2's MuonClip, Megatron's `clip_qk`) and the model's max attention logit.

    qk_clip = QKClip(model_chunks, config)              # config.qk_clip or log_max_attention_logit
    optimizer.register_param_update_hook(qk_clip.clip)  # with config.qk_clip
    ...forward-backward...
    max_logit = qk_clip.reduce()                        # every rank, every step, before optimizer.step()
    optimizer.step()                                    # clips after the update, before the param all-gather

Core attention records, in training forwards, the largest pre-softmax logit of each of its heads
(`DotProductAttention.current_max_attn_logits`). `reduce` takes them, max-reduces them over the
data- and context-parallel ranks (tensor-parallel ranks hold other heads, pipeline stages other
layers, so those need no reduction for clipping), and resets the records; the model's largest
logit, which it returns for logging, is further max-reduced over tensor and pipeline ranks, so
every rank holds the same value. `clip` then asks each attention for the factors of its
query and key rows (`qk_clip_scales`: eta = threshold / max logit for the heads over
qk_clip_threshold, queries scaled by eta ** alpha and keys by eta ** (1 - alpha); MLA's RoPE
query rows by eta) and has the optimizer scale its main params and refresh the model params
from them (`scale_param_rows`), so fp32 masters, the distributed optimizer's shards and the bf16
weights agree. Nothing waits for the device: heads within the threshold get the factor 1.
"""

import torch
import torch.distributed as dist

from teratron.optimizer.clip_grads import all_reduce_over_groups, default_device
from teratron.topology import resolve_pg_collection


def attention_modules(model_chunks) -> list:
    """The modules of `model_chunks` whose core attention records max logits, in order."""
    return [module for chunk in model_chunks for module in chunk.modules()
            if hasattr(getattr(module, "core_attention", None), "current_max_attn_logits")]


class QKClip:
    """The max-logit records of `model_chunks`' attentions, reduced each step, and the clip."""

    def __init__(self, model_chunks, config, pg_collection=None):
        pg = resolve_pg_collection(pg_collection)
        self.config = config
        self.dp_cp, self.mp = pg.dp_cp, pg.mp
        self.attentions = attention_modules(model_chunks)
        if config.qk_clip:
            for attention in self.attentions:
                if not hasattr(attention, "qk_clip_scales"):
                    raise NotImplementedError(f"qk_clip: {type(attention).__name__} does not say how to clip its "
                                              "query and key weights (qk_clip_scales); turn qk_clip off")
        self.max_logits = None  # [this rank's attentions, their heads] after reduce()

    @torch.no_grad()
    def reduce(self) -> torch.Tensor:
        """Take the step's max logits (a collective: call it on every rank each step); returns
        the largest logit of the whole model, a device scalar (-inf if no head saw a key)."""
        records = [attention.core_attention.current_max_attn_logits for attention in self.attentions]
        if records:
            self.max_logits = torch.stack([record.float() for record in records])
            for record in records:
                record.fill_(float("-inf"))
            all_reduce_over_groups(self.max_logits, [self.dp_cp], dist.ReduceOp.MAX)
            largest = self.max_logits.max()
        else:  # a pipeline stage without attention layers
            self.max_logits = None
            largest = torch.tensor(float("-inf"), device=default_device())
        return all_reduce_over_groups(largest, [self.mp], dist.ReduceOp.MAX)

    @torch.no_grad()
    def clip(self, optimizer) -> None:
        """Scale the query and key weights of the heads whose max logit (last `reduce`) exceeds
        qk_clip_threshold; registered as `optimizer`'s param-update hook."""
        if self.max_logits is None:
            return
        factors = {}
        for attention, max_logits in zip(self.attentions, self.max_logits):
            factors.update(attention.qk_clip_scales(max_logits))
        optimizer.scale_param_rows(factors)
