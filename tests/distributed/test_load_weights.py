"""Sharded loading of weights: safetensors written as `save_pretrained` writes them (one file, or shards with
model.safetensors.index.json) load into every layout with full_state_dict() bit-equal to the file, each rank
reading only its slices; bad files are refused by name and leave the model as it was."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import paratrain
from paratrain.checkpoint import CheckpointError, sources
from paratrain.checkpoint.sources import SafetensorsSource, open_weights
from paratrain.checkpoint.weights import model_regions, read_box_range
from tests.cases import adamw_config, corpus_windows, tiny_llama

LAYOUTS = {"dp4 zero3": dict(zero=3), "dp2 x tp2": dict(tp=2), "dp2 x pp2": dict(pp=2),
           "dp2 x cp2 zero3": dict(cp=2, zero=3), "tp4 vocab": dict(tp=4, n_kv_head=4)}


def _weights(seed: int = 11, **overrides) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_llama(seed=seed, **overrides).state_dict().items()}


def write_pretrained(state: dict[str, torch.Tensor], directory: Path, shards: int = 1) -> Path:
    """What `save_pretrained` writes: model.safetensors, or model-0000i-of-0000n.safetensors + the index."""
    directory.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    names = sorted(state)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _config(path: str, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0, **_) -> dict:
    return adamw_config(train_batch_size=8, train_micro_batch_size_per_gpu=1, tensor_parallel={"size": tp},
                        context_parallel={"size": cp}, pipeline={"stages": pp, "partition": "parameters"},
                        zero_optimization={"stage": zero, "stage3_param_persistence_threshold": 0},
                        checkpoint={"load_weights": path})


def rows_of_boxes(regions: dict, shapes: dict) -> int:
    """The elements a rank must read to fill `regions`: for each, the whole rows of its box that its flat
    range [start, end) touches, clipped to the tensor (a box may reach into an uneven vocabulary's padding)."""
    total = 0
    for name, rs in regions.items():
        for r in rs:
            box, offsets, shape = r.origin.local_shape, r.origin.offsets, shapes[name]
            if not box:
                total += 1
                continue
            row = math.prod(box[1:])
            first, last = r.start // row, -(-r.end // row)
            extents = [min(offsets[0] + last, shape[0]) - min(offsets[0] + first, shape[0])]
            extents += [min(o + b, n) - min(o, n) for o, b, n in zip(offsets[1:], box[1:], shape[1:])]
            total += math.prod(max(e, 0) for e in extents)
    return total


def _whole_box(read, shape, origin, start, end, dtype):
    """The broken variant the count must catch: read every row of the box, keep the range."""
    if not origin.local_shape:
        return read_box_range(read, shape, origin, start, end, dtype)
    return read_box_range(read, shape, origin, 0, math.prod(origin.local_shape), dtype)[start:end]


def _load(path: str, layout: dict, broken: bool = False) -> dict:
    overrides = {k: v for k, v in layout.items() if k == "n_kv_head"}
    with paratrain.init_empty():
        model = tiny_llama(**overrides)
    counted = {}
    original = SafetensorsSource.fill

    def counting_fill(self, regions):  # what this rank reads, against what it keeps and what its rows hold
        out = original(self, regions)
        counted.update(read=self.elements_read, kept=sum(r.end - r.start for rs in regions.values() for r in rs),
                       rows=rows_of_boxes(regions, {n: self.entries[n][2] for n in regions}))
        return out

    SafetensorsSource.fill = counting_fill
    if broken:
        sources.read_box_range = _whole_box
    try:
        engine, *_ = paratrain.initialize(model=model, config=_config(path, **layout), training_data=corpus_windows())
    finally:
        SafetensorsSource.fill = original
        sources.read_box_range = read_box_range
    state = engine.full_state_dict()
    loss = float(engine.train_batch())
    engine.destroy()
    return {"layout": engine.mesh.dims.describe(), "state": state, "loss": loss, **counted}


@pytest.mark.parametrize("shards", [1, 3])
def test_pretrained_weights_load_into_every_layout_reading_only_the_slices_kept(world4, tmp_path, shards):
    overrides = {"n_kv_head": 4}  # the tp4 layout splits k/v heads too
    weights = _weights(**overrides)
    path = str(write_pretrained(weights, tmp_path / "hf", shards))
    total = sum(t.numel() for t in weights.values())
    for name, layout in LAYOUTS.items():
        rows = world4.run(_load, path, {**layout, **overrides})
        for row in rows:
            assert set(row["state"]) == set(weights), name
            assert all(torch.equal(row["state"][k], weights[k]) for k in weights), name
            # Each rank reads exactly the rows of its boxes that its ranges touch (a ZeRO range rounded out to
            # whole rows), never the whole model.
            assert row["kept"] <= row["read"] == row["rows"], (name, row)
        assert max(r["read"] for r in rows) < total, (name, [r["read"] for r in rows])  # never the whole model
    if shards == 1:  # reading whole boxes (the broken variant) is caught by the same count
        rows = world4.run(_load, path, {**LAYOUTS["dp4 zero3"], **overrides}, True)
        assert all(torch.equal(r["state"][k], weights[k]) for r in rows for k in weights)  # still loads right
        assert all(r["read"] > r["rows"] for r in rows), [(r["read"], r["rows"]) for r in rows]


def _load_and_report(path: str, **load) -> dict:
    engine, *_ = paratrain.initialize(model=tiny_llama(seed=5), config=adamw_config(
        train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 3}))
    before = engine.full_state_dict()
    try:
        engine.load_weights(path, **load)
        error = ""
    except CheckpointError as exc:
        error = str(exc)
    after = engine.full_state_dict()
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "loaded": {k: torch.equal(after[k], v) for k, v in _weights().items()}}


