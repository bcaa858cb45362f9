"""A PipelineModule whose `layer_names` give the plain model's names, under tensor parallelism (issue 19).

The user's model: [Embed, Block x 4, Head] with layer_names ["embed", "blocks.0", ..., "blocks.3", "head"]; the
tensor-parallel plan is written for the stage modules ("*.attn.q": the PipelineModule's own names are
"1.attn.q"), one level shallower than the names checkpoints use ("blocks.0.attn.q"). Every step must undo
itself in the coordinates it produced: full_state_dict equals the plain single-process model's, a checkpoint
resumes bit for bit in the same layout and loads into dp2, and a step that located a shard wrongly is refused
by name before anything is written.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.checkpoint import CheckpointError
from paratrain.models.gpt.model import Block, GPTConfig
from paratrain.testing import rel_diff
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, d_model=32, bias=True)
NAMES = ["embed", *(f"blocks.{i}" for i in range(CFG.n_layer)), "head"]
PLAN = {"*.attn": "region_input", "*.attn.[qkv]": "colwise", "*.attn.o": "rowwise", "*.mlp.fc": "colwise",
        "*.mlp.proj": "rowwise"}
STEPS = 3


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(CFG.vocab_size, CFG.d_model)
        self.pos = nn.Embedding(CFG.seq_len, CFG.d_model)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))  # (b, s, d)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(CFG.d_model)
        self.out = nn.Linear(CFG.d_model, CFG.vocab_size)

    def forward(self, h):
        return self.out(self.norm(h))  # (b, s, V)


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Plain(nn.Module):
    """The model as its user writes it for one process: these names are what checkpoints must use."""

    def __init__(self, seed: int = 1):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.blocks, self.head = Embed(), nn.ModuleList(Block(CFG) for _ in range(CFG.n_layer)), Head()

    def forward(self, idx, targets):
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return _loss(self.head(h), targets)


def _pipe(seed: int = 1) -> paratrain.PipelineModule:
    plain = Plain(seed)
    return paratrain.PipelineModule([plain.embed, *plain.blocks, plain.head], loss_fn=_loss, layer_names=NAMES)


def _config(dp_only: bool = False) -> dict:
    layout = {} if dp_only else {"pipeline": {"stages": 2, "partition": "uniform"},
                                 "tensor_parallel": {"size": 2, "plan": PLAN}}
    return adamw_config(train_batch_size=8, train_micro_batch_size_per_gpu=2, zero_optimization={"stage": 1},
                        **layout)


def _optimizer_tensors(engine) -> list[torch.Tensor]:
    return [v.clone() for state in engine.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim()]


def _train_save_resume(directory: str) -> dict:
    """dp2 x pp2 x tp2 ZeRO-1: train, save, resume into a fresh engine, and go on side by side."""
    engine, *_ = paratrain.initialize(model=_pipe(), config=_config(), training_data=corpus_windows())
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    engine.save_checkpoint(directory)
    saved = engine.full_state_dict()
    resumed, *_ = paratrain.initialize(model=_pipe(seed=7), config=_config(), training_data=corpus_windows())
    resumed.load_checkpoint(directory)
    same = {"state": all(torch.equal(a, b) for a, b in zip(saved.values(), resumed.full_state_dict().values())),
            "names": list(saved) == list(resumed.full_state_dict()),
            "optimizer": all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(engine),
                                                                 _optimizer_tensors(resumed)))}
    after = (float(engine.train_batch()), float(resumed.train_batch()))  # the next step, from both
    return {"layout": engine.mesh.dims.describe(), "losses": losses, "state": saved, "same": same, "after": after}


def _load_dp2(directory: str) -> dict:
    engine, *_ = paratrain.initialize(model=_pipe(seed=9), config=_config(dp_only=True),
                                      training_data=corpus_windows())
    engine.load_checkpoint(directory)
    return {"layout": engine.mesh.dims.describe(), "state": engine.full_state_dict(),
            "loss": float(engine.train_batch())}


def test_layer_names_under_pp_and_tp_unshard_save_and_resume(world8, world2, tmp_path):
    directory = str(tmp_path / "ckpt")
    runs = world8.run(_train_save_resume, directory)
    ref = reference_run(Plain, adamw_config(train_batch_size=8), corpus_windows(), STEPS + 1, keep_states=True)
    for run in runs:
        assert run["layout"] == "dp2 x pp2 x tp2"
        assert max(rel_diff(a, b) for a, b in zip(run["losses"], ref.losses)) <= 1e-5
        assert run["same"] == {"state": True, "names": True, "optimizer": True}
        assert run["after"][0] == run["after"][1]  # the resumed engine continues bit for bit
    state = runs[0]["state"]
    assert set(state) == set(Plain().state_dict())  # the plain model's names, whole tensors
    plain = ref.states[STEPS - 1]  # the single-process model after the same STEPS steps
    assert all(state[k].shape == plain[k].shape for k in plain)
    # The key projection's bias is split like the rest (checked above, bit for bit), but its gradient is
    # exactly zero in exact arithmetic (softmax ignores a shift shared by all keys): Adam turns the rounding
    # noise of each run into steps of its own, so two correct runs disagree on it (tests/cases.py, bias=False).
    compared = [k for k in plain if not k.endswith("attn.k.bias")]
    assert len(compared) == len(plain) - CFG.n_layer
    assert max(rel_diff(state[k], plain[k]) for k in compared) <= 1e-5
    for run in runs[1:]:
        assert all(torch.equal(state[k], run["state"][k]) for k in state)  # every rank assembles the same
    loaded = world2.run(_load_dp2, directory)
    for run in loaded:
        assert run["layout"] == "dp2"
        assert all(torch.equal(state[k], run["state"][k]) for k in state)
        assert rel_diff(run["loss"], runs[0]["after"][0]) <= 1e-5  # the same next step in another layout
    assert rel_diff(runs[0]["after"][0], ref.losses[STEPS]) <= 1e-5  # and the plain model's next step


def _misplaced(directory: str) -> dict:
    """A tensor-parallel step that (wrongly) reports every tensor as whole on each tp rank: the old bug."""
    engine, *_ = paratrain.initialize(model=_pipe(), config=_config(), training_data=corpus_windows())
    engine.train_batch()
    step = next(s for s in engine.parallel.steps if s.name == "tensor parallel")
    step.origin = lambda found: found.replicated_over("tp")
    out = {}
    for what, call in (("save", lambda: engine.save_checkpoint(directory)), ("full", engine.full_state_dict)):
        try:
            call()
            out[what] = None
        except CheckpointError as exc:
            out[what] = str(exc)
    out["written"] = os.listdir(directory) if os.path.isdir(directory) else []
    return out


def test_a_shard_recorded_as_a_whole_tensor_is_refused_before_anything_is_written(world8, tmp_path):
    for result in world8.run(_misplaced, str(tmp_path / "never")):
        assert result["written"] == []
        for what in ("save", "full"):
            message = result[what]
            assert message is not None, what
            assert "is split over tp along dim" in message and "tensor parallel: the tensor-parallel plan gave " \
                "module" in message, message
        assert "refused, nothing was written" in result["save"]


@pytest.mark.parametrize("bad", ["shape", "copies"])
def test_pieces_check_names_the_tensor_and_the_step(bad):
    from paratrain.checkpoint.pieces import check_pieces

    base = {"key": "model/w", "name": "w", "shape": [4, 2], "dtype": "float32", "offsets": [0, 0], "box": [4, 2],
            "start": 0, "end": 8, "rank": 0, "owned": True, "digest": None, "replicated": []}
    if bad == "shape":
        pieces = [{**base, "shape": [2, 2], "box": [2, 2], "end": 4}, {**base, "rank": 1, "owned": False}]
        want = "'w' is a tensor of shape [2, 2] (float32) on rank 0 but [4, 2] (float32) on rank 1"
    else:
        pieces = [{**base, "digest": "a", "replicated": ["tp"]},
                  {**base, "rank": 1, "owned": False, "digest": "b", "replicated": ["tp"]}]
        want = "tensors replicated over tp differ between tp ranks: 'w'"
    message = check_pieces(pieces, lambda name: f"STEP said something about {name}")
    assert want in message and "STEP said something about w" in message


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_explanation_names_the_module_no_pattern_matched(sequence_parallel):
    from paratrain.layout.mesh import Axis
    from paratrain.parallel.tp.apply import AppliedPlan

    plan = {"*.attn.[qkv]": "colwise", "*.attn.o": "rowwise", "*.norm": "sequence"}
    applied = AppliedPlan({"1.attn.q": "colwise"}, Axis("tp", (0, 1), 0, None), sequence_parallel, plan=plan)
    matched = applied.explain("1.attn.q.weight")
    assert matched == "the tensor-parallel plan gave module '1.attn.q' the style 'colwise' (pattern '*.attn.[qkv]')"
    missed = applied.explain("blocks.0.ln1.weight")
    assert missed.startswith("no pattern of the tensor-parallel plan matched module 'blocks.0.ln1', so the "
                             "tensor-parallel step kept it whole on every tp rank (splitting patterns: "
                             "['*.attn.[qkv]', '*.attn.o'])")
    assert ("must be marked 'sequence'" in missed) == sequence_parallel  # the SP hint only where SP is on
