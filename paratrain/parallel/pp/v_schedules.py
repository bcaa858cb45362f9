"""The V-shaped schedules: every rank holds two chunks, stage r and stage 2p − 1 − r, so a micro-batch runs
down the ranks and back up (rank 0 holds the first and the last stage), and the backward is split into its
input part (B) and weight part (W).

    zb-v       Qi et al.'s ZB-V: W fills the slots where a rank would wait for a gradient, and each rank keeps
               at most 2p chunk activations alive (p of its whole layers: 1F1B's peak)
    dualpipev  DeepSeek's DualPipeV: the eight phases of its reference schedule per rank (`dualpipev_order`),
               whose steady state runs a forward of one chunk and a backward of the other back to back (F&B;
               on a GPU one's communication hides behind the other's compute)

ZB-V comes from a list scheduler in unit time slots (F = B = W = 1 per chunk): whenever a rank is free it
runs a ready B (the critical path; the oldest micro-batch first, the later stage on a tie), else a ready F
while it holds fewer than 2p chunk activations (the later stage first: it brings a micro-batch to the loss),
else a pending W; a rank holding 2p pending weight gradients runs one first, which bounds what W keeps alive.
DualPipeV's order is fixed; its slots come from running that order against the dependencies (`timed`). The
runtime and the validator treat both like every other schedule (`schedules.py`, `validate.py`).
"""

from __future__ import annotations

from paratrain.parallel.pp.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    ScheduleError,
    W,
    rank_of_stage,
    sends_first,
)

Steps = list[list[list[Action]]]  # per rank, its steps: the computes run back to back


def zb_v_steps(p: int, m: int) -> tuple[Steps, list[list[int]]]:
    """ZB-V's steps per rank (one compute each) and the slot each starts in: the list scheduler above."""
    last = 2 * p - 1
    mine = [(r, last - r) for r in range(p)]
    done_f: dict[tuple[int, int], int] = {}  # (stage, micro) -> slot its F ends
    done_b: dict[tuple[int, int], int] = {}
    next_f = dict.fromkeys(range(2 * p), 0)
    next_b = dict.fromkeys(range(2 * p), 0)
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    in_flight = [0] * p
    steps: Steps = [[] for _ in range(p)]
    starts: list[list[int]] = [[] for _ in range(p)]
    limit, remaining, t = 2 * p, 3 * 2 * p * m, 0

    def b_ready(s: int) -> bool:
        i = next_b[s]
        return (i < next_f[s] and done_f.get((s, i), t + 1) <= t and
                (s == last or done_b.get((s + 1, i), t + 1) <= t))

    def f_ready(r: int, s: int) -> bool:
        i = next_f[s]
        return i < m and in_flight[r] < limit and (s == 0 or done_f.get((s - 1, i), t + 1) <= t)

    while remaining:
        if t > 12 * p * m + 4 * p:  # every slot of the critical path has passed: the policy is stuck
            raise ScheduleError(f"the ZB-V list scheduling made no progress (p={p}, m={m})")
        for r in range(p):
            bs = sorted((s for s in mine[r] if b_ready(s)), key=lambda s: (next_b[s], -s))
            fs = sorted((s for s in mine[r] if f_ready(r, s)), key=lambda s: -s)
            if len(pending_w[r]) >= limit or (pending_w[r] and not bs and not fs):
                a = Action(W, *pending_w[r].pop(0))
            elif bs:
                a = Action(B, bs[0], next_b[bs[0]])
                done_b[(a.stage, a.micro)] = t + 1
                next_b[a.stage] += 1
                in_flight[r] -= 1
                pending_w[r].append((a.stage, a.micro))
            elif fs:
                a = Action(F, fs[0], next_f[fs[0]])
                done_f[(a.stage, a.micro)] = t + 1
                next_f[a.stage] += 1
                in_flight[r] += 1
            else:
                continue
            steps[r].append([a])
            starts[r].append(t)
            remaining -= 1
        t += 1
    return steps, starts


def dualpipev_order(rank: int, p: int, m: int) -> list[list[Action]]:
    """One rank's steps in DeepSeek's DualPipeV (p ranks, m ≥ 2p micro-batches; chunk 0 is stage `rank`,
    chunk 1 stage 2p − 1 − rank). The eight phases of the reference schedule: forwards of chunk 0; pairs of
    both chunks' forwards; B1 W F1 with a split backward; the steady state F0&B1, F1&B0; B1 then F1&B0; B1 B0,
    the later half with a split backward; W B0; the remaining Ws. A backward that is not split is B then W
    of the same micro-batch in one step; a split one leaves its W in a queue the phases drain in order."""
    stage = (rank, 2 * p - 1 - rank)
    next_f, next_b, queue = [0, 0], [0, 0], []
    steps: list[list[Action]] = []

    def forward(c: int) -> list[Action]:
        next_f[c] += 1
        return [Action(F, stage[c], next_f[c] - 1)]

    def backward(c: int, split: bool = False) -> list[Action]:
        next_b[c] += 1
        b = Action(B, stage[c], next_b[c] - 1)
        if split:
            queue.append(Action(W, b.stage, b.micro))
            return [b]
        return [b, Action(W, b.stage, b.micro)]

    def weight() -> list[Action]:
        return [queue.pop(0)]

    last_rank = rank == p - 1
    steps += [forward(0) for _ in range(2 * (p - rank - 1))]                      # 1: F0
    for _ in range(rank + 1):                                                        # 2: F0 F1
        steps += [forward(0), forward(1)]
    for _ in range(p - rank - 1):                                                    # 3: B1 W F1 (split)
        steps += [backward(1, split=True), weight(), forward(1)]
    for i in range(m - 2 * p + rank + 1):                                            # 4: F0&B1, F1&B0
        if i == 0 and last_rank:  # the bottom of the V: the B1 needs the F1 that this F0 feeds; not paired
            steps += [forward(0), backward(1)]
        else:
            steps.append(forward(0) + backward(1))
        steps.append(forward(1) + backward(0))
    for _ in range(p - rank - 1):                                                    # 5: B1, F1&B0
        steps += [backward(1), forward(1) + backward(0)]
    split = False
    for i in range(rank + 1):                                                        # 6: B1 B0
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        steps.append(backward(1, split))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        steps.append(backward(0, split))
    for _ in range(p - rank - 1):                                                    # 7: W B0 (split)
        steps += [weight(), backward(0, split=True)]
    steps += [weight() for _ in range(len(queue))]                                   # 8: W
    return steps


