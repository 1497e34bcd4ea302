"""TopKRouter: score each token against every expert and pick k of them (Megatron semantics).

    logits = x W^T (+ b)        [T, E] (in moe_router_dtype; the bias with add_bias_linear)
    probs, routing_map          top-k by score function, groups, expert bias or QB bias, replay
    capacity                    optional token dropping / padding
    aux losses                  attached to probs with MoEAuxLossAutoScaler (forward unchanged)

Load balancing (`moe_router_load_balancing_type`, a name or a list with one
`moe_aux_loss_coeff` each): aux_loss (per micro-batch), seq_aux_loss (per sequence),
global_aux_loss (token counts of all data-parallel ranks, averaged over the step's
micro-batches), sinkhorn, none, and quantile_balancing (a per-expert bias, no loss; see
`moe_utils.quantile_balancing_estimate` and docs/moe.md). Expert bias and the QB bias are
updated once per step by `update_moe_routers`, which the training loop calls after the
optimizer step.

Sequence partition: under sequence parallelism (TP x CP) or context parallelism a rank holds a
slice of each sequence; token counts of aux losses are summed over that group and each rank's
loss is its share, so the shares add up to the loss of whole sequences.
"""

import contextlib

import torch
import torch.nn.functional as F

from teratron.process_groups import get_pg_size
from teratron.tensor_parallel.batch_invariant import batch_invariant_linear
from teratron.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                               reduce_from_tensor_model_parallel_region)
from teratron.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from teratron.topology import resolve_pg_collection
from teratron.transformer.moe.moe_logging import num_tracked_layers, save_to_aux_losses_tracker
from teratron.transformer.moe.moe_utils import (MoEAuxLossAutoScaler, apply_router_token_dropping,
                                                compute_routing_scores_for_aux_loss,
                                                quantile_balancing_estimate, sinkhorn,
                                                switch_load_balancing_loss_func,
                                                topk_routing_with_score_function, widen, z_loss_func)
from teratron.transformer.moe.router_replay import RouterReplay

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
QUANTILE_BALANCING = "quantile_balancing"


def _sum_over(value, group):
    if get_pg_size(group) == 1:
        return value
    return reduce_from_tensor_model_parallel_region(value, group)


