"""The planner's search: every valid layout, in `enumerate_layouts`' order, costed from parts computed once per shape.

Evaluating each layout from scratch (`enumerate.exhaustive_plan`: `invalid_reason`, `estimate_memory`,
`estimate_time`) repeats the same work over and over: a 70B model on 1,024 GPUs has 175,180 valid layouts, but
its ZeRO states take a few thousand distinct values. Here each part of the cost is a function of a few layout fields
(its shape) and is computed once per distinct value of those fields, by the very functions the exhaustive path
calls, then looked up:

  part                                      fields it reads (its key)
  validity (`invalid_reason`)               all but micro_batch, recompute, precision, optimizer (and grad_accum
                                            but for 'interleaved' and 'dualpipev'; sp and offload checked apart)
  HSDP replicas (`hsdp_variants`)           zero > 0, dp, the mesh
  model states per stage (`stage_states`)   tp, pp, schedule, v, dp, cp, replicas, zero, precision, offload, ep,
                                            optimizer
  a micro-batch's activation parts         mb, cp, tp, sp, the cp method, u, precision, recompute
  (`memory.activation_parts`)
  what each stage holds of them             pp, schedule, v, and m when pp > 1 (micro-batches in flight)
  (`memory.stage_counts`)
  transient terms (`memory.transient_bytes`)  ZeRO-2's unsharded gradient: tp, pp, schedule, v, ep, precision;
                                            full recompute's layer: the parts without recompute; ZeRO-3's
                                            gathered units: tp, ep, precision; the logits: mb, cp, tp, precision
  "place" below: which blocks each pp rank holds and which holds the head, the V placement or the loop (for an
  MoE model also v, whose dense blocks are counted per chunk); the schedule's name is read only by the bubble
  the slowest stage and its micro-batch     tp, pp, cp, place, recompute, micro_batch (sp: MoE only)
  each source of transfers, timed           its own fields and the dims its axes name (`comm.TRANSFER_SOURCES`):
                                            data: dp, pp, cp, tp, ep, replicas, zero, place, ZeRO-2's partial
                                            backwards, precision, optimizer (m under ZeRO-2/3; adapters: also
                                            mb, sp, recompute); tp: recompute only as 'full'; cp: only as 'none';
                                            pp: the chunks held (place, v). tp, pp and cp groups do not change
                                            with dp, ep or the replicas, nor dp x cp's with the cp method
  the micro-batch's path (`path_time`)      the micro-batch part, the sources with tp, cp, ep or pp transfers,
                                            m, schedule, v (keyed by the identity of the cached parts)
  the optimizer update                      the states' fields (place for schedule, v) but optimizer

A key missing a field the part reads would give some layout another's cost, which the comparison below catches.
Memory comes first and prunes: a layout that does not fit is never timed, nor built. The result is the exhaustive
one exactly (same layouts, same order, the same floats: the same functions on the same values, summed in the
same order): tests/unit/test_planner_search.py compares the two.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections import defaultdict
from collections.abc import Sequence

from paratrain.parallel.pp.schedules import partial_backwards
from paratrain.planner.comm import TRANSFER_SOURCES
from paratrain.planner.enumerate import (
    Evaluation,
    PlanResult,
    SearchSpace,
    check_request,
    complexity,
    divisors,
    evaluate,
    hsdp_variants,
    invalid_reason,
    mesh_choices,
    ranked,
)
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import V_SCHEDULES, Layout, axis_name
from paratrain.planner.memory import (
    ActivationParts,
    StageCounts,
    activation_parts,
    logits_bytes,
    memory_stages,
    recompute_bytes,
    stage_activation_bytes,
    stage_counts,
    stage_states,
    unsharded_gradient_bytes,
    uses_unsharded_gradient,
    with_states,
    zero3_gathered_bytes,
)
from paratrain.planner.model_shape import ModelShape
from paratrain.planner.step_time import (
    MODEL_KINDS,
    by_kind,
    micro_batch_seconds,
    path_time,
    slowest_stage,
    step_parts,
    step_total,
    time_estimate,
    timed,
    update_seconds,
)


class PartCosts:
    """The parts of one plan's costs (one model, one machine, one search space), each cached by its key."""

    def __init__(self, shape: ModelShape, hw: Hardware, flash_attention: bool) -> None:
        self.shape, self.hw, self.flash = shape, hw, flash_attention
        self.reference_forward = shape.reference is not None and shape.reference.forward
        self.memo: dict[str, dict] = defaultdict(dict)

    def states(self, key: tuple, layout: Layout) -> list[tuple]:
        """Per memory stage: (stage, its model states, their bytes on the device)."""
        out = []
        for stage in memory_stages(layout):
            states = stage_states(self.shape, layout, stage)
            out.append((stage, states, states.states))
        return out

    def parts(self, key: tuple, layout: Layout) -> ActivationParts:
        """The micro-batch's activation parts under the recompute policy `key[0]`."""
        return activation_parts(self.shape, layout, self.flash, key[0])

    def counts(self, key: tuple, layout: Layout) -> list[StageCounts]:
        return [stage_counts(self.shape, layout, s) for s in memory_stages(layout)]

    def gradient(self, key: tuple, layout: Layout) -> list[float] | None:
        """ZeRO-2's unsharded gradient per stage, where the pipeline's backwards are partial (else None)."""
        if not uses_unsharded_gradient(layout):
            return None
        return [unsharded_gradient_bytes(self.shape, layout, s) for s in memory_stages(layout)]

    def gathered(self, key: tuple, layout: Layout) -> float:
        return zero3_gathered_bytes(self.shape, layout)

    def logits(self, key: tuple, layout: Layout) -> float:
        return logits_bytes(self.shape, layout)

    def micro_batch(self, key: tuple, layout: Layout) -> tuple[int, tuple[float, float]]:
        stage = slowest_stage(self.shape, layout)
        return stage, micro_batch_seconds(self.shape, layout, self.hw, stage)

    def source(self, key: tuple, layout: Layout) -> tuple[dict, bool]:
        """A source's timed transfers by kind, and whether any lies on the micro-batch's path (`MODEL_KINDS`)."""
        source, stage = key[0], key[1]
        kept = [t for t in source(self.shape, layout, stage)
                if axis_name(layout.dims, t.axes) is not None and t.elements > 0]
        kinds = dict(by_kind(timed(kept, layout, self.hw)))
        return kinds, any(kind in kinds for kind in MODEL_KINDS)

    def update(self, key: tuple, layout: Layout) -> tuple[float, float]:
        return update_seconds(self.shape, layout, self.hw, key[0])

    def get(self, part: str, key: tuple, layout: Layout):
        memo = self.memo[part]
        if key not in memo:
            memo[key] = getattr(self, part)(key, layout)
        return memo[key]


