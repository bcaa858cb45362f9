"""Around the real-data matrix: the old convention against DeepSpeed, ring attention's skipped block parts,
peers fed different micro-batches, an error on one rank, and token data a pipeline refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import paratrain
from paratrain.attention import Documents, masked_attention
from tests.cases import adamw_config, corpus_windows, import_deepspeed, skip_without_deepspeed, tiny_gpt
from tests.distributed.test_cli import ROOT, _free_port, _paratrain

SCRIPT = ROOT / "tests" / "scripts" / "ds_masked.py"


@pytest.mark.multiprocess
def test_the_micro_batch_reduction_is_deepspeeds_and_the_token_reduction_is_not(tmp_path):
    """Masked prompts, 2 ranks x 2 accumulation steps, a transformers Llama: paratrain with loss.reduction
    "micro_batch" gives DeepSpeed 0.19.8's losses and final parameters bit for bit; the default "token" trains
    another objective, from the first update on."""
    import_deepspeed()
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        skip_without_deepspeed("DeepSpeed's CPU backend compiles its shared-memory op at start-up: no C++ compiler")
    ours = _paratrain("run", "--nproc-per-node", "2", "--master-port", _free_port(), str(SCRIPT), "--out", "p.json",
                      "--reductions", "micro_batch,token", cwd=tmp_path, timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PARATRAIN_TEST_USE_DEEPSPEED": "1", "OMP_NUM_THREADS": "1"}
    theirs = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                             _free_port(), str(SCRIPT), "--out", "d.json"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert theirs.returncode == 0, (theirs.stdout + theirs.stderr)[-3000:]
    paratrain_runs = json.loads((tmp_path / "p.json").read_text())
    deepspeed_run = json.loads((tmp_path / "d.json").read_text())["default"]
    mean_of_means, token = paratrain_runs["micro_batch"], paratrain_runs["token"]
    assert mean_of_means["losses"] == deepspeed_run["losses"]
    assert mean_of_means["param_norm"] == deepspeed_run["param_norm"]
    per_step = 2  # micro-batches
    assert token["losses"][:per_step] == deepspeed_run["losses"][:per_step]  # the same first forward
    assert token["losses"][per_step:] != deepspeed_run["losses"][per_step:]  # then another objective
    assert abs(token["param_norm"] - deepspeed_run["param_norm"]) > 1e-4 * deepspeed_run["param_norm"]


# Packed documents of 2 to 9 tokens; the second row left-padded (padding is one more "document", id -1).
ROWS = torch.tensor([[0] * 3 + [1] * 5 + [2] * 6 + [3] * 2 + [4] * 7 + [5] * 9,
                     [-1] * 5 + [0] * 3 + [1] * 6 + [2] * 4 + [3] * 5 + [4] * 9])


def empty_parts(rows: torch.Tensor, cp: int, window: int | None) -> int:
    """Ring attention's block parts with no (query, key) pair that may attend, counted by brute force: rank r
    holds chunks r and 2cp-1-r; against block j < r all its queries see j's head chunk, against j > r its tail
    queries see all of j's tokens (ring_masks.py)."""
    chunk = rows.shape[1] // (2 * cp)

    def tokens(rank):
        return [*range(rank * chunk, (rank + 1) * chunk), *range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]

    empty = 0
    for r in range(cp):
        for j in range(cp):
            if j == r:
                continue
            queries, keys = tokens(r), tokens(j)
            queries, keys = (queries, keys[:chunk]) if j < r else (queries[chunk:], keys)
            empty += not any(k <= q and (window is None or q - k < window) and row[q] == row[k]
                             for row in rows.tolist() for q in queries for k in keys)
    return empty


def _ring_against_whole_rows(window: int | None) -> dict:
    from paratrain.comm import build_mesh
    from paratrain.layout.mesh import ParallelDims
    from paratrain.parallel.cp.ring_attention import RingAttentionCore
    from paratrain.parallel.cp.sharding import SequenceSplit

    mesh = build_mesh(ParallelDims(dist.get_world_size(), dp=1, cp=dist.get_world_size()))
    cp = mesh.axis("cp")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    docs = Documents(ROWS)
    whole = masked_attention(q, k, v, docs, window)
    grads = torch.autograd.grad(whole.sum(), (q, k, v))
    split = SequenceSplit.for_method("ring", cp.size, cp.rank)
    local = [split.split(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
    core = RingAttentionCore(cp)
    out = core(*local, docs, window)
    local_grads = torch.autograd.grad(out.sum(), local)
    return {"out": (out - split.split(whole.detach(), dim=2)).abs().max().item(),
            "grads": max((g - split.split(w, dim=2)).abs().max().item() for g, w in zip(local_grads, grads)),
            "pairs": (core.pairs.computed, core.pairs.skipped)}


@pytest.mark.parametrize("window", [None, 5])
def test_ring_attention_with_documents_is_whole_row_attention_and_skips_empty_parts(world4, window):
    """cp4, fp64: each rank's output and gradients equal the whole row's attention (documents, left padding, a
    window) at its tokens; block parts in which nothing may attend are skipped, and counted."""
    results = world4.run(_ring_against_whole_rows, window)
    for r in results:
        assert r["out"] < 1e-12 and r["grads"] < 1e-12, r
    computed = sum(r["pairs"][0] for r in results)
    skipped = sum(r["pairs"][1] for r in results)
    assert computed + skipped == 4 * 4  # every rank's part of every block: its own and 3 others
    assert skipped == empty_parts(ROWS, 4, window) > 0, results


def _fed_by_global_rank() -> str:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
                       tensor_parallel={"size": 2})
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg)
    data = corpus_windows()

    def batches(seed: int):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
        while True:
            picked = [data[order.pop()] for _ in range(2)]
            yield torch.stack([x for x, _ in picked]), torch.stack([y for _, y in picked])

    engine.train_batch(batches(engine.mesh.local_rank("dp")))  # seeded by the dp rank: fine
    try:
        engine.train_batch(batches(dist.get_rank()))  # checked on the first step only: this one passes
        fresh, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg)
        fresh.train_batch(batches(dist.get_rank()))  # a new job seeded by the global rank
    except paratrain.Error as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_peers_fed_different_micro_batches_are_named_on_every_rank(world4):
    errors = world4.run(_fed_by_global_rank)
    assert len(set(errors)) == 1, errors  # every rank raises the same error, before the step's collectives
    assert errors[0].startswith("BatchAgreementError: step 1: the ranks of data-parallel replica 0 (ranks [0, 1]: "
                                "its tensor-, context- and pipeline-parallel peers) must all be fed the same "
                                "micro-batches, but they differ (ranks [0] got one; ranks [1] got one)")
    assert "shard the data by the data-parallel rank" in errors[0]


