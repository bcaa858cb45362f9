"""The planner's search (`search.plan`, each part of the cost computed once per shape) equals the exhaustive one
(`enumerate.exhaustive_plan`, every layout evaluated from scratch): the same layouts considered, the same ones
fitting, in the same order, with the same numbers; and its fast mesh questions equal ParallelDims' own answers."""

from __future__ import annotations

import gc
import itertools
import statistics
from dataclasses import astuple

import pytest

from paratrain.layout.dims import ParallelDims
from paratrain.planner.adapters import LoraPlan, projections
from paratrain.planner.enumerate import SearchSpace, enumerate_layouts, exhaustive_plan
from paratrain.planner.hardware import Hardware, spans_nodes, spans_nodes_by_groups
from paratrain.planner.layout import axis_name
from paratrain.planner.memory import estimate_memory
from paratrain.planner.model_shape import model_shape, with_adapters, with_reference
from paratrain.planner.reference import ReferencePlan
from paratrain.planner.search import PartCosts, candidates, plan


def _lora(name: str):
    shape = model_shape(name)
    return with_adapters(shape, LoraPlan(4, tuple(projections(shape)), False))


CASES = {  # model, GPUs, global batch, GPUs per node (below the GPUs: HSDP and slow links), search space
    "gpt": (lambda: model_shape("gpt-mini"), 8, 4, 2, SearchSpace()),
    "llama offload unfused muon": (lambda: model_shape("llama-mini"), 4, 8, 2,
                                   SearchSpace(offload_optimizer=(False, True), flash_attention=False,
                                               optimizer="muon")),
    "mixtral": (lambda: model_shape("mixtral-tiny"), 8, 4, 2, SearchSpace()),
    "llama lora": (lambda: _lora("llama-mini"), 4, 4, 2, SearchSpace()),
    "llama dpo": (lambda: with_reference(model_shape("llama-mini"), ReferencePlan({"type": "dpo"}, "initial")), 4, 8,
                  2, SearchSpace()),
}


@pytest.mark.parametrize("case", CASES)
def test_the_search_is_the_exhaustive_plan(case):
    make, gpus, batch, per_node, space = CASES[case]
    shape = make()
    layouts = list(enumerate_layouts(shape, gpus, batch, per_node, space))
    assert [astuple(lay) for lay in layouts] == \
        list(candidates(shape, gpus, batch, per_node, space, PartCosts(shape, Hardware(), space.flash_attention)))
    # memory that half of the layouts fit in: the search must prune and rank exactly as the full evaluation
    median = statistics.median(estimate_memory(shape, lay, space.flash_attention).total for lay in layouts)
    hw = Hardware(gpu_memory=median / 0.9, gpus_per_node=per_node, inter_node_bandwidth=10e9)
    exhaustive, searched = exhaustive_plan(shape, gpus, batch, hw, space), plan(shape, gpus, batch, hw, space)
    assert 0 < len(exhaustive.ranked) < exhaustive.considered
    assert searched == exhaustive


def test_when_nothing_fits_the_smallest_is_the_exhaustive_one():
    shape, hw = model_shape("gpt-mini"), Hardware(gpu_memory=1e3, gpus_per_node=2)
    exhaustive, searched = exhaustive_plan(shape, 4, 8, hw), plan(shape, 4, 8, hw)
    assert searched.ranked == [] and searched.smallest is not None
    assert searched == exhaustive


def test_the_search_leaves_the_cycle_collector_as_it_found_it():
    shape, hw = model_shape("gpt-mini"), Hardware(gpus_per_node=2)
    try:
        for enabled in (True, False):
            gc.enable() if enabled else gc.disable()
            assert plan(shape, 4, 8, hw).ranked
            assert gc.isenabled() is enabled
    finally:
        gc.enable()


def _meshes(world: int):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for pp, cp, tp in itertools.product(divisors, repeat=3):
        if world % (pp * cp * tp) == 0:
            dp = world // (pp * cp * tp)
            for rep, u in itertools.product([d for d in divisors if dp % d == 0], [d for d in divisors if cp % d == 0]):
                for ep in [d for d in divisors if (dp // rep * cp) % d == 0]:
                    yield ParallelDims(world, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, cp_ulysses=u, dp_replicate=rep)


def test_node_spans_and_axis_names_are_the_meshes_own():
    """The planner asks every mesh of a search about each of its dims: with numpy, not rank by rank, and the
    answers must be ParallelDims' (12 ranks: splits that do not align with the grid, nodes of 3 too)."""
    for dims in _meshes(12):
        for name in dims.dims:
            assert axis_name(dims, (name,)) == dims.axis_name((name,)), (dims, name)
            for per_node in (3, 4):
                assert spans_nodes(dims, (name,), per_node) == spans_nodes_by_groups(dims, (name,), per_node), \
                    (dims, name, per_node)


def test_docs_show_the_committed_speed_table():
    import json
    from pathlib import Path

    from benchmarks.planner_speed import RESULTS, table

    docs = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    result = json.loads(RESULTS.read_text())
    assert table(result) in docs
    after = {r["gpus"]: r for r in result["after"]["runs"]}
    assert all(r["answer_sha256"] == after[r["gpus"]]["answer_sha256"]  # the same answers, where both answered
               for r in result["before"]["runs"] if not r["timed_out"] and r["gpus"] in after)