def memory_of(costs: PartCosts, f: tuple, layout: Layout | None):
    """(peak bytes, the (states, activations, transient) of the peak stage, the layout if it had to be built) of
    the layout with fields `f`: `estimate_memory`'s terms, each looked up by what it reads (the module's table)."""
    (states, parts, counts, gradient, full, gathered, logits), layout = memory_parts(costs, f, layout)
    worst, peak = None, None
    for i, (stage_states_, stage_count) in enumerate(zip(states, counts)):
        act = stage_activation_bytes(stage_count, parts)
        # `sum_transient`'s terms in its order (the same float sums)
        trans = 0.0
        if gradient is not None:
            trans += gradient[i]
        if full is not None:
            trans += full
        if gathered is not None:
            trans += gathered
        if stage_count.head_flights is not None:
            trans += logits
        total = stage_states_[2] + act + trans  # MemoryEstimate.total
        if worst is None or total > worst:
            worst, peak = total, (stage_states_, act, trans)
    return worst, peak, layout


def memory_parts(costs: PartCosts, f: tuple, layout: Layout | None) -> tuple[tuple, Layout | None]:
    """The cached parts `memory_of` adds up: (states per stage, activation parts, counts per stage, ZeRO-2's
    unsharded gradient per stage, full recompute's layer, ZeRO-3's gathered units, the logits; None where the layout
    has no such term), and the layout if a part had to build it. The lookups are written out, not looped over: this
    runs once per candidate (175,180 for a 70B on 1,024 GPUs)."""
    dp, mb, m, tp, pp, cp, zero, offload, schedule, v, recompute, sp, precision, method, u, ep, optimizer, rep = f
    memo = costs.memo
    key = (tp, pp, schedule, v, dp, cp, rep, zero, precision, offload, ep, optimizer)
    states = memo["states"].get(key)
    if states is None:
        layout = layout or Layout(*f)
        states = memo["states"][key] = costs.states(key, layout)
    key = (recompute, mb, cp, tp, sp, method, u, precision)
    parts = memo["parts"].get(key)
    if parts is None:
        layout = layout or Layout(*f)
        parts = memo["parts"][key] = costs.parts(key, layout)
    key = (pp, schedule, v, m if pp > 1 else None)
    counts = memo["counts"].get(key)
    if counts is None:
        layout = layout or Layout(*f)
        counts = memo["counts"][key] = costs.counts(key, layout)
    gradient = None  # ZeRO-2's unsharded gradient under partial backwards, per stage (None otherwise)
    if zero == 2:
        key = (tp, pp, schedule, v, ep, precision)
        if key not in memo["gradient"]:  # (None is a value: no unsharded gradient)
            layout = layout or Layout(*f)
            memo["gradient"][key] = costs.gradient(key, layout)
        gradient = memo["gradient"][key]
    full = None  # full recompute's layer, or the reference forward's: memory.rebuilds_a_layer
    if recompute == "full" or costs.reference_forward:
        key = ("none", mb, cp, tp, sp, method, u, precision)
        full = memo["full"].get(key)
        if full is None:
            rebuilt = memo["parts"].get(key)
            if rebuilt is None:
                layout = layout or Layout(*f)
                rebuilt = memo["parts"][key] = costs.parts(key, layout)
            full = memo["full"][key] = recompute_bytes(costs.shape, rebuilt)
    gathered = None
    if zero == 3:
        key = (tp, ep, precision)
        gathered = memo["gathered"].get(key)
        if gathered is None:
            layout = layout or Layout(*f)
            gathered = memo["gathered"][key] = costs.gathered(key, layout)
    key = (mb, cp, tp, precision)
    logits = memo["logits"].get(key)
    if logits is None:
        layout = layout or Layout(*f)
        logits = memo["logits"][key] = costs.logits(key, layout)
    return (states, parts, counts, gradient, full, gathered, logits), layout


