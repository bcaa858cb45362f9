"""Pipeline schedules as data: for every rank, the ordered list of actions it executes in one step.

    schedule = build_schedule("1f1b", stages=4, micro_batches=8)
    schedule.actions[rank]   # (RECV_F0@s1, F0@s1, SEND_F0@s1, ...)

An action is (kind, stage, micro-batch), its kind an `ActionKind`. Compute kinds: `F` forward; `B`
backward — the input gradient and, unless the schedule splits the backward, the weight gradient too; `W` the
weight gradient of a split backward (ZB-H1, ZB-V, DualPipeV). Communication kinds: `SEND_F`/`RECV_F` carry
activations from stage s to s+1, `SEND_B`/`RECV_B` carry their gradients back. An action prints as kind, micro-batch and
stage: `F3@s1`. A schedule generator only orders the compute actions of
each rank, in steps (one compute; or Megatron's F + B pair in the interleaved steady state);
`with_communication` then places every send right after the step that produces it and every receive
right before the step that needs it, so each gap between two steps holds one run of communication
actions, which the runtime posts together (one batched isend/irecv).

Stage s of S = p·v lives on rank s % p as its chunk s // p (Megatron's interleaved layout): with v = 1
stage s is rank s; with v = 2 and p = 4 rank 1 holds stages 1 and 5.

[Note: why sends and receives of one gap are one batch]
1F1B's steady state on two neighbours is "rank 0: send activation i+1, then receive gradient i" and
"rank 1: send gradient i, then receive activation i+1". On NCCL a send may block until its receive is
posted, and operations on one communicator run in order, so issued one by one both ranks would wait on
their send forever. Posted as one batch per gap, each batch completes. `validate.simulate` checks every
schedule under exactly these rendezvous semantics.
"""

from __future__ import annotations

from paratrain.parallel.pp.actions import (  # noqa: F401 (the vocabulary, re-exported for the schedules' users)
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    V_SCHEDULES,
    Action,
    ActionKind,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    partial_backwards,
    placement_of,
    rank_of_stage,
    sends_first,
    stages_of_rank,
)
from paratrain.parallel.pp.v_schedules import v_forwards, v_schedule_actions


# ---- compute orders per schedule -------------------------------------------------------------------
def _gpipe(p: int, m: int, forward_only: bool) -> list[list[Action]]:
    out = []
    for r in range(p):
        order = [Action(F, r, i) for i in range(m)]
        if not forward_only:
            order += [Action(B, r, i) for i in range(m)]
        out.append(order)
    return out


def _one_f_one_b(p: int, m: int) -> list[list[Action]]:
    out = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(F, r, warmup + i), Action(B, r, i)]
        order += [Action(B, r, i) for i in range(m - warmup, m)]
        out.append(order)
    return out


