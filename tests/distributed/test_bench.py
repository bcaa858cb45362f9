"""`paratrain bench`: the cases are what they claim, the counted columns are exact, the table lands in the doc."""

from __future__ import annotations

import json

import pytest

from paratrain.api import resolve_config
from paratrain.bench.cases import MODELS, cases, select
from paratrain.bench.table import BEGIN, END, write_between_markers
from paratrain.cli import main as cli_main
from paratrain.models import GPT


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_case_is_a_valid_layout_with_the_same_global_batch(nproc):
    chosen = select(nproc, None)
    assert ("hybrid" in {c.name for c in chosen}) == (nproc == 4)
    layouts = {c.name: c.layout(nproc) for c in chosen}  # resolves every config: a bad case raises here
    assert layouts["ddp"] == f"dp{nproc}" and layouts["tp_sp"] == f"tp{nproc}" and layouts["cp"] == f"cp{nproc}"
    assert layouts["pp_zbh1"] == f"pp{nproc}" and layouts["dp"] == f"1 process x {nproc} threads"
    assert all(resolve_config(c.config(), nproc).train_batch_size == 16 for c in chosen if not c.threads)
    if nproc == 4:
        assert layouts["hybrid"] == "dp2 x tp2"
    with pytest.raises(ValueError, match="unknown case"):
        select(nproc, "ddp,zero4")


@pytest.mark.multiprocess
def test_bench_counts_are_exact_and_the_table_lands_between_markers(tmp_path):
    doc = tmp_path / "strategies.md"
    doc.write_text(f"# Strategies\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    out = tmp_path / "rows.json"
    assert cli_main(["bench", "--nproc", "2", "--model", "tiny", "--steps", "2", "--warmup", "1", "--only",
                     "dp,ddp,zero1", "--json", str(out), "--doc", str(doc)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    psi = GPT("gpt-small", **MODELS["tiny"]).num_params()
    assert all(r["params"] == psi for r in rows.values())
    # DDP: 16 bytes per parameter on every rank, one all-reduce of Ψ fp32 elements per step on dp (every rank
    # holds the whole gradient: its norm needs no collective)
    assert rows["ddp"]["state_per_rank"] == [16 * psi] * 2
    assert rows["ddp"]["comm_per_step"] == {"dp": 4 * psi}
    assert rows["dp"]["state_per_rank"] == [16 * psi] and rows["dp"]["comm_per_step"] == {}
    # ZeRO-1: reduce-scatter + all-gather of the padded Ψ; 8Ψ + 8Ψ/N (+ padding) per rank
    zero1 = rows["zero1"]
    ops = zero1["comm_ops"]["dp"]
    assert set(ops) == {"reduce_scatter", "all_gather"} and zero1["comm_ops"]["world"] == {"all_reduce": 4}
    assert all(4 * psi <= ops[op] < 4 * (psi + 2 * 8) for op in ("reduce_scatter", "all_gather"))
    assert all(8 * psi + 4 * psi <= s < 8 * psi + 4 * psi + 12 * 8 for s in zero1["state_per_rank"])
    # the same weights and batches everywhere: the same losses (threads, DDP and ZeRO-1, fp32)
    assert rows["ddp"]["losses"] == pytest.approx(rows["dp"]["losses"], rel=1e-5)
    assert zero1["losses"] == pytest.approx(rows["ddp"]["losses"], rel=1e-5)
    text = doc.read_text()
    assert text.startswith("# Strategies\n\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert "old table" not in text and "`paratrain bench --nproc 2 --model tiny --steps 2 --warmup 1 --only " \
        "dp,ddp,zero1`" in text and "| DDP | dp2 | " in text


def test_missing_markers_are_explained(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="no '<!-- paratrain bench: begin -->'"):
        write_between_markers(doc, "table")


def test_cases_cover_the_study_notes_strategies():
    names = {c.name for c in cases(4)}
    assert {"dp", "ddp", "zero1", "zero2", "zero3", "tp", "tp_sp", "pp_1f1b", "pp_zbh1", "hybrid"} <= names