class _RandomLogits(torch.autograd.Function):
    """Random logits forward, identity backward (moe_router_force_load_balancing benchmarks);
    drawn from the expert-parallel RNG stream when it is seeded, so EP ranks differ."""

    @staticmethod
    def forward(ctx, logits):
        tracker, name = get_cuda_rng_tracker(), get_expert_parallel_rng_tracker_name()
        with tracker.fork(name) if name in tracker.get_states() else contextlib.nullcontext():
            return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _param_device(config):
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class TopKRouter(torch.nn.Module):
    """[s, b, h] -> (probs [s*b, E], routing_map [s*b, E] bool)."""

    def __init__(self, config, pg_collection=None):
        super().__init__()
        self.config = config
        self.topk = config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self.score_function = config.moe_router_score_function
        types = config.moe_router_load_balancing_type
        self.routing_types = list(types) if isinstance(types, list) else [types]
        pg = resolve_pg_collection(pg_collection)
        self.seq_group = pg.tp_cp if config.sequence_parallel else pg.cp
        self.dp_group = pg.dp
        self.layer_number = None
        self.replay = RouterReplay()
        self._check_config()

        device = _param_device(config)
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts, config.hidden_size,
                                                     dtype=config.params_dtype, device=device))
        # A bias on the logits with add_bias_linear (Megatron's; gpt-oss's router has one).
        self.bias = None
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.empty(self.num_experts, dtype=config.params_dtype, device=device))
        for param in (p for p in (self.weight, self.bias) if p is not None):
            if config.perform_initialization:
                master = torch.empty(param.shape, dtype=torch.float32, device=device)
                config.init_method(master)
                with torch.no_grad():
                    param.copy_(master)
            param.sequence_parallel = config.sequence_parallel

        zeros = lambda: torch.zeros(self.num_experts, dtype=torch.float32, device=device)  # noqa: E731
        scalar = lambda: torch.zeros((), dtype=torch.float32, device=device)  # noqa: E731
        biased = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", zeros() if biased else None)
        self.register_buffer("local_tokens_per_expert", zeros() if biased else None, persistent=False)
        balanced = QUANTILE_BALANCING in self.routing_types
        self.register_buffer("qb_beta", zeros() if balanced else None)
        self.register_buffer("qb_beta_accum", zeros() if balanced else None, persistent=False)
        self.register_buffer("qb_beta_count", scalar() if balanced else None, persistent=False)
        global_aux = self.get_aux_loss_coeff("global_aux_loss") > 0
        self.register_buffer("global_tokens_per_expert", zeros() if global_aux else None, persistent=False)
        self.register_buffer("ga_steps", scalar() if global_aux else None, persistent=False)

    def _check_config(self):
        config, types = self.config, self.routing_types
        unknown = set(types) - {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none",
                                QUANTILE_BALANCING}
        if unknown:
            raise ValueError(f"moe_router_load_balancing_type {sorted(unknown)} is not supported")
        special = [t for t in types if t in ("sinkhorn", QUANTILE_BALANCING)]
        if special and self.is_aux_loss_enabled():
            raise ValueError(f"moe_router_load_balancing_type {special[0]!r} balances without an aux "
                             "loss; set the other types' moe_aux_loss_coeff to 0")
        if QUANTILE_BALANCING in types:
            if not self.topk < self.num_experts:
                raise ValueError("quantile_balancing needs moe_router_topk < num_moe_experts")
            if config.moe_router_group_topk or config.moe_router_enable_expert_bias:
                raise ValueError("quantile_balancing is its own per-expert bias; unset "
                                 "moe_router_group_topk and moe_router_enable_expert_bias")
        if config.moe_router_group_topk:
            per_group = self.topk // config.moe_router_group_topk
            if not 1 <= per_group <= self.num_experts // config.moe_router_num_groups:
                raise ValueError(
                    f"moe_router_topk ({self.topk}) // moe_router_group_topk "
                    f"({config.moe_router_group_topk}) experts per chosen group must be between 1 and "
                    f"the group size ({self.num_experts // config.moe_router_num_groups})")

    def set_layer_number(self, layer_number):
        self.layer_number = layer_number

    def _apply(self, fn, *args, **kwargs):
        """Keep the routing state in fp32 when the model is cast to bf16/fp16: bias updates of
        1e-3 would vanish in low precision."""
        super()._apply(fn, *args, **kwargs)
        for name, buffer in self._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """The moe_aux_loss_coeff of `aux_loss_type`, 0.0 when that type is not configured."""
        coeffs = self.config.moe_aux_loss_coeff
        coeffs = coeffs if isinstance(coeffs, list) else [coeffs]
        for kind, coeff in zip(self.routing_types, coeffs):
            if kind == aux_loss_type:
                return coeff
        return 0.0

    def is_aux_loss_enabled(self) -> bool:
        return any(self.get_aux_loss_coeff(t) > 0 for t in ("aux_loss", "seq_aux_loss", "global_aux_loss"))

    # ----- forward ------------------------------------------------------------------------------

    @torch.compiler.disable
    def forward(self, hidden_states):
        """[s, b, h] -> (probs [T, E], routing_map [T, E]), T = s * b. Outside torch.compile (a
        `--torch-compile` layer calls it as is): the router reads its layer number and the global
        metrics tracker, both of which differ per layer, so traced they would recompile the shared
        layer code once per layer until Dynamo gives up; its work is a small GEMM and a top-k."""
        seq_length, bsz = hidden_states.shape[:2]
        hidden_states = self.apply_input_jitter(hidden_states)
        logits = self.gating(hidden_states).view(-1, self.num_experts)
        if self.config.moe_router_force_load_balancing:
            logits = _RandomLogits.apply(logits)
        return self.routing(logits, seq_length, bsz)

    def gating(self, hidden_states):
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, hidden_states.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if self.config.batch_invariant_mode:
            return batch_invariant_linear(F.linear, hidden_states.to(dtype), self.weight.to(dtype), bias)
        return F.linear(hidden_states.to(dtype), self.weight.to(dtype), bias)

    def apply_input_jitter(self, hidden_states):
        """Multiply the router input by U(1 - eps, 1 + eps) noise while training."""
        eps = self.config.moe_input_jitter_eps
        if eps is None or not self.training:
            return hidden_states
        return hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - eps, 1.0 + eps)

    def routing(self, logits, seq_length: int, bsz: int):
        """logits [T, E] -> (probs [T, E], routing_map [T, E])."""
        config = self.config
        training = self.training and torch.is_grad_enabled()
        logits = self.apply_z_loss(logits)
        replayed = self.replay.next_indices(logits.device, self.training)
        if "sinkhorn" in self.routing_types:
            probs, routing_map, top_indices = self.sinkhorn_load_balancing(logits, replayed)
        elif QUANTILE_BALANCING in self.routing_types:
            probs, routing_map, top_indices = self.quantile_balancing(logits, replayed)
        else:
            probs, routing_map, top_indices = topk_routing_with_score_function(
                logits, self.topk, use_pre_softmax=config.moe_router_pre_softmax,
                num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                scaling_factor=config.moe_router_topk_scaling_factor,
                score_function=self.score_function, expert_bias=self.expert_bias, top_indices=replayed)
        self.replay.record(top_indices)
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, config.moe_expert_capacity_factor,
                config.moe_token_drop_policy, config.moe_pad_expert_input_to_capacity)
        if training and self.is_aux_loss_enabled():
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function)
            probs = self._apply_aux_loss(probs, aux_scores, aux_map)
            probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz)
            probs = self._apply_global_aux_loss(probs, aux_scores, aux_map)
        if training:
            tokens_per_expert = routing_map.sum(dim=0)
            save_to_aux_losses_tracker("tokens_per_expert", tokens_per_expert, self.layer_number,
                                       num_tracked_layers(config))
            if self.expert_bias is not None:
                with torch.no_grad():
                    self.local_tokens_per_expert += tokens_per_expert
        return probs, routing_map

    def sinkhorn_load_balancing(self, logits, top_indices=None):
        """Choose by Sinkhorn-balanced logits while training (top-k of the scores otherwise);
        weight by sigmoid (k = 1) or softmax of the logits."""
        if self.topk == 1:
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(widen(logits), dim=-1).type_as(logits)
        if top_indices is None:
            with torch.no_grad():
                choice = sinkhorn(logits.float()) if self.training else scores
                top_indices = torch.topk(choice, k=self.topk, dim=-1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
        return scores * routing_map, routing_map, top_indices

    def quantile_balancing(self, logits, top_indices=None):
        """Choose the top-k of score - qb_beta; weight as the score function does without bias.
        While training, add this micro-batch's QB estimate (over the whole sequences: the scores
        are gathered over the sequence partition) to the step's accumulator."""
        if self.score_function == "softmax":
            scores = torch.softmax(widen(logits.detach()), dim=-1)
        else:
            scores = torch.sigmoid(widen(logits.detach()))
        if top_indices is None:
            top_indices = (scores - self.qb_beta).topk(self.topk, dim=-1).indices
        if self.training and torch.is_grad_enabled():
            if get_pg_size(self.seq_group) > 1:
                scores = gather_from_sequence_parallel_region(scores, False, self.seq_group)
            self.qb_beta_accum += quantile_balancing_estimate(scores, self.topk, self.qb_beta)
            self.qb_beta_count += 1
        return topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            score_function=self.score_function, top_indices=top_indices)

    # ----- losses -------------------------------------------------------------------------------

    def apply_z_loss(self, logits):
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        z_loss = z_loss_func(logits, coeff / get_pg_size(self.seq_group))
        save_to_aux_losses_tracker("z_loss", z_loss / coeff, self.layer_number, num_tracked_layers(self.config))
        if self.config.calculate_per_token_loss:
            z_loss = z_loss * logits.shape[0]
        return MoEAuxLossAutoScaler.apply(logits, z_loss)

    def _apply_aux_loss(self, probs, scores, aux_map):
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert = _sum_over(aux_map.sum(dim=0), self.seq_group)
        total = aux_map.shape[0] * get_pg_size(self.seq_group)
        aux_loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total, self.topk,
                                                   self.num_experts, coeff)
        return self._attach(probs, coeff, aux_loss, "load_balancing_loss")

    def _apply_seq_aux_loss(self, probs, scores, aux_map, seq_length: int, bsz: int):
        """The aux loss of each sequence, averaged over the batch: columns (b, e) of the
        [s, b*E] views are one sequence's expert e."""
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert = _sum_over(aux_map.reshape(seq_length, -1).sum(dim=0), self.seq_group)
        total = seq_length * get_pg_size(self.seq_group)
        aux_loss = switch_load_balancing_loss_func(scores.reshape(seq_length, -1), tokens_per_expert,
                                                   total, self.topk, self.num_experts, coeff) / bsz
        return self._attach(probs, coeff, aux_loss, "seq_load_balancing_loss")

    def _apply_global_aux_loss(self, probs, scores, aux_map):
        """The aux loss with token counts of the whole data-parallel batch, averaged over the
        micro-batches seen this step."""
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert = _sum_over(_sum_over(aux_map.sum(dim=0), self.seq_group), self.dp_group)
        with torch.no_grad():
            self.global_tokens_per_expert += tokens_per_expert
            self.ga_steps += 1
        total = aux_map.shape[0] * get_pg_size(self.seq_group) * get_pg_size(self.dp_group)
        aux_loss = switch_load_balancing_loss_func(scores, self.global_tokens_per_expert / self.ga_steps,
                                                   total, self.topk, self.num_experts, coeff)
        return self._attach(probs, coeff, aux_loss, "global_load_balancing_loss")

    def _attach(self, probs, coeff, aux_loss, name):
        save_to_aux_losses_tracker(name, aux_loss / coeff, self.layer_number, num_tracked_layers(self.config))
        if self.config.calculate_per_token_loss:
            # The per-token schedule divides grads by the global token count: undo it for the aux
            # loss, which is already a per-token mean.
            aux_loss = aux_loss * probs.shape[0]
        return MoEAuxLossAutoScaler.apply(probs, aux_loss)


