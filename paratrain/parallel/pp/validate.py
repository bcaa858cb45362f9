"""Checking a schedule in one process, and measuring it in unit time slots.

`check_schedule` proves, before any process runs it, that a schedule is complete (every stage runs every
micro-batch's F, B and — when split — W exactly once, on the rank that holds the stage), that each rank
respects its own dependencies (receive before the forward that consumes it, F before B before W, compute
before the send of its result), that every send has exactly one matching receive and that messages between
two ranks are received in the order they are sent (NCCL matches point-to-point messages by order only).

`simulate` runs all ranks' action lists against each other with unit durations (F = B = W = 1; an
unsplit backward does B and W, so it takes 2) and reports the makespan, every rank's busy and idle time
and the peak number of micro-batches in flight. A rank never waits where it posts a batch of sends and
receives; it waits only when a compute needs a tensor that a batch receives. Two models of the backend:

- buffered (`rendezvous=False`, gloo's behaviour and torch.distributed.pipelining's validator): every
  operation starts when posted and a receive completes once its send has been posted.
- rendezvous (NCCL with large messages): a rank's batches run one after another on its communication
  stream and a batch completes only when each of its sends and receives has met its counterpart.

`validate` requires a schedule to finish under both, so it cannot deadlock on gloo or NCCL. The idle
fractions that compare with theory are the buffered ones (the rendezvous model also charges ZB-H1 for
sends that wait on a neighbour's receive).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from paratrain.parallel.pp.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    ActionKind,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
)


def counterpart(a: Action) -> Action:
    """The receive that matches a send, or the send that matches a receive."""
    partner = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}[a.kind]
    return Action(partner, a.peer_stage, a.micro)


def unit_durations(schedule: Schedule) -> dict[ActionKind, float]:
    return {F: 1.0, B: 1.0 if schedule.split_backward else 2.0, W: 1.0}


def theoretical_bubble(schedule: Schedule) -> float:
    """Idle fraction per rank in unit slots: (p−1)/(m+p−1) for GPipe and 1F1B, the interleaved schedule
    divides the bubble by v ((p−1)/(v·m+p−1)), ZB-H1 leaves (p−1) idle slots of 3m+p−1 (F = B = W; for
    m ≥ p — with fewer micro-batches than stages nothing can fill the wait for the first gradient), ZB-V
    (p−1) idle chunk slots of 6m+p−1, DualPipeV DeepSeek's 2(p−1) of 6m+2(p−1) (F&B = F + B)."""
    p, m, v = schedule.stages, schedule.micro_batches, schedule.virtual
    if schedule.forward_only:
        return (p - 1) / (v * m + p - 1)
    if schedule.name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule.name == "zb-v":
        return (p - 1) / (6 * m + p - 1)
    if schedule.name == "dualpipev":
        return 2 * (p - 1) / (6 * m + 2 * (p - 1))
    return (p - 1) / (v * m + p - 1)


def check_schedule(schedule: Schedule) -> None:
    """Static checks; raise ScheduleError naming the rank and action at fault."""
    s_count, p = schedule.num_stages, schedule.stages
    kinds = [F] if schedule.forward_only else [F, B, W] if schedule.split_backward else [F, B]
    seen: Counter = Counter()
    for rank, actions in enumerate(schedule.actions):
        done: set[Action] = set()
        for a in actions:
            if schedule.rank_of(a.stage) != rank:
                raise ScheduleError(f"rank {rank} runs {a}, but stage {a.stage} lives on rank "
                                    f"{schedule.rank_of(a.stage)}")
            if not 0 <= a.micro < schedule.micro_batches or not 0 <= a.stage < s_count:
                raise ScheduleError(f"rank {rank}: {a} is outside {s_count} stages x {schedule.micro_batches} "
                                    f"micro-batches")
            if a.kind not in kinds and not a.is_comm:
                raise ScheduleError(f"rank {rank}: {a} does not belong in a {schedule.name} schedule")
            for need in _local_dependencies(a, schedule):
                if need not in done:
                    raise ScheduleError(f"rank {rank} runs {a} before {need}, which it depends on")
            done.add(a)
            seen[a] += 1
    for stage in range(s_count):
        for micro in range(schedule.micro_batches):
            for kind in kinds:
                want = Action(kind, stage, micro)
                if seen[want] != 1:
                    raise ScheduleError(f"{want} runs {seen[want]} times on rank {schedule.rank_of(stage)}; "
                                        f"every action must run exactly once")
    for a, n in seen.items():
        if a.is_comm and (n != 1 or seen[counterpart(a)] != 1):
            raise ScheduleError(f"{a} has no single matching {counterpart(a)}")
    _check_message_order(schedule, p)


def _local_dependencies(a: Action, schedule: Schedule) -> list[Action]:
    """What `a` needs done first on its own rank: a receive, or — across the bottom of a V, where both
    stages live on this rank — the neighbouring stage's compute itself."""
    if a.kind == F:
        if a.stage == 0:
            return []
        return [Action(F, a.stage - 1, a.micro) if schedule.local(a.stage, a.stage - 1) else
                Action(RECV_F, a.stage, a.micro)]
    if a.kind == B:
        after = []
        if a.stage < schedule.num_stages - 1:
            after = [Action(B, a.stage + 1, a.micro) if schedule.local(a.stage, a.stage + 1) else
                     Action(RECV_B, a.stage, a.micro)]
        return [Action(F, a.stage, a.micro)] + after
    if a.kind == W:
        return [Action(B, a.stage, a.micro)]
    if a.kind == SEND_F:
        return [Action(F, a.stage, a.micro)]
    if a.kind == SEND_B:
        return [Action(B, a.stage, a.micro)]
    return []


