"""Pipeline schedules as data, checked in one process: complete, deadlock-free, and as idle as theory says."""

from __future__ import annotations

import pytest

from paratrain.parallel.pp.schedules import (
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
    build_schedule,
    stages_of_rank,
)
from paratrain.parallel.pp.timeline import _unit_events
from paratrain.parallel.pp.validate import check_schedule, simulate, theoretical_bubble, validate

GRID = [(name, p, m, v)
        for name, vs in [("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2]), ("zb-h1", [1])]
        for p in (2, 4) for m in sorted({1, p, 2 * p, 8}) for v in vs
        if not (name == "interleaved" and m % p)]  # interleaved runs micro-batches in groups of p


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_every_schedule_is_complete_and_deadlock_free(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    validate(schedule)  # static checks, then both the buffered (gloo) and the rendezvous (NCCL) model
    for rank in range(p):
        for stage in range(rank, p * v, p):
            for micro in range(m):
                assert Action(F, stage, micro) in schedule.actions[rank]
    validate(build_schedule(name, p, m, v, forward_only=True))


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_idle_fraction_in_unit_slots_equals_theory(name, p, m, v):
    sim = simulate(build_schedule(name, p, m, v))
    one_f_one_b = simulate(build_schedule("1f1b", p, m))
    if name in ("gpipe", "1f1b"):
        assert sim.idle_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p)
    elif name == "interleaved":
        assert sim.idle_fraction == pytest.approx([(p - 1) / (v * m + p - 1)] * p)  # the bubble divided by v
        assert sim.idle_slots == pytest.approx(one_f_one_b.idle_slots)  # same idle time, v times the chunks
    elif m >= p:  # ZB-H1: p - 1 idle slots instead of 1F1B's 3(p - 1)
        assert sim.idle_fraction == pytest.approx([theoretical_bubble(sim.schedule)] * p)
        assert max(sim.idle_slots) <= max(one_f_one_b.idle_slots) / 3 + 1e-9
    else:  # fewer micro-batches than stages: nothing fills the wait for the first gradient
        assert max(sim.idle_slots) < max(one_f_one_b.idle_slots)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8)])
def test_peak_in_flight_micro_batches(p, m):
    assert simulate(build_schedule("gpipe", p, m)).peak_in_flight == [m] * p
    one_f_one_b = simulate(build_schedule("1f1b", p, m)).peak_in_flight
    assert one_f_one_b == [min(p - rank, m) for rank in range(p)] and max(one_f_one_b) <= p
    assert simulate(build_schedule("zb-h1", p, m)).peak_in_flight == one_f_one_b  # same activation limit


def test_zb_h1_fills_the_bubble_with_weight_gradients():
    schedule = build_schedule("zb-h1", 4, 8)
    assert schedule.split_backward
    kinds = [a.kind for a in schedule.compute(0)]
    assert kinds.count(W) == 8 and kinds.index(W) < len(kinds) - 8  # some W run before the last B
    # Pending weight gradients stay bounded by p, so W's memory does not grow with m.
    for rank in range(4):
        pending, worst = 0, 0
        for a in schedule.compute(rank):
            pending += 1 if a.kind == B else -1 if a.kind == W else 0
            worst = max(worst, pending)
        assert worst <= 4


