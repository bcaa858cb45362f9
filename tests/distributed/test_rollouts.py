"""Rollouts in the training layout (`engine.rollout`): each data-parallel rank samples its own prompts' completions,
every layout draws the same tokens, and the log-probs the sampler returned equal the ones training recomputes.

One seeded rollout of 4 left-padded prompts x 2 generations (keys: seed, step, global prompt index, generation
index; temperature 0.9, top-p 0.95, a set of end tokens frequent enough that rows stop at different lengths) in
DDP, ZeRO-3, tp2, tp2 + SP, pp2 and ep2 (Mixtral), the rows dealt to the data-parallel ranks. Checked:
- against one process: the plain transformers model run once over prompt + completion (TRL's recomputation:
  positions from the attention mask, logits / temperature) gives, at every completion position, the token the key
  draws (`keyed_next_tokens` on its logits) and the rollout's log-prob within 1e-5;
- across layouts: every layout's completions of the 8 rows are the same, token for token;
- training against generation in the same layout: the GRPO objective's recomputed log-probs of the completions
  equal the rollout's within 1e-6 (the largest difference seen by the objective's head on every rank), and the
  logged `logprob_mismatch` (their mean) too.
"""

from __future__ import annotations

import copy

import pytest
import torch

import paratrain
from tests.cases import tiny_hf

pytestmark = pytest.mark.multiprocess

PROMPTS, GENERATIONS, NEW, TEMPERATURE, TOP_P = 4, 2, 6, 0.9, 0.95
END = list(range(3, 40))  # frequent end tokens: rows stop at different lengths, some not at all
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
LAYOUTS = {
    "ddp2": ("llama", {}),
    "zero3": ("llama", ZERO3),
    "tp2": ("llama", {"tensor_parallel": {"size": 2}}),
    "tp2_sp": ("llama", {"tensor_parallel": {"size": 2, "sequence_parallel": True}}),
    "pp2": ("llama", {"pipeline": {"stages": 2, "schedule": "1f1b"}}),
    "ep2": ("mixtral", {"expert_parallel": {"size": 2}}),
}


def _rows(vocab: int):
    """The global rollout batch: each prompt repeated for its generations (TRL's order), left-padded, with keys."""
    from paratrain.generation import rollout_keys

    ids = torch.randint(40, vocab, (PROMPTS, 8), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3], mask[2, :1], mask[3, :5] = 0, 0, 0
    ids = ids.masked_fill(mask == 0, 0).repeat_interleave(GENERATIONS, 0)
    mask = mask.repeat_interleave(GENERATIONS, 0)
    prompt = torch.arange(PROMPTS).repeat_interleave(GENERATIONS)
    return ids, mask, rollout_keys(seed=1, step=3, prompt_index=prompt,
                                   generation_index=torch.arange(GENERATIONS).repeat(PROMPTS))


def _recording_grpo(seen: list):
    """GRPO's objective that also records the largest |training log-prob - rollout log-prob| it sees."""
    from paratrain.config.objective import ObjectiveConfig
    from paratrain.objectives.grpo import GRPO

    class Recording(GRPO):
        def __call__(self, batch, lp):
            old = batch.tokens["old_per_token_logps"].to(lp.values)
            seen.append(float(((lp.values - old).abs() * lp.mask).max()))
            return super().__call__(batch, lp)

    return Recording(ObjectiveConfig(type="grpo", temperature=TEMPERATURE))


def _one_process(reference, ids, mask, keys, rollout) -> dict:
    """TRL's recomputation with the plain model: each completion position's drawn token and log-prob."""
    from paratrain.generation import keyed_next_tokens

    full = torch.cat([ids, rollout.completion_ids], 1)
    attention = torch.cat([mask, rollout.completion_mask], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = reference(full, attention_mask=attention, position_ids=positions).logits[:, ids.shape[1] - 1:-1]
    logits = logits.float()
    log_probs = (logits / TEMPERATURE).log_softmax(-1).gather(2, rollout.completion_ids[..., None]).squeeze(-1)
    drawn = torch.stack([keyed_next_tokens(logits[:, t], keys, t, TEMPERATURE, None, TOP_P)
                         for t in range(logits.shape[1])], 1)
    inside = rollout.completion_mask.bool()
    return {"tokens": bool((drawn == rollout.completion_ids)[inside].all()),
            "log_probs": float((log_probs - rollout.log_probs).abs()[inside].max())}


def _case(family: str, layout: dict) -> dict:
    model = tiny_hf(family)
    reference = copy.deepcopy(model).eval()
    seen: list[float] = []
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}, **layout}
    engine, *_ = paratrain.initialize(model=model, config=config, objective=_recording_grpo(seen))
    ids, mask, keys = _rows(model.config.vocab_size)
    dp, rank = engine.mesh.size("dp"), engine.mesh.local_rank("dp")
    mine = slice(rank * len(ids) // dp, (rank + 1) * len(ids) // dp)
    rollout = engine.rollout(ids[mine], mask[mine], keys[mine], max_new_tokens=NEW, temperature=TEMPERATURE,
                             top_p=TOP_P, eos_token_id=END, pad_token_id=0)
    rollout = type(rollout)(*(t.cpu() for t in (rollout.completion_ids, rollout.completion_mask,
                                                 rollout.log_probs)))
    # (sequence parallelism splits prompt + completion over tp: 8 + NEW columns)
    batch = rollout.padded(NEW).to_batch(ids[mine], mask[mine], torch.linspace(-1, 1, len(ids))[mine])
    engine.eval_batch(iter([batch]), num_micro_batches=1)
    completions = [row[m.bool()].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
    return {"rows": list(range(len(ids)))[mine], "completions": completions,
            "one_process": _one_process(reference, ids[mine], mask[mine], keys[mine], rollout),
            "training": max(seen) if seen else None,
            "mismatch": engine.evaluation_metrics().get("logprob_mismatch")}


def _cases() -> dict:
    return {name: _case(family, layout) for name, (family, layout) in LAYOUTS.items()}


def test_rollouts_are_the_same_in_every_layout_and_training_recomputes_their_log_probs(world2):
    ranks = world2.run(_cases)
    global_rows = {}
    for name in LAYOUTS:
        rows = {}
        for r in ranks:
            case = r[name]
            assert case["one_process"]["tokens"], (name, case)
            assert case["one_process"]["log_probs"] <= 1e-5, (name, case)
            rows.update(zip(case["rows"], case["completions"]))
        assert sorted(rows) == list(range(PROMPTS * GENERATIONS)), (name, rows)
        global_rows[name] = [rows[i] for i in sorted(rows)]
        trained = [r[name]["training"] for r in ranks if r[name]["training"] is not None]
        assert trained and max(trained) <= 1e-6, (name, trained)
        mismatch = [r[name]["mismatch"] for r in ranks if r[name]["mismatch"] is not None]
        assert mismatch and max(mismatch) <= 1e-6, (name, mismatch)
    lengths = {len(c) for c in global_rows["ddp2"]}
    assert len(lengths) > 1 and NEW in lengths, lengths  # rows stopped at different lengths, some ran to the end
    dense = {name: rows for name, rows in global_rows.items() if name != "ep2"}
    assert all(rows == global_rows["ddp2"] for rows in dense.values()), global_rows
