"""The optimizer's sharded state: every per-parameter state in the parameter's own global layout.

    optimizer.state.<name>.<param key>    exp_avg, exp_avg_sq, momentum_buffer, ... sharded like
                                          the parameter (TP shard, or a distributed-optimizer
                                          flat slice of it); 0-d states (Adam's step) replicated
    optimizer.state.fp32_param.<key>      fp32 master weights, where the optimizer keeps them

Because the keys and global shapes do not depend on the layout, optimizer state saved with one
TP/PP/DP/EP layout, with or without the distributed optimizer, loads into any other. Param-group
hyper-parameters and the loss scaler go into the common state.
"""

import torch

from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor

PREFIX = "optimizer.state."


def _state_items(name, key, value, main, param, layout, flat):
    full_key = f"{PREFIX}{name}.{key}"
    if not isinstance(value, torch.Tensor):
        return [ShardedObject(full_key, value)]
    if value.shape == main.shape and value.dim() > 0:
        kwargs = dict(flat_range=flat, local_shape=tuple(param.shape)) if flat is not None else {}
        return layout.items(full_key, value.detach(), **kwargs)
    return [ShardedTensor(full_key, value.detach(), tuple(value.shape), (0,) * value.dim(), replica=layout.replica)]


def optimizer_sharded_items(optimizer, layouts) -> list:
    """Items of every optimizer state of this rank (views into the live state)."""
    items = []
    for opt in optimizer.chained_optimizers:
        for param, main, flat in opt.main_param_shards():
            layout = layouts[param]
            states = {} if main is param else {"fp32_param": main}
            states.update(opt.state.get(main, {}))
            for name, value in states.items():
                items += _state_items(name, layout.key, value, main, param, layout, flat)
    return items


def saved_state_names(saved: dict) -> dict:
    """param key -> {state name: saved global shape (None for an object)} from the saved keys."""
    names = {}
    for full_key, shape in saved.items():
        if full_key.startswith(PREFIX):
            name, key = full_key[len(PREFIX):].split(".", 1)
            names.setdefault(key, {})[name] = shape
    return names


def prepare_for_load(optimizer, layouts, saved: dict) -> tuple:
    """Create the state entries the checkpoint holds (torch optimizers make them lazily), then
    return (items to load, whether any master weights must be refreshed from the model, the keys of
    this rank's parameters without stepped state (moments, step count) while others have theirs:
    frozen when it was saved (MTP-only training), or another model's state; `report_fresh_states`)."""
    by_key = saved_state_names(saved)
    stepped = {key for key, names in by_key.items() if set(names) - {"fp32_param"}}
    refresh_masters, missing = False, []
    for opt in optimizer.chained_optimizers:
        on_device = _stepped_on_device(opt)
        for param, main, _ in opt.main_param_shards():
            names = by_key.get(layouts[param].key, {})
            if stepped and layouts[param].key not in stepped:
                missing.append(layouts[param].key)
            if main is not param and "fp32_param" not in names:
                refresh_masters = True
            state = opt.state.setdefault(main, {})
            for name, shape in names.items():
                if name == "fp32_param" or name in state:
                    continue
                if shape is None:
                    state[name] = None
                elif len(shape) == 0:  # a step count
                    state[name] = _step_tensor(main, 0.0, on_device)
                else:
                    state[name] = torch.zeros_like(main)
    items = [i for i in optimizer_sharded_items(optimizer, layouts) if i.key in saved]
    return items, refresh_masters, missing


def report_fresh_states(where: str, missing: list) -> None:
    """Say (first rank) which parameters start with fresh optimizer state: `prepare_for_load`'s missing
    keys of every rank (a collective)."""
    import torch.distributed as dist

    from teratron.dist_checkpointing.serialization import all_gather_objects

    every = sorted({key for keys in all_gather_objects(missing) for key in keys})
    if every and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"NOTE: {where} holds no optimizer state for {len(every)} of the model's parameters ({every[0]}"
              f"{', ...' if len(every) > 1 else ''}) while it holds the others': theirs start fresh (frozen when it "
              "was saved, e.g. MTP-only training; else it is another model's state)", flush=True)


def _stepped_on_device(opt) -> set:
    """ids of the parameters torch's fused (or capturable) kernels step: their step counts live on
    the parameter's device, the others' on the CPU."""
    return {id(p) for g in opt.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]}


def _step_tensor(main, value: float, on_device: set) -> torch.Tensor:
    """A step count for `main`'s state (`on_device`: `_stepped_on_device` of its optimizer)."""
    return torch.tensor(value, dtype=torch.float32, device=main.device if id(main) in on_device else "cpu")


def step_count(optimizer) -> float:
    """The optimizer's step count (Adam's `step`; 0 before the first step or without one)."""
    steps = [float(state["step"]) for opt in optimizer.chained_optimizers for state in opt.state.values()
             if "step" in state]
    return max(steps, default=0.0)


def set_step_count(optimizer, step: float) -> None:
    """Give every parameter with state (Adam's moments) the step count `step`: a checkpoint that
    keeps one count for all (Megatron-LM's param groups) restored into torch's per-parameter one."""
    for opt in optimizer.chained_optimizers:
        on_device = _stepped_on_device(opt)
        for main, state in opt.state.items():
            if state and any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in state.values()):
                state["step"] = _step_tensor(main, step, on_device)


# Param groups are matched by what they mean, not by position: the split into chained
# optimizers (dense / expert) depends on the layout (experts are separate only under EP > 1).
GROUP_SIGNATURE = ("wd_mult", "lr_mult", "is_decoupled_lr")
# How torch runs the step, chosen from this run's devices, not a hyper-parameter to restore.
IMPLEMENTATION_KEYS = ("params", "is_expert_parallel", "fused", "foreach", "capturable", "differentiable")


def signed_groups(optimizer):
    """(signature, param group): the signature is the torch optimizer's class and the group's
    meaning (Muon and its scalar optimizer have groups of the same meaning)."""
    for opt in optimizer.chained_optimizers:
        for group in opt.param_groups:
            yield (type(opt.optimizer).__name__,) + tuple(group.get(k) for k in GROUP_SIGNATURE), group


def optimizer_common_state(optimizer) -> dict:
    """Param-group hyper-parameters (by group signature) and the shared loss scaler's state."""
    groups = {signature: {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS}
              for signature, group in signed_groups(optimizer)}
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler is not None else None
    return {"param_groups": groups, "grad_scaler": scaler}


def load_optimizer_common_state(optimizer, common: dict, source: str) -> None:
    saved = common["param_groups"]
    for signature, group in signed_groups(optimizer):
        if signature not in saved:
            raise ValueError(f"{source}: the checkpoint has no {signature[0]} parameter group with "
                             f"{dict(zip(GROUP_SIGNATURE, signature[1:]))}; use the optimizer settings "
                             "it was saved with, or --no-load-optim")
        group.update({k: v for k, v in saved[signature].items() if k not in IMPLEMENTATION_KEYS})
    if optimizer.grad_scaler is not None and common["grad_scaler"] is not None:
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