def timed(steps: Steps, p: int) -> list[list[int]]:
    """The slot each step starts in when every rank runs its steps in order, each compute one unit slot,
    as soon as what it needs exists (its F for a B, the neighbouring stages' F or B) — from the end of the step
    that made it, which is when the step's sends go out."""
    last = 2 * p - 1
    done: dict[Action, int] = {}
    starts: list[list[int]] = [[] for _ in range(p)]
    ptr, free_at, t = [0] * p, [0] * p, 0
    total, placed = sum(len(s) for s in steps), 0
    horizon = 4 * sum(len(step) for rank in steps for step in rank)  # every compute of every rank, back to back
    while placed < total:
        if t > horizon:
            raise ScheduleError(f"the DualPipeV order cannot run: a rank waits for a tensor that never comes (p={p})")
        for r in range(p):
            if ptr[r] == len(steps[r]) or free_at[r] > t:
                continue
            step = steps[r][ptr[r]]
            if not all(done.get(need, t + 1) <= t for a in step for need in _needs(a, last) if need not in step):
                continue
            for a in step:  # what a step produces leaves when the whole step is done
                done[a] = t + len(step)
            starts[r].append(t)
            free_at[r], ptr[r], placed = t + len(step), ptr[r] + 1, placed + 1
        t += 1
    return starts


def _needs(a: Action, last: int) -> list[Action]:
    if a.kind == F:
        return [Action(F, a.stage - 1, a.micro)] if a.stage > 0 else []
    if a.kind == B:
        return [Action(F, a.stage, a.micro)] + ([Action(B, a.stage + 1, a.micro)] if a.stage < last else [])
    return [Action(B, a.stage, a.micro)]


def v_actions(steps: Steps, starts: list[list[int]], p: int) -> tuple[tuple[Action, ...], ...]:
    """The V schedule's actions per rank, with communication.

    [Note: a receive is posted when its tensor exists]
    Between two ranks a V carries activations one way and gradients the other, so a rank may need two
    messages from a peer in another order than the peer sends them, and NCCL and gloo match the messages of
    a pair by order only. Every receive is therefore posted in the receiver's first gap at or after the slot
    its send is posted (the end of the producing step on the unit-slot clock of `starts`): both ends of
    every message then meet in the same slot, in the order of production, and no later than the compute
    that needs it (which could only start once the tensor exists). Sends follow the step that produces
    them, as in every schedule.
    """
    last = 2 * p - 1

    def rank(stage: int) -> int:
        return rank_of_stage("v", stage, p)

    produced: list[list[tuple[int, Action]]] = [[] for _ in range(p)]  # per receiver: (slot, receive)
    for r in range(p):
        for step, start in zip(steps[r], starts[r]):
            clock = start + len(step)  # the step's sends are posted after all of it
            for a in step:
                if a.kind == F and a.stage < last and rank(a.stage + 1) != r:
                    produced[rank(a.stage + 1)].append((clock, Action(RECV_F, a.stage + 1, a.micro)))
                if a.kind == B and a.stage > 0 and rank(a.stage - 1) != r:
                    produced[rank(a.stage - 1)].append((clock, Action(RECV_B, a.stage - 1, a.micro)))
    out: list[list[Action]] = [[] for _ in range(p)]
    for r in range(p):
        pending = sorted(produced[r], key=lambda item: item[0])
        for step, start in zip(steps[r], starts[r]):
            out[r] += [recv for slot, recv in pending if slot <= start]
            pending = [(slot, recv) for slot, recv in pending if slot > start]
            out[r] += step
            out[r] += [Action(SEND_F, a.stage, a.micro) for a in step if a.kind == F and a.stage < last and
                       rank(a.stage + 1) != r]
            out[r] += [Action(SEND_B, a.stage, a.micro) for a in step if a.kind == B and a.stage > 0 and
                       rank(a.stage - 1) != r]
        out[r] += [recv for _, recv in pending]
    return tuple(tuple(sends_first(actions)) for actions in out)


def v_schedule_actions(name: str, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    if name == "dualpipev":
        steps = [dualpipev_order(r, p, m) for r in range(p)]
        return v_actions(steps, timed(steps, p), p)
    return v_actions(*zb_v_steps(p, m), p)


def v_forwards(p: int, m: int) -> list[list[Action]]:
    """Evaluation: every forward of chunk 0, then of chunk 1, per rank (the V run down and back up)."""
    return [[Action(F, r, i) for i in range(m)] + [Action(F, 2 * p - 1 - r, i) for i in range(m)] for r in range(p)]