def test_action_kinds_are_an_enum_with_short_printed_forms():
    assert [k.value for k in ActionKind] == ["F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
    assert str(Action(F, 1, 3)) == "F3@s1" and f"{Action(ActionKind.SEND_B, 2, 0)}" == "SEND_B0@s2"
    assert Action("W", 0, 2) == Action(W, 0, 2) and Action("W", 0, 2).kind is W  # a short form is read as its kind
    assert [k for k in ActionKind if k.is_comm] == [k for k in ActionKind if k.is_send or k.is_recv]
    assert not any(k.is_comm for k in (F, B, W))
    assert build_schedule("1f1b", 2, 2).describe(1).split()[:4] == ["RECV_F0@s1", "F0@s1", "B0@s1", "SEND_B0@s1"]
    with pytest.raises(ValueError, match="'X' is not a valid ActionKind"):
        Action("X", 0, 0)


def test_timeline_events_store_kinds_as_short_strings():
    timeline = {"schedule": "zb-h1", "stages": 2, "micro_batches": 2, "virtual": 1}
    kinds = {e[0] for events in _unit_events(timeline) for e in events}
    assert kinds == {"F", "B", "W"} and all(type(k) is str for k in kinds)


def _replace(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    per_rank = list(schedule.actions)
    per_rank[rank] = tuple(actions)
    return Schedule(schedule.name, schedule.stages, schedule.virtual, schedule.micro_batches,
                    schedule.split_backward, tuple(per_rank))


def test_validator_rejects_broken_schedules():
    good = build_schedule("1f1b", 2, 2)
    rank0 = list(good.actions[0])
    with pytest.raises(ScheduleError, match="runs 0 times"):
        check_schedule(_replace(good, 0, [a for a in rank0 if a != Action(B, 0, 1)]))
    with pytest.raises(ScheduleError, match=r"rank 0 runs SEND_F0@s0 before F0@s0"):
        check_schedule(_replace(good, 0, [Action(SEND_F, 0, 0)] + [a for a in rank0 if a != Action(SEND_F, 0, 0)]))
    # Sending micro-batch 1 before 0 while the receiver expects 0 first: messages match by order.
    swapped = [a for a in rank0 if a != Action(SEND_F, 0, 0)]
    swapped.insert(swapped.index(Action(SEND_F, 0, 1)) + 1, Action(SEND_F, 0, 0))
    with pytest.raises(ScheduleError, match="messages are matched by order"):
        check_schedule(_replace(good, 0, swapped))


def test_validator_finds_a_deadlock():
    # Rank 1 wants both activations before any backward; rank 0 wants the first gradient before it sends
    # the second activation: each waits for the other.
    p, m = 2, 2
    rank0 = [Action(F, 0, 0), Action(SEND_F, 0, 0), Action("RECV_B", 0, 0), Action(B, 0, 0), Action(F, 0, 1),
             Action(SEND_F, 0, 1), Action("RECV_B", 0, 1), Action(B, 0, 1)]
    rank1 = [Action(RECV_F, 1, 0), Action(RECV_F, 1, 1), Action(F, 1, 0), Action(F, 1, 1), Action(B, 1, 0),
             Action("SEND_B", 1, 0), Action(B, 1, 1), Action("SEND_B", 1, 1)]
    schedule = Schedule("custom", p, 1, m, False, (tuple(rank0), tuple(rank1)))
    check_schedule(schedule)  # locally fine
    with pytest.raises(ScheduleError, match="deadlocks.*rank 0 waits for \\[RECV_B0@s0\\]"):
        simulate(schedule)


def test_schedule_size_errors_name_the_fix():
    with pytest.raises(ScheduleError, match=r"micro-batches \(6\) must be a multiple of stages \(4\)"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="virtual_stages = 2 needs schedule 'interleaved'"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="needs pipeline.virtual_stages >= 2"):
        build_schedule("interleaved", 2, 4, 1)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'pipedream'"):
        build_schedule("pipedream", 2, 4)


# ---- the V schedules: two chunks per rank, stages r and 2p - 1 - r --------------------------------------
V_GRID = [(name, p, m) for name in ("zb-v", "dualpipev") for p in (2, 4, 8) for m in (1, p, 2 * p, 4 * p, 8 * p)
          if not (name == "dualpipev" and m < 2 * p)]  # DualPipeV fills its V with 2p micro-batches first


@pytest.mark.parametrize("name,p,m", V_GRID)
def test_v_schedules_are_complete_and_deadlock_free_with_no_message_at_the_bottom_of_the_v(name, p, m):
    schedule = build_schedule(name, p, m, 2)
    validate(schedule)  # both backend models
    validate(build_schedule(name, p, m, 2, forward_only=True))
    assert schedule.placement == "v" and schedule.split_backward
    for rank in range(p):
        assert stages_of_rank("v", rank, p, 2) == [rank, 2 * p - 1 - rank]
        for stage in (rank, 2 * p - 1 - rank):
            for micro in range(m):
                assert {Action(k, stage, micro) for k in (F, B, W)} <= set(schedule.actions[rank])
    # Stages p - 1 and p share the last rank: that boundary is handed over in place, never sent.
    sent = {(a.stage, a.kind) for actions in schedule.actions for a in actions if a.is_comm}
    assert (p - 1, SEND_F) not in sent and (p, RECV_F) not in sent and (p, SEND_B) not in sent


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p, 8 * p)])
def test_zb_v_is_no_more_idle_than_zb_h1_at_1f1b_activation_memory(p, m):
    zb_v = simulate(build_schedule("zb-v", p, m, 2))
    zb_h1 = simulate(build_schedule("zb-h1", p, m))
    one_f_one_b = simulate(build_schedule("1f1b", p, m))
    assert max(zb_v.idle_fraction) <= min(zb_h1.idle_fraction) + 1e-12
    # Unit slots are per chunk (half a stage): p - 1 idle chunk slots of 6m + p - 1, the ZB-V paper's bubble.
    assert zb_v.idle_fraction == pytest.approx([(p - 1) / (6 * m + p - 1)] * p)
    assert theoretical_bubble(zb_v.schedule) == pytest.approx(max(zb_v.idle_fraction))
    if m >= 2 * p:
        dualpipev = simulate(build_schedule("dualpipev", p, m, 2))
        assert theoretical_bubble(dualpipev.schedule) == pytest.approx(max(dualpipev.idle_fraction))
    # A chunk activation is half a stage's: at most 2p of them, 1F1B's p whole stages.
    assert max(zb_v.peak_in_flight) / 2 <= max(one_f_one_b.peak_in_flight)