def _check_message_order(schedule: Schedule, p: int) -> None:
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind.is_send:
                sent.setdefault((rank, schedule.rank_of(a.peer_stage)), []).append(a)
            elif a.kind.is_recv:
                received.setdefault((schedule.rank_of(a.peer_stage), rank), []).append(counterpart(a))
    for pair, sends in sent.items():
        if received.get(pair, []) != sends:
            raise ScheduleError(f"rank {pair[0]} sends to rank {pair[1]} in the order {sends}, but rank {pair[1]} "
                                f"receives in the order {received.get(pair, [])}: messages are matched by order")


@dataclass
class Simulation:
    schedule: Schedule
    events: list[list[tuple[Action, float, float]]]  # per rank: (compute action, start, end)
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]  # per rank, most (stage, micro-batch) pairs whose F ran and whose B had not
    idle_fraction: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.idle_fraction = [1.0 - b / self.makespan for b in self.busy]

    @property
    def idle_slots(self) -> list[float]:
        return [self.makespan - b for b in self.busy]


def simulate(schedule: Schedule, durations: dict[ActionKind, float] | None = None,
             rendezvous: bool = False) -> Simulation:
    """Run every rank's actions against each other; raise ScheduleError on a deadlock.

    See the module docstring for the two backend models. Communication itself takes no time.
    """
    check_schedule(schedule)
    durations = durations or unit_durations(schedule)
    p = schedule.stages
    ptr, clock = [0] * p, [0.0] * p
    batches: list[list[tuple[list[Action], float]]] = [[] for _ in range(p)]  # (ops, post time)
    started: dict[Action, float] = {}  # op -> time its batch started (rendezvous) or was posted (buffered)
    done: dict[Action, float] = {}  # receive -> time its tensor is there
    stream_next, stream_free = [0] * p, [0.0] * p
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    in_flight, peak = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            actions = schedule.actions[r]
            while ptr[r] < len(actions):  # the host
                a = actions[ptr[r]]
                if a.is_comm:
                    batch = _comm_run(actions, ptr[r])
                    batches[r].append((batch, clock[r]))
                    if not rendezvous:
                        for x in batch:
                            started[x] = clock[r]
                    ptr[r] += len(batch)
                    progress = True
                    continue
                needs = [x for x in _local_dependencies(a, schedule) if x.is_comm]
                if any(x not in done for x in needs):
                    break
                start = max([clock[r]] + [done[x] for x in needs])
                clock[r] = start + durations[a.kind]
                events[r].append((a, start, clock[r]))
                in_flight[r] += 1 if a.kind == F else -1 if a.kind == B else 0
                peak[r] = max(peak[r], in_flight[r])
                ptr[r] += 1
                progress = True
            progress |= _advance_comm(r, batches[r], stream_next, stream_free, started, done, rendezvous)
    stuck = [r for r in range(p) if ptr[r] < len(schedule.actions[r])]
    if stuck:
        lines = []
        for r in stuck:
            waiting = [x for x in _local_dependencies(schedule.actions[r][ptr[r]], schedule)
                       if x.is_comm and x not in done]
            blocked = batches[r][stream_next[r]][0] if rendezvous and stream_next[r] < len(batches[r]) else []
            missing = [counterpart(x) for x in blocked if counterpart(x) not in started]
            lines.append(f"rank {r} waits for {waiting}" +
                         (f" behind its batch {blocked}, which waits for {missing}" if blocked else ""))
        raise ScheduleError(f"the {schedule.name} schedule deadlocks (p={p}, m={schedule.micro_batches}, "
                            f"v={schedule.virtual}): " + "; ".join(lines))
    makespan = max(clock)
    busy = [sum(end - start for _, start, end in ev) for ev in events]
    return Simulation(schedule, events, makespan, busy, peak)


def validate(schedule: Schedule) -> Simulation:
    """Check a schedule statically and under both backend models; return the buffered simulation."""
    simulate(schedule, rendezvous=True)
    return simulate(schedule, rendezvous=False)


def _advance_comm(r, batches, stream_next, stream_free, started, done, rendezvous) -> bool:
    progress = False
    if not rendezvous:  # every receive completes once its send is posted
        for ops, _ in batches:
            for x in ops:
                if x.kind.is_recv and x not in done and counterpart(x) in started:
                    done[x] = max(started[x], started[counterpart(x)])
                    progress = True
        return progress
    while stream_next[r] < len(batches):  # the stream: one batch at a time, in posting order
        ops, posted = batches[stream_next[r]]
        begin = max(posted, stream_free[r])
        for x in ops:
            if x not in started:
                started[x] = begin
                progress = True
        if any(counterpart(x) not in started for x in ops):
            return progress
        end = max([begin] + [started[counterpart(x)] for x in ops])
        for x in ops:
            if x.kind.is_recv:
                done[x] = end
        stream_free[r] = end
        stream_next[r] += 1
        progress = True
    return progress


def _comm_run(actions: tuple[Action, ...], start: int) -> list[Action]:
    end = start
    while end < len(actions) and actions[end].is_comm:
        end += 1
    return list(actions[start:end])
