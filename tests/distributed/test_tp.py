"""Tensor (and sequence) parallelism against the single-process reference, its communication counted,
its memory split, its random numbers, and its failure modes; on the built-in GPT and on a model that is
defined only here and parallelized by a plan written in its config."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.layout.placement import Shard
from paratrain.models import GPT
from paratrain.testing import rel_diff
from paratrain.testing.parity import layout_parity
from tests.cases import STABLE_EPS, TINY, adamw_config, corpus_windows, tiny_gpt

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 5
VOCAB = 251  # not divisible by 2 or 4: the vocabulary is padded on the last rank
VOCAB_SPLIT = {"embed.tok.weight", "head.weight", "tok_emb.weight", "lm_head.weight"}  # rows padded to tp


# ---- a second model, written without tensor parallelism in mind -----------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class SelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.head_dim = d // n_head
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.out_proj = nn.Linear(d, d, bias=True), nn.Linear(d, d, bias=True)

    def forward(self, x):
        def heads(t):  # the local head count comes from the shape
            return t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           is_causal=True)
        return self.out_proj(y.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=True)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = RMSNorm(d), SelfAttention(d, n_head), RMSNorm(d), SwiGLU(d, 2 * d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 32, n_head: int = 4, n_layer: int = 2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, n_head) for _ in range(n_layer))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, idx, targets):
        h = self.tok_emb(idx)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))
        return self.criterion(logits.flatten(0, 1), targets.flatten())


# Written in the config: q/k/v enter the region separately (no 'region_input'), gate/up share one entry,
# the sequence is split by the embedding's reduce-scatter (no position embedding to add first).
LLAMA_PLAN = {
    "tok_emb": "vocab_scatter",
    "layers.*.norm[12]": "sequence",
    "layers.*.attn.[qkv]_proj": "colwise",
    "layers.*.attn.out_proj": "rowwise",
    "layers.*.mlp": "region_input",
    "layers.*.mlp.gate": "colwise",
    "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise",
    "norm": "sequence",
    "lm_head": "colwise_vocab",
    "criterion": "vocab_loss",
}


def tiny_llama() -> TinyLlama:
    torch.manual_seed(3)
    return TinyLlama()


class ModVocab(torch.utils.data.Dataset):
    def __init__(self, windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x, y = self.windows[i]
        return x % VOCAB, y % VOCAB


def _is_split(engine, param) -> bool:
    return isinstance(engine.parallel.placements.of(param).get("tp"), Shard)


MODELS = {"gpt": (tiny_gpt, corpus_windows, None), "llama": (tiny_llama, lambda: ModVocab(corpus_windows()),
                                                             LLAMA_PLAN)}


# ---- parity ------------------------------------------------------------------------------------------
def _parity(model: str, tp: int, sp: bool, accumulation: int = 1, stage: int = 0) -> dict:
    make, make_data, plan = MODELS[model]
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=accumulation,
                       tensor_parallel={"size": tp, "sequence_parallel": sp, "plan": plan},
                       zero_optimization={"stage": stage})
    cfg["optimizer"]["params"]["eps"] = STABLE_EPS
    dense_params = dict(make().named_parameters())

    def shards(engine) -> dict:
        local = dict(engine.module.named_parameters())
        sharded = {n for n, p in local.items() if _is_split(engine, p)}
        return {"dp": engine.mesh.size("dp"),
                "replicated": {n: p.detach().clone() for n, p in local.items() if n not in sharded},
                "sharded_numel": {n: local[n].numel() for n in sharded},
                "dense_numel": {n: dense_params[n].numel() for n in sharded},
                "dense_rows": {n: dense_params[n].shape[0] for n in sharded},
                "param_bytes": engine.memory_stats()["params"],
                "replicated_bytes": sum(4 * p.numel() for n, p in local.items() if n not in sharded)}

    result = layout_parity(cfg, make, make_data(), STEPS, inspect=shards)
    zero = f" zero{stage}" if stage else ""
    result["case"] = f"{model} tp{tp} sp={sp} dp{result['dp']} gas{accumulation}{zero}"
    return result


def _parity_cases(cases: list[tuple]) -> list[dict]:
    return [_parity(*case) for case in cases]


def _check(per_rank: list[list[dict]], tp: int) -> None:
    for case_index, first in enumerate(per_rank[0]):
        ranks = [r[case_index] for r in per_rank]
        for r in ranks:
            assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, \
                {k: r[k] for k in ("case", "loss_err", "norm_err", "param_err", "where")}
        assert first["losses"][-1] < first["losses"][0], first["case"]  # it trains
        # Parameters replicated over tp (norms, row-wise biases, position embedding) stay bit-identical.
        for r in ranks[1:]:
            for name, value in first["replicated"].items():
                assert torch.equal(value, r["replicated"][name]), (first["case"], name)
        # Per-rank bytes of every split parameter: 1/tp of the dense one (a padded vocabulary rounds up).
        for name, local in first["sharded_numel"].items():
            dense, rows = first["dense_numel"][name], first["dense_rows"][name]
            padded = -(-rows // tp) * tp if name in VOCAB_SPLIT else rows
            assert local * tp == dense // rows * padded, (first["case"], name, local, dense)
        split_dense = sum(first["dense_numel"].values())
        if "gpt" in first["case"] and "zero" not in first["case"]:  # no padding, unsharded over dp: exactly 1/tp
            assert sum(first["sharded_numel"].values()) * tp == split_dense
            assert first["param_bytes"] == first["replicated_bytes"] + 4 * split_dense // tp


def test_tp2_parity_gpt_and_plan_model_with_and_without_sequence_parallel(world2):
    cases = [("gpt", 2, False), ("gpt", 2, True), ("llama", 2, False), ("llama", 2, True)]
    _check(world2.run(_parity_cases, cases), tp=2)


def test_tp4_and_dp2_tp2_parity(world4):
    tp4 = [("gpt", 4, False), ("gpt", 4, True), ("llama", 4, False), ("llama", 4, True)]
    per_rank = world4.run(_parity_cases, tp4 + [("gpt", 2, False, 2), ("gpt", 2, True, 2), ("llama", 2, True)])
    _check([r[:4] for r in per_rank], tp=4)
    _check([r[4:] for r in per_rank], tp=2)
    assert [c["case"] for c in per_rank[0][4:]] == ["gpt tp2 sp=False dp2 gas2", "gpt tp2 sp=True dp2 gas2",
                                                      "llama tp2 sp=True dp2 gas1"]


def test_dp2_tp2_with_every_zero_stage(world4):
    """TP on the tp axis, ZeRO-1/2/3 on the dp axis: the ZeRO strategy only sees the local (split) module."""
    cases = [("gpt", 2, False, 2, 1), ("gpt", 2, True, 1, 2), ("llama", 2, True, 2, 3), ("gpt", 2, False, 1, 3)]
    per_rank = world4.run(_parity_cases, cases)
    _check(per_rank, tp=2)
    assert [c["case"] for c in per_rank[0]] == ["gpt tp2 sp=False dp2 gas2 zero1", "gpt tp2 sp=True dp2 gas1 zero2",
                                                  "llama tp2 sp=True dp2 gas2 zero3", "gpt tp2 sp=False dp2 gas1 zero3"]


# ---- communication, counted ---------------------------------------------------------------------------
def _count_comm(sp: bool) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, tensor_parallel={"size": 2, "sequence_parallel": sp},
                       batch_agreement="off")  # only tensor parallelism's traffic: no check of the peers' batches
    engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())
    x, y = next(loader)
    engine.comm_stats(reset=True)
    loss = engine(x, y)
    forward = engine.comm_stats(reset=True, by_tag=True)
    engine.backward(loss)
    backward = engine.comm_stats(reset=True, by_tag=True)
    engine.step()
    return {"forward": forward, "backward": backward, "bsh": x.numel() * TINY["d_model"], "bs": x.numel()}


def _ops(stats: dict, tag: str) -> dict:
    """{op: (calls, elements)} for one tag on the tp axis."""
    return {op: (tags[tag]["calls"], tags[tag]["elements"]) for op, tags in stats.get("tp", {}).items()
            if tag in tags}


def test_tp_communication_per_layer_per_micro_batch(world2):
    L, h = TINY["n_layer"], TINY["d_model"]
    plain, seq = world2.run(_count_comm, False)[0], world2.run(_count_comm, True)[0]
    bsh, bs = plain["bsh"], plain["bs"]
    for r in (plain, seq):
        assert set(r["forward"]) == {"tp"} and set(r["backward"]) == {"tp"}, r  # nothing on other axes (dp=1)
        # The vocab-parallel loss: one max and one (sum-exp, target logit) sum per token, nothing else.
        assert _ops(r["forward"], "tp_loss") == {"all_reduce": (2, 3 * bs)}
        assert _ops(r["backward"], "tp_loss") == {}
    # Without sequence parallelism: per layer 2 all-reduces of b*s*h forward (attn.o, mlp.proj) and 2
    # backward (the attention and MLP entries); the head's entry adds one more backward all-reduce and the
    # vocab-parallel embedding one forward.
    assert _ops(plain["forward"], "tp") == {"all_reduce": (2 * L, 2 * L * bsh)}
    assert _ops(plain["backward"], "tp") == {"all_reduce": (2 * L + 1, (2 * L + 1) * bsh)}
    assert _ops(plain["forward"], "tp_embed") == {"all_reduce": (1, bsh)}
    assert set(plain["forward"]["tp"]["all_reduce"]) == {"tp", "tp_embed", "tp_loss"}
    assert set(plain["backward"]["tp"]["all_reduce"]) == {"tp"}
    # With it: the same volume as all-gathers (entries) and reduce-scatters (exits), and their transposes
    # backward; plus the embedding output's split (an all-gather backward) and the norms' gradient sums.
    assert _ops(seq["forward"], "tp") == {"all_gather": (2 * L + 1, (2 * L + 1) * bsh),
                                          "reduce_scatter": (2 * L, 2 * L * bsh)}
    assert _ops(seq["backward"], "tp") == {"all_gather": (2 * L, 2 * L * bsh),
                                           "reduce_scatter": (2 * L + 1, (2 * L + 1) * bsh)}
    assert _ops(seq["forward"], "tp_embed") == {"all_reduce": (1, bsh)}
    assert _ops(seq["backward"], "tp_scatter") == {"all_gather": (1, bsh)}
    # LayerNorm weight and bias of ln1, ln2 per layer and of ln_f: gradients summed over tp.
    assert _ops(seq["backward"], "tp_grad") == {"all_reduce": (4 * L + 2, (4 * L + 2) * h)}
    assert set(seq["backward"]["tp"]) == {"all_gather", "reduce_scatter", "all_reduce"}


# ---- random numbers ------------------------------------------------------------------------------------
def _dropout_streams(sp: bool) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, tensor_parallel={"size": 2, "sequence_parallel": sp})
    engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(dropout=0.3), config=cfg,
                                                training_data=corpus_windows())
    for _ in range(3):
        engine.train_batch()
    model = engine.module
    q = torch.randn(2, 1, 16, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(11)
    inside = model.blocks[0].attn.core(q, q, q)  # this rank's heads: per-rank mask
    outside = model.embed.dropout(torch.ones(2, 16, 32))  # replicated activations: shared mask
    after = torch.rand(4)  # the default stream continued as if the per-rank stream were never used
    torch.manual_seed(11)
    model.embed.dropout(torch.ones(2, 16, 32))
    expected_after = torch.rand(4)
    state = engine.full_state_dict()  # raises if a replicated tensor differs between the tp ranks
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if not _is_split(engine, p)}
    return {"inside": inside, "outside": outside, "after": after, "expected_after": expected_after,
            "replicated": replicated, "finite": all(bool(torch.isfinite(v).all()) for v in state.values())}


def _deterministic_without_dropout() -> list[float]:
    runs = []
    for _ in range(2):
        cfg = adamw_config(train_micro_batch_size_per_gpu=2, tensor_parallel={"size": 2, "sequence_parallel": True})
        engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())
        runs.append([float(engine.train_batch()) for _ in range(3)])
    return runs


def test_dropout_differs_inside_regions_and_agrees_outside(world2):
    for sp in (False, True):
        a, b = world2.run(_dropout_streams, sp)
        assert not torch.equal(a["inside"], b["inside"])
        assert torch.equal(a["outside"], b["outside"])
        assert torch.equal(a["after"], a["expected_after"]) and torch.equal(a["after"], b["after"])
        assert a["finite"]
        for name, value in a["replicated"].items():  # trained with dropout, replicas still identical
            assert torch.equal(value, b["replicated"][name]), (sp, name)
    first, second = world2.run(_deterministic_without_dropout)[0]
    assert first == second


# ---- the vocab-parallel loss on its own ---------------------------------------------------------------
def _vocab_loss_vs_dense() -> dict:
    from paratrain.comm import build_mesh
    from paratrain.layout.mesh import ParallelDims
    from paratrain.parallel.tp import vocab_parallel_cross_entropy
    from paratrain.parallel.tp.layers import padded_size

    mesh = build_mesh(ParallelDims(dist.get_world_size(), tp=dist.get_world_size()))
    axis = mesh.axis("tp")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(24, VOCAB, generator=gen) * 8  # large logits: the max shift matters
    targets = torch.randint(0, VOCAB, (24,), generator=gen)
    targets[::5] = -100  # ignored tokens
    local = padded_size(VOCAB, axis.size) // axis.size
    start = axis.rank * local
    mine = F.pad(logits, (0, local * axis.size - VOCAB))[:, start:start + local].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets, axis, start, VOCAB)
    loss.backward()
    dense = logits.clone().requires_grad_()
    want = F.cross_entropy(dense, targets)
    want.backward()
    grad_want = F.pad(dense.grad, (0, local * axis.size - VOCAB))[:, start:start + local]
    return {"loss": rel_diff(loss.detach(), want.detach()), "grad": rel_diff(mine.grad, grad_want),
            "stats": mesh.stats.snapshot(by_tag=True)}


def test_vocab_parallel_cross_entropy_matches_dense_with_padding_and_ignored_tokens(world2):
    for r in world2.run(_vocab_loss_vs_dense):
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-6, r
        assert r["stats"]["tp"]["all_reduce"]["tp_loss"] == {"calls": 2, "elements": 3 * 24, "bytes": 4 * 3 * 24}


# ---- bad plans fail on every rank, before any collective -----------------------------------------------
def _bad_plan(plan) -> str | None:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, tensor_parallel={"size": 2, "plan": plan})
    try:
        paratrain.initialize(model=tiny_llama(), config=cfg)
    except ValueError as exc:
        return str(exc)
    return None


def test_bad_plans_fail_identically_on_every_rank(world2):
    messages = world2.run(_bad_plan, {**LLAMA_PLAN, "layers.*.attn.qkv": "colwise"})
    assert messages[0] == messages[1] and "'layers.*.attn.qkv' (colwise) matches no module" in messages[0]
    messages = world2.run(_bad_plan, None)
    assert messages[0] == messages[1] and "needs a plan for TinyLlama" in messages[0]
    missing_o = {k: v for k, v in LLAMA_PLAN.items() if k != "layers.*.attn.out_proj"}
    assert "no rowwise layer sits beside it" in world2.run(_bad_plan, missing_o)[0]
    world2.run(dist.barrier)  # nobody is stuck in a collective


# ---- end to end: the built-in job through the CLI ------------------------------------------------------
def test_train_command_with_tensor_and_sequence_parallel(tmp_path):
    import json

    from tests.distributed.test_cli import ROOT, _free_port, _paratrain

    config = json.loads((ROOT / "configs" / "demo.json").read_text())
    config["trainer"].update(model="gpt-tiny", steps=8, eval_every=4, eval_batches=2, progress_bar=False)
    config["tensor_parallel"] = {"size": 2, "sequence_parallel": True}
    (tmp_path / "c.json").write_text(json.dumps(config))
    run = _paratrain("train", "--config", "c.json", "--run-dir", "out", "--nproc-per-node", "2",
                     "--master-port", _free_port(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["layout"] == "tp2" and summary["last_loss"] < summary["first_loss"]
    assert summary["params"] == GPT("gpt-tiny").num_params()  # the dense count, not one rank's shard
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert set(row["comm"]["tp"]) >= {"all_gather", "reduce_scatter"}