def _strip_transformer(name: str) -> str:
    return name.replace("transformer.", "", 1)


def _bad_files(tmp_path: Path) -> dict[str, tuple[str, dict, str]]:
    good = _weights()
    cases = {}

    def write(name: str, state: dict) -> str:
        return str(write_pretrained(state, tmp_path / name))

    cases["missing"] = (write("missing", {k: v for k, v in good.items() if k != "lm_head.weight"}), {},
                        "lack 1 tensor(s) of this model: lm_head.weight")
    cases["unexpected"] = (write("unexpected", {**good, "extra.weight": torch.ones(2)}), {},
                           "hold 1 tensor(s) this model does not: extra.weight")
    cases["shape"] = (write("shape", {**good, "model.norm.weight": torch.ones(7)}), {},
                      "'model.norm.weight' has shape [7]")
    cases["dtype"] = (write("dtype", {**good, "model.norm.weight": torch.ones(32, dtype=torch.int64)}), {},
                      "'model.norm.weight' is torch.int64")
    truncated = Path(write("truncated", good)) / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    cases["truncated"] = (str(truncated), {}, "is truncated")
    renamed = {("transformer." + k if k.startswith("model.") else k): v for k, v in good.items()}
    cases["name_map"] = (write("renamed", renamed), {"name_map": _strip_transformer}, "")
    cases["name_map dict"] = (write("renamed2", renamed), {"name_map": {k: k.replace("transformer.", "", 1)
                                                                         for k in renamed}}, "")
    return cases


def test_bad_weights_are_refused_by_name_and_leave_the_model_unchanged(world2, tmp_path):
    for case, (path, load, want) in _bad_files(tmp_path).items():
        for row in world2.run(_load_and_report, path, **load):
            if want:
                assert want in row["error"] and row["unchanged"], (case, row["error"])
            else:
                assert row["error"] == "" and all(row["loaded"].values()), case


def _from_checkpoint(directory: str) -> dict:
    from paratrain.checkpoint.sources import CheckpointSource

    engine, *_ = paratrain.initialize(model=tiny_llama(seed=5), config=adamw_config(
        train_micro_batch_size_per_gpu=1, tensor_parallel={"size": 2}), training_data=corpus_windows())
    engine.train_batch()
    engine.save_checkpoint(directory)
    want = engine.full_state_dict()
    with paratrain.init_empty():
        model = tiny_llama()
    counted = {}
    original = CheckpointSource.fill

    def counting_fill(self, regions):
        out = original(self, regions)
        counted.update(read=self.elements_read, kept=sum(r.end - r.start for rs in regions.values() for r in rs))
        return out

    CheckpointSource.fill = counting_fill
    try:
        other, *_ = paratrain.initialize(model=model, config=adamw_config(
            train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 3}, checkpoint={"load_weights": directory}))
    finally:
        CheckpointSource.fill = original
    got = other.full_state_dict()
    return {"equal": all(torch.equal(got[k], want[k]) for k in want), "steps": other.global_steps,
            "total": sum(t.numel() for t in want.values()), **counted}


def test_a_paratrain_checkpoint_is_a_weights_source_in_another_layout(world2, tmp_path):
    for row in world2.run(_from_checkpoint, str(tmp_path / "ck")):
        assert row["equal"] and row["steps"] == 0  # weights only: no counters, no optimizer state
        # counted from what is fetched from the files: a ZeRO-3 half of each tensor needs one or both of the
        # tp2 checkpoint's pieces, never the whole model
        assert row["kept"] <= row["read"] < row["total"], row


def test_a_path_without_weights_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match="holds no weights"):
        open_weights(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        open_weights(tmp_path / "nope")


def _region_sizes() -> dict:
    engine, *_ = paratrain.initialize(model=tiny_llama(), config=adamw_config(train_micro_batch_size_per_gpu=1))
    return {n: sum(r.end - r.start for r in rs) for n, rs in model_regions(engine.parallel).items()}


def test_regions_of_a_one_process_model_are_its_whole_tensors(world1):
    assert world1.run(_region_sizes)[0] == {k: v.numel() for k, v in tiny_llama().state_dict().items()}
