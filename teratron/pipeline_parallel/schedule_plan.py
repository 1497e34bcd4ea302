"""The order of work on each pipeline rank, and which step every transfer belongs to.

A pipeline of `pp` ranks with `vpp` model chunks each has pp * vpp stages; stage s = chunk * pp +
rank (chunk c of the last rank feeds chunk c + 1 of the first). Each rank runs its forwards F and
backwards B in a fixed order:
- 1F1B (vpp = 1): pp - rank - 1 warm-up forwards, then alternate one forward and one backward,
  then the remaining backwards: at most pp microbatches are in flight on the first rank.
- interleaved 1F1B: microbatches go through the chunks in groups of `group_size` (>= pp):
  group 0 on chunk 0, group 0 on chunk 1, ..., group 1 on chunk 0, ...; backwards visit the
  chunks in reverse. Warm-up is (pp - rank - 1) * 2 + (vpp - 1) * group_size forwards.
- forward only: the forwards in that order.

`plan_pipeline` then simulates all ranks step by step, each running its next action as soon as
its input was produced in an earlier step. Every transfer is assigned to the step in which its
tensor is produced: the producer sends and the neighbour receives in that same step, so each
step's batched p2p pairs up exactly across ranks (no deadlock on NCCL or gloo), while the real
execution stays asynchronous: the plan only fixes which batch each transfer goes in.
"""

from dataclasses import dataclass, field
from typing import NamedTuple, Optional


class Action(NamedTuple):
    """A forward ('F') or backward ('B') of one microbatch on one local model chunk."""

    kind: str
    chunk: int
    microbatch: int


@dataclass
class Step:
    """One rank's share of global step `index`: its action (if any), what it sends and receives.

    sends: directions ('next'/'prev') the action's product goes to (at most one).
    recvs: (direction, Action it feeds on this rank) for each tensor a neighbour produced.
    """

    index: int
    action: Optional[Action] = None
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)


def microbatch_order(num_microbatches: int, num_chunks: int, group_size: int) -> list:
    """Forward order of (chunk, microbatch) pairs on every rank."""
    order = []
    for start in range(0, num_microbatches, group_size):
        group = range(start, min(start + group_size, num_microbatches))
        order += [(chunk, m) for chunk in range(num_chunks) for m in group]
    return order


def rank_actions(pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int,
                 group_size: int, forward_only: bool) -> list:
    """This rank's actions in execution order."""
    order = microbatch_order(num_microbatches, num_chunks, group_size)
    forwards = [Action("F", chunk, m) for chunk, m in order]
    if forward_only:
        return forwards
    backwards = [Action("B", num_chunks - 1 - chunk, m) for chunk, m in order]
    if num_chunks == 1:
        warmup = min(pp_size - pp_rank - 1, num_microbatches)
    else:
        warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * group_size, len(order))
    actions = forwards[:warmup]
    for k in range(len(order) - warmup):
        actions += [forwards[warmup + k], backwards[k]]
    return actions + backwards[len(order) - warmup:]


def _needs(action: Action, rank: int, pp_size: int, num_stages: int) -> list:
    """(kind, stage, microbatch) products this action waits for."""
    stage = action.chunk * pp_size + rank
    if action.kind == "F":
        return [("F", stage - 1, action.microbatch)] if stage > 0 else []
    needs = [("F", stage, action.microbatch)]
    if stage < num_stages - 1:
        needs.append(("B", stage + 1, action.microbatch))
    return needs


def plan_pipeline(pp_size: int, num_chunks: int, num_microbatches: int, group_size: int,
                  forward_only: bool) -> list:
    """For every rank, its list of Steps (steps where it neither computes nor communicates are
    left out)."""
    num_stages = pp_size * num_chunks
    queues = [rank_actions(r, pp_size, num_chunks, num_microbatches, group_size, forward_only)
              for r in range(pp_size)]
    position = [0] * pp_size
    produced: dict = {}
    plans: list = [[] for _ in range(pp_size)]
    step = 0
    while any(position[r] < len(queues[r]) for r in range(pp_size)):
        steps = [Step(step) for _ in range(pp_size)]
        for r in range(pp_size):
            if position[r] == len(queues[r]):
                continue
            action = queues[r][position[r]]
            if all(produced.get(need, step) < step for need in _needs(action, r, pp_size, num_stages)):
                steps[r].action = action
                position[r] += 1
        if not any(s.action for s in steps):
            raise ValueError(
                f"the interleaved schedule cannot order num_microbatches={num_microbatches} over "
                f"pipeline_model_parallel_size={pp_size} x {num_chunks} virtual stages in groups of "
                f"microbatch_group_size_per_vp_stage={group_size}; use a multiple of {group_size} microbatches")
        for r, s in enumerate(steps):
            if s.action is not None:
                _route(s.action, r, steps, pp_size, num_stages)
                produced[(s.action.kind, s.action.chunk * pp_size + r, s.action.microbatch)] = step
        for r, s in enumerate(steps):
            if s.action is not None or s.recvs:
                plans[r].append(s)
        step += 1
    return plans


def _route(action: Action, rank: int, steps: list, pp_size: int, num_stages: int) -> None:
    """Add the transfer of `action`'s product (if a neighbour needs it) to both ends' steps."""
    stage = action.chunk * pp_size + rank
    if action.kind == "F" and stage < num_stages - 1:
        consumer = stage + 1
        steps[rank].sends.append("next")
        steps[consumer % pp_size].recvs.append(("prev", Action("F", consumer // pp_size, action.microbatch)))
    elif action.kind == "B" and stage > 0:
        consumer = stage - 1
        steps[rank].sends.append("prev")
        steps[consumer % pp_size].recvs.append(("next", Action("B", consumer // pp_size, action.microbatch)))