def _interleaved(p: int, v: int, m: int) -> list[list[list[Action]]]:
    """Megatron's interleaved 1F1B: micro-batches go through the rank's chunks in groups of p. Returns
    steps per rank: each warm-up F, each steady-state (F, B) pair and each cool-down B is a step."""
    total = m * v

    def forward(r: int, k: int) -> Action:
        chunk = (k // p) % v
        return Action(F, chunk * p + r, (k // (p * v)) * p + k % p)

    def backward(r: int, k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action(B, chunk * p + r, (k // (p * v)) * p + k % p)

    out = []
    for r in range(p):
        # With m = p a steady-state step would wait for an activation that the same step of its upstream
        # sends only after its backward; as Megatron does, every forward then runs first.
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        steps = [[forward(r, k)] for k in range(warmup)]
        steps += [[forward(r, warmup + k), backward(r, k)] for k in range(total - warmup)]
        steps += [[backward(r, k)] for k in range(total - warmup, total)]
        out.append(steps)
    return out


def _zb_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 by list scheduling in unit time slots (F = B = W = 1). Whenever a rank is free it runs a
    ready B (the critical path), else a ready F while it holds fewer than p - rank micro-batches between
    F and B (1F1B's activation limit), else a pending W. A rank holding p weight gradients to compute
    runs one before anything else, which bounds the memory W keeps alive (each pending W holds its
    layers' inputs and output gradients). The weight gradients so fill the slots where 1F1B waits for
    gradients: p − 1 idle slots per rank instead of 3(p − 1) (Qi et al., 2023, "Zero Bubble Pipeline
    Parallelism")."""
    done_f = [[-1] * m for _ in range(p)]  # time the F of (rank, micro) ends; -1 = not yet
    done_b = [[-1] * m for _ in range(p)]
    next_f, next_b, next_w = [0] * p, [0] * p, [0] * p
    order: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(next_w[r] < m for r in range(p)):
        for r in range(p):
            f, b = next_f[r], next_b[r]
            b_ready = b < f and 0 <= done_f[r][b] <= t and (r == p - 1 or 0 <= done_b[r + 1][b] <= t)
            f_ready = f < m and (r == 0 or 0 <= done_f[r - 1][f] <= t) and f - b < p - r
            pending_w = next_b[r] - next_w[r]
            if pending_w >= p or (pending_w and not b_ready and not f_ready):
                order[r].append(Action(W, r, next_w[r]))
                next_w[r] += 1
            elif b_ready:
                order[r].append(Action(B, r, b))
                done_b[r][b] = t + 1
                next_b[r] += 1
            elif f_ready:
                order[r].append(Action(F, r, f))
                done_f[r][f] = t + 1
                next_f[r] += 1
        t += 1
    return order


# ---- communication ---------------------------------------------------------------------------------
def with_communication(steps: list[list[list[Action]]], num_stages: int, ranks: int = 0,
                       placement: str = "loop") -> tuple[tuple[Action, ...], ...]:
    """Insert the communication: `steps[rank]` groups the rank's computes into steps (a single compute, or
    an F and a B run back to back: Megatron's interleaved steady state, DualPipeV's F&B). Between two steps
    one batch holds the sends of the step before (its activations and input gradients) and the receives the
    step after needs; before the first step, its receives. A boundary between two stages of one rank (the
    bottom of a V) carries no message: the runtime hands the tensor over in place."""
    ranks = ranks or len(steps)

    def remote(stage: int, other: int) -> bool:
        return 0 <= other < num_stages and rank_of_stage(placement, stage, ranks) != rank_of_stage(placement, other,
                                                                                                     ranks)

    out = []
    for rank_steps in steps:
        actions: list[Action] = []
        for step in rank_steps:
            recvs = [Action(RECV_F, a.stage, a.micro) for a in step if a.kind == F and remote(a.stage, a.stage - 1)]
            recvs += [Action(RECV_B, a.stage, a.micro) for a in step if a.kind == B and remote(a.stage, a.stage + 1)]
            actions += recvs + step
            actions += [Action(SEND_F, a.stage, a.micro) for a in step if a.kind == F and remote(a.stage, a.stage + 1)]
            actions += [Action(SEND_B, a.stage, a.micro) for a in step if a.kind == B and remote(a.stage, a.stage - 1)]
        out.append(tuple(sends_first(actions)))
    return tuple(out)


def check_sizes(name: str, stages: int, micro_batches: int, virtual: int = 1) -> None:
    """Raise a ScheduleError naming the sizes when `name` cannot run them."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or virtual < 1:
        raise ScheduleError(f"pipeline sizes must be positive: stages={stages}, micro_batches={micro_batches}, "
                            f"virtual_stages={virtual}")
    if name == "interleaved":
        if virtual < 2:
            raise ScheduleError("the interleaved schedule needs pipeline.virtual_stages >= 2 (chunks per rank); "
                                "with one chunk per rank use schedule '1f1b'")
        if micro_batches % stages:
            raise ScheduleError(f"the interleaved schedule runs micro-batches in groups of pipeline.stages: "
                                f"micro-batches ({micro_batches}) must be a multiple of stages ({stages}); set "
                                f"gradient_accumulation_steps to a multiple of {stages}")
    elif name in V_SCHEDULES:
        if virtual != 2:
            raise ScheduleError(f"the {name} schedule puts two chunks on every rank (stages r and 2p - 1 - r): set "
                                f"pipeline.virtual_stages to 2 (it is {virtual})")
        if name == "dualpipev" and micro_batches < 2 * stages:
            raise ScheduleError(f"dualpipev fills its V with 2 x pipeline.stages micro-batches before its steady "
                                f"state: micro-batches ({micro_batches}) must be at least {2 * stages}; set "
                                f"gradient_accumulation_steps to {2 * stages} or more")
    elif virtual != 1:
        raise ScheduleError(f"pipeline.virtual_stages = {virtual} needs schedule 'interleaved'; schedule "
                            f"{name!r} runs one stage per rank (set virtual_stages to 1)")


def build_schedule(name: str, stages: int, micro_batches: int, virtual: int = 1,
                   forward_only: bool = False) -> Schedule:
    """The schedule `name` for p = `stages` ranks, m micro-batches and v chunks per rank.

    `forward_only` (evaluation) keeps only the forwards, in GPipe's order (Megatron's for interleaved).
    """
    name = name.lower()
    check_sizes(name, stages, micro_batches, virtual)
    p, m, v = stages, micro_batches, virtual
    placement = placement_of(name)
    if name == "interleaved" and not forward_only:
        steps = _interleaved(p, v, m)
    elif placement == "v":
        if forward_only:
            steps = [[[a] for a in order] for order in v_forwards(p, m)]
        else:  # the receives go where the list scheduler's clock says their tensors exist (v_schedules.py)
            return Schedule(name, p, v, m, split_backward=True, actions=v_schedule_actions(name, p, m),
                            placement=placement)
    else:
        if forward_only:  # the forwards of the schedule's own order (Megatron's for interleaved)
            orders = _gpipe(p, m, forward_only=True) if v == 1 else \
                [[step[0] for step in rank_steps if step[0].kind == F] for rank_steps in _interleaved(p, v, m)]
        else:
            orders = {"gpipe": lambda: _gpipe(p, m, forward_only=False), "1f1b": lambda: _one_f_one_b(p, m),
                      "zb-h1": lambda: _zb_h1(p, m)}[name]()
        steps = [[[a] for a in order] for order in orders]
    split = name in ("zb-h1", *V_SCHEDULES) and not forward_only
    return Schedule(name, p, v, m, split_backward=split, actions=with_communication(steps, p * v, p, placement),
                    forward_only=forward_only, placement=placement)