def _disagreeing_peer(variant: str) -> str:
    """One replica of two ranks (tp2; pp2 for the order of micro-batches, which a pipeline checks as one list),
    two micro-batches a step: rank 1's differ from rank 0's in one way only. The labels of positions 7 and 8 are
    -100, so moving the document boundary from 8 to 7 masks no other target."""
    layout = {"pipeline": {"stages": 2}} if variant == "micro-batch order" else {"tensor_parallel": {"size": 2}}
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, **layout)
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg)
    data = corpus_windows()
    ids = [torch.stack([data[2 * k + i][0] for i in range(2)]) for k in range(2)]
    batches = [{"input_ids": x, "labels": x.masked_fill((torch.arange(16) == 7) | (torch.arange(16) == 8), -100),
                "position_ids": torch.arange(16).repeat(2, 1),
                "document_ids": torch.tensor([[0] * 8 + [1] * 8, [0] * 16])} for x in ids]
    if dist.get_rank() == 1:
        first = batches[0]
        if variant == "two tokens swapped":
            first["input_ids"] = first["input_ids"].clone()
            first["input_ids"][0, [3, 9]] = first["input_ids"][0, [9, 3]]
            first["labels"] = first["input_ids"].masked_fill(first["labels"] == -100, -100)
        elif variant == "targets only":
            first["labels"] = first["labels"].masked_fill(torch.arange(16) == 5, -100)  # one target fewer
        elif variant == "positions only":
            first["position_ids"] = torch.cat([torch.arange(8), torch.arange(8)]).repeat(2, 1)
        elif variant == "documents only":
            first["document_ids"] = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
        else:  # the same micro-batches, in another order
            batches.reverse()
    try:
        engine.train_batch(iter(batches))
    except paratrain.Error as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


DISAGREEMENTS = ("two tokens swapped", "targets only", "positions only", "documents only", "micro-batch order")


def _disagreeing_peers() -> list[str]:
    return [_disagreeing_peer(variant) for variant in DISAGREEMENTS]


def test_peers_that_differ_only_in_order_targets_positions_or_documents_fail_at_the_first_step(world2):
    for errors in world2.run(_disagreeing_peers):
        for variant, error in zip(DISAGREEMENTS, errors):
            assert error.startswith("BatchAgreementError: step 1: the ranks of data-parallel replica 0 (ranks "
                                    "[0, 1]: "), (variant, error)


def _one_rank_fails() -> str:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, comm={"timeout_s": 120.0})
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg)
    x, y = corpus_windows()[0]
    x, y = x.repeat(2, 1), y.repeat(2, 1)
    if dist.get_rank() == 1:
        x[1, 3] = 999  # outside the vocabulary, on this rank only
    try:
        engine.train_batch(iter([(x, y)]))
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_an_error_on_one_rank_stops_every_rank_at_once(world2):
    """Rank 1 raises inside the step; rank 0, already waiting in the step's first collective (the token loss's
    backprop unit), raises PeerFailed naming rank 1 and its error at its next look (not a CollectiveTimeout
    after comm.timeout_s = 120 s)."""
    try:
        errors = world2.run(_one_rank_fails)
    finally:
        world2.restart()  # rank 0's all-reduce never completes
    assert errors[1].startswith("TokenIdError: GPT token ids must lie in [0, 256)")
    assert errors[0].startswith("PeerFailed: paratrain: rank 0 stopped in all_reduce #1 on axis 'dp' (ranks 0, 1) "
                                "[loss_unit]")
    assert "because rank 1: TokenIdError: GPT token ids must lie in [0, 256)" in errors[0]


def _unshifted_pipeline_tuple() -> str:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, pipeline={"stages": 2})
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg)
    x, _ = corpus_windows()[0]
    x = x.repeat(2, 1)
    try:
        engine.train_batch(iter([(x, x), (x, x)]))  # transformers' habit: labels = input_ids
    except paratrain.Error as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_a_pipeline_refuses_targets_equal_to_the_inputs(world2):
    errors = world2.run(_unshifted_pipeline_tuple)
    assert errors[0] == errors[1] and errors[0].startswith(
        "MicroBatchError: the targets equal the inputs token for token (shape (2, 16)): paratrain's (inputs, "
        "targets) form takes targets already shifted")