def _routers(model_chunks):
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


@torch.no_grad()
def update_moe_routers(model_chunks) -> None:
    """Once per step, after the optimizer step (every rank, same model): move each expert bias
    by +-moe_router_bias_update_rate towards the mean load of the step's global token counts
    (summed over sequence partitions and data-parallel ranks), set each quantile-balancing bias
    from the step's estimates (averaged over micro-batches and data-parallel ranks, blended with
    moe_router_quantile_balancing_ema, centred), and restart global-aux-loss counting. A frozen
    router (--freeze-base-model-for-mtp) keeps its biases; its counts restart."""
    routers = _routers(model_chunks)
    if not routers:
        return
    first = routers[0]
    for router in routers:
        if not router.weight.requires_grad:
            _restart_counts(router)
    routers = [r for r in routers if r.weight.requires_grad]
    biased = [r for r in routers if r.expert_bias is not None]
    if biased:
        counts = torch.stack([r.local_tokens_per_expert for r in biased])
        counts = _sum_over(_sum_over(counts, first.seq_group), first.dp_group)
        offsets = torch.sign(counts.mean(dim=-1, keepdim=True) - counts)
        for router, offset in zip(biased, offsets):
            router.expert_bias += offset * router.config.moe_router_bias_update_rate
            router.local_tokens_per_expert.zero_()
    balanced = [r for r in routers if r.qb_beta is not None and r.qb_beta_count > 0]
    if balanced:
        estimates = torch.stack([r.qb_beta_accum / r.qb_beta_count for r in balanced])
        estimates = _sum_over(estimates, first.dp_group) / get_pg_size(first.dp_group)
        for router, estimate in zip(balanced, estimates):
            ema = router.config.moe_router_quantile_balancing_ema
            beta = ema * router.qb_beta + (1.0 - ema) * estimate
            router.qb_beta.copy_(beta - beta.mean())
            router.qb_beta_accum.zero_()
            router.qb_beta_count.zero_()
    for router in routers:
        if router.global_tokens_per_expert is not None:
            router.global_tokens_per_expert.zero_()
            router.ga_steps.zero_()


def _restart_counts(router) -> None:
    """What a step counted, dropped: a frozen router's statistics move nothing."""
    for counts in (router.local_tokens_per_expert, router.qb_beta_accum, router.qb_beta_count,
                   router.global_tokens_per_expert, router.ga_steps):
        if counts is not None:
            counts.zero_()