def step_of(costs: PartCosts, f: tuple, layout: Layout | None) -> tuple:
    """(compute, bubble, exposed comm, update) seconds of the layout with fields `f` (`estimate_time`'s parts), and
    the layout if it had to be built (only a part computed for the first time needs it)."""
    dp, mb, m, tp, pp, cp, zero, offload, schedule, v, recompute, sp, precision, method, u, ep, optimizer, rep = f
    shape, memo = costs.shape, costs.memo
    lora, moe = shape.lora is not None, shape.moe
    # which blocks each pp rank holds and which holds the head: the V placement or the loop (and under
    # interleaving the virtual stages, for an MoE model's dense blocks); ZeRO-2 reads the partial backwards
    place = (schedule in V_SCHEDULES, v if moe else None)
    partial = zero == 2 and partial_backwards(schedule, pp, v)
    key = (pp, place, recompute, sp if moe else None, tp, mb, cp)
    found = memo["micro_batch"].get(key)
    if found is None:
        layout = layout or Layout(*f)
        found = memo["micro_batch"][key] = costs.micro_batch(key, layout)
    slowest, micro_batch = found
    # the data-parallel dims' groups do not change with the cp method (the Ulysses split is inside cp); the
    # micro-batches count under ZeRO-2/3 only (adapters: always). tp, pp and cp name only their own dims, whose
    # groups (members, nodes) the other sizes do not change
    mesh, model = (dp, pp, cp, tp, ep, rep), (pp, cp, tp, place)
    data_m = m if zero >= 2 or lora else None
    keys = (mesh + (zero, data_m, place, partial, precision, optimizer) + ((mb, sp, recompute) if lora else ()),
            model + (m, precision, mb, recompute == "full", sp),
            model + (schedule in V_SCHEDULES, v, m, mb, sp, precision),
            model + (method, u, m, precision, mb, recompute == "none"),
            mesh + (place, partial, m, recompute, mb, sp, precision, zero) if moe else (),
            mesh + (zero,))
    sources = memo["source"]
    groups, path_key = [], [id(micro_batch), m, schedule, v]
    for source, key in zip(TRANSFER_SOURCES, keys):
        key = (source, slowest) + key
        found = sources.get(key)
        if found is None:
            layout = layout or Layout(*f)
            found = sources[key] = costs.source(key, layout)
        groups.append(found[0])
        if found[1]:  # it has transfers on the micro-batch's path
            path_key.append(id(found[0]))
    kinds = merged(groups)
    path_key = tuple(path_key)
    path = memo["path"].get(path_key)
    if path is None:
        layout = layout or Layout(*f)
        path = memo["path"][path_key] = path_time(layout, costs.hw, micro_batch, kinds)
    key = (slowest, tp, pp, place, ep, zero, dp, cp, rep, offload, precision)
    update = memo["update"].get(key)
    if update is None:
        layout = layout or Layout(*f)
        update = memo["update"][key] = costs.update(key, layout)
    compute, comm = step_parts(m, costs.hw, path, kinds)
    return (compute, path.bubble, comm, update), layout