@pytest.mark.parametrize("durations", [{F: 1.0, B: 1.0, W: 1.0}, {F: 2.0, B: 2.0, W: 1.0}, {F: 1.0, B: 1.0, W: 0.5},
                                       {F: 1.0, B: 2.0, W: 1.0}])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipev_bubble_and_memory_are_deepseeks_formula(p, durations):
    """DeepSeek's table: bubble (PP/2 - 1)(F&B + B - 3W), activations PP + 1, for PP = 2p chunks on p ranks,
    with B there the whole backward (our B + W) and F&B = F + B (run back to back: nothing overlaps on CPU)."""
    f, b, w = durations[F], durations[B] + durations[W], durations[W]
    formula = (p - 1) * ((f + b) + b - 3 * w)
    for m in (2 * p, 3 * p, 8 * p):
        for rendezvous in (False, True):
            sim = simulate(build_schedule("dualpipev", p, m, 2), durations, rendezvous=rendezvous)
            assert max(sim.peak_in_flight) == 2 * p + 1
            if durations[B] == durations[F]:
                assert max(sim.idle_slots) == pytest.approx(formula)
            elif not rendezvous:  # a backward slower than the forward: the steady state's wait shrinks
                assert max(sim.idle_slots) == pytest.approx(formula - 1)
            else:  # and with blocking (rendezvous) sends it grows with p: (p - 4)/2 slots over the formula
                assert max(sim.idle_slots) == pytest.approx(formula + (p - 4) / 2)


def test_v_schedule_size_errors_name_the_fix():
    with pytest.raises(ScheduleError, match="set pipeline.virtual_stages to 2"):
        build_schedule("zb-v", 2, 4, 1)
    with pytest.raises(ScheduleError, match=r"micro-batches \(6\) must be at least 8"):
        build_schedule("dualpipev", 4, 6, 2)