def merged(groups: list[dict]) -> dict:
    """The sources' timed transfers by kind, each kind's in the sources' order (`step_time.by_kind`)."""
    out: dict = {}
    for group in groups:
        for kind, entries in group.items():
            out[kind] = out[kind] + entries if kind in out else entries
    return out


def candidates(shape: ModelShape, gpus: int, global_batch: int, gpus_per_node: int, space, costs: PartCosts):
    """The fields (Layout's, in order) of every valid layout, in `enumerate_layouts`' order: for each mesh, the
    valid variants (schedule, cp method, ZeRO, offload, sp, recompute, ep, replicas) are found once and then
    walked for each micro-batch size; 'interleaved' and 'dualpipev', whose rules read the micro-batches per step,
    are asked again per (schedule, pp, v, m) (`mesh_variants`)."""
    recomputes = [r for r in space.recompute if not (r == "selective" and space.flash_attention)]
    per_step = costs.memo["valid_m"]
    for tp, pp, cp in itertools.product(divisors(gpus), repeat=3):
        if gpus % (tp * pp * cp) or global_batch % (gpus // (tp * pp * cp)):
            continue
        dp = gpus // (tp * pp * cp)
        per_rank = global_batch // dp
        micro_batches = [mb for mb in divisors(per_rank) if mb <= space.max_micro_batch]
        variants = mesh_variants(shape, (dp, tp, pp, cp), recomputes, gpus_per_node, space, costs) \
            if micro_batches else []
        for mb in micro_batches:
            m = per_rank // mb
            for zero, offload, schedule, v, recompute, sp, method, u, ep, rep, per_m in variants:
                f = (dp, mb, m, tp, pp, cp, zero, offload, schedule, v, recompute, sp, space.precision, method, u, ep,
                     space.optimizer, rep)
                if per_m is not None:
                    ok = per_step.get(per_m + (m,))
                    if ok is None:  # the rest holds (the variant is valid at m*): only the m rules decide
                        ok = per_step[per_m + (m,)] = valid_layout(shape, f, gpus_per_node, costs.memo["valid"])
                    if not ok:
                        continue
                yield f


def mesh_variants(shape: ModelShape, mesh: tuple, recomputes: list[str], gpus_per_node: int, space,
                  costs: PartCosts) -> list[tuple]:
    """For the mesh (dp, tp, pp, cp): (zero, offload, schedule, v, recompute, sp, method, u, ep, replicas, per_m)
    of each variant `enumerate_layouts` tries, in its order, that is valid (`valid_layout`) at m* = 2 pp
    micro-batches per step, which meets the only rules that read them (interleaving: m divisible by pp;
    DualPipeV: m >= 2 pp); `per_m` = (schedule, pp, v) for those two schedules, whose validity at another m is
    then those rules' alone, None for the others."""
    dp, tp, pp, cp = mesh
    valid, replicas, out = costs.memo["valid"], costs.memo["replicas"], []
    for (schedule, v), (method, u), zero, offload, sp, recompute, ep in mesh_choices(shape, mesh, recomputes, space):
        base = (dp, 1, 2 * pp, tp, pp, cp, zero, offload, schedule, v, recompute, sp, space.precision, method, u, ep,
                space.optimizer)
        key = (zero > 0, dp, pp, cp, tp, ep, method, u)
        if key not in replicas:
            replicas[key] = [c.dp_replicate for c in hsdp_variants(Layout(*base), gpus_per_node, space)]
        per_m = (schedule, pp, v) if schedule in M_SCHEDULES else None
        for rep in [1] + replicas[key]:
            if valid_layout(shape, base + (rep,), gpus_per_node, valid):
                out.append((zero, offload, schedule, v, recompute, sp, method, u, ep, rep, per_m))
    return out


M_SCHEDULES = ("interleaved", "dualpipev")  # schedules whose validity reads the micro-batches per step


def valid_layout(shape: ModelShape, f: tuple, gpus_per_node: int, valid: dict) -> bool:
    """`invalid_reason(...) is None` for the layout with fields `f`. Of its checks, sequence parallelism and
    offload are read by one each (`sp needs tp > 1`, `offload needs ZeRO >= 1`), checked here; the rest is asked
    once per value of the fields they read, micro_batch, recompute, precision and optimizer not among them, nor
    grad_accum but under 'interleaved' and 'dualpipev'."""
    dp, mb, m, tp, pp, cp, zero, offload, schedule, v, recompute, sp, precision, method, u, ep, optimizer, rep = f
    if (sp and tp == 1) or (offload and zero == 0):
        return False
    key = (dp, m if schedule in M_SCHEDULES else None, tp, pp, cp, zero, schedule, v, method, u, ep, rep)
    if key not in valid:
        layout = Layout(dp, mb, m, tp, pp, cp, zero, False, schedule, v, recompute, False, precision, method, u, ep,
                        optimizer, rep)
        valid[key] = invalid_reason(shape, layout, gpus_per_node) is None
    return valid[key]



def plan(shape: ModelShape, gpus: int, global_batch: int, hw: Hardware, space: SearchSpace | None = None
         ) -> PlanResult:
    """Enumerate, keep what fits in `hw.usable_memory`, rank by predicted step time (then memory). The fitting
    layouts are ranked by `rank_key` from their parts; their estimates are built when read (`Ranked`)."""
    check_request(gpus, global_batch)
    with without_cycle_collection():
        return _search(shape, gpus, global_batch, hw, space or SearchSpace())


@contextlib.contextmanager
def without_cycle_collection():
    """The search keeps a few hundred thousand small tuples alive (candidates, cached parts, fitting records) and
    makes no reference cycles; Python's cycle collector would walk all of them again and again as they pile up.
    Off for the search, back as it was after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(shape: ModelShape, gpus: int, global_batch: int, hw: Hardware, space: SearchSpace) -> PlanResult:
    costs = PartCosts(shape, hw, space.flash_attention)
    fitting, considered, smallest, least = [], 0, None, None
    simplicity = costs.memo["complexity"]
    for fields in candidates(shape, gpus, global_batch, hw.gpus_per_node, space, costs):
        considered += 1
        total, peak, layout = memory_of(costs, fields, None)
        if total > hw.usable_memory:
            if least is None or total < least:
                smallest, least = fields, total
            continue
        step, layout = step_of(costs, fields, layout)
        dp, mb, m, tp, pp, cp, zero, offload, schedule, v, recompute, sp, precision, method, u, ep, optimizer, rep = \
            fields
        mechanisms = (tp, pp, cp, zero, recompute, sp, offload, v, ep)  # what `complexity` reads
        if mechanisms not in simplicity:
            simplicity[mechanisms] = complexity(layout or Layout(*fields))
        # `rank_key`: the step's total to a microsecond, the mechanisms switched on, the memory
        fitting.append(((round(step_total(*step), 6), simplicity[mechanisms], total), fields, peak, step))
    if not fitting:
        if smallest is not None:
            smallest = evaluate(shape, Layout(*smallest), hw, space.flash_attention)
        return ranked([], considered, smallest, gpus, global_batch)
    fitting.sort(key=lambda record: record[0])  # stable: ties keep the enumeration's order, as `ranked` does
    result = Ranked(shape, fitting)
    least_memory = min(range(len(fitting)), key=lambda i: fitting[i][0][2])  # `ranked`'s smallest: the first
    return PlanResult(result, considered, result[least_memory])


class Ranked(Sequence):
    """The fitting layouts, fastest first, as the `Evaluation`s `ranked` would list: each built when first read
    from its ranking record (key, fields, the peak stage's memory parts, the step's time parts)."""

    def __init__(self, shape: ModelShape, records: list[tuple]) -> None:
        self.shape, self.records, self.built = shape, records, {}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]
        if index not in self.built:
            _, fields, ((stage, states, _), act, trans), (compute, bubble, comm, update) = self.records[index]
            layout = Layout(*fields)
            self.built[index] = Evaluation(layout, with_states(states, act, trans, stage),
                                           time_estimate(self.shape, layout, compute, bubble, comm, update), True)
        return self.built[index]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment] (a list's)

    def __repr__(self) -> str:
        return f"Ranked({len(self)} layouts)"
