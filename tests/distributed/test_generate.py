"""engine.generate in every layout equals transformers' own `generate` on the same weights: greedy tokens of
left-padded prompts of different lengths, before and after training steps; the uncached path (the whole
sequence each step) equals the KV-cached one; seeded sampling (temperature, top-p) draws the same tokens as
transformers' sampling from the same seed. paratrain's GPT, which transformers cannot load, is compared with a
one-process copy decoded by this file's own loop (each prompt alone, no cache, transformers' warpers and the same
seed). Under ZeRO-3 a call gathers each unit once, not once per token.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from tests.cases import tiny_hf

pytestmark = pytest.mark.multiprocess

NEW = 6
LLAMA4 = {"num_hidden_layers": 4}  # a pipeline of 2 ranks x 2 chunks (ZB-V) needs 4 layers


def _prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of lengths 4, 7 and 6 (0: padding)."""
    ids = torch.randint(3, vocab, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _config(layout: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, **layout}


def _train(engine, vocab: int, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(11 + engine.mesh.local_rank("dp"))
    rows = iter([(x[:, :-1], x[:, 1:]) for x in torch.randint(0, vocab, (64, 2, 9), generator=g)])
    for _ in range(steps):
        engine.train_batch(rows)


def _hf_generate(model, ids, mask, **kwargs) -> torch.Tensor:
    return model.eval().generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, **kwargs)


def _sample(generate) -> torch.Tensor:
    torch.manual_seed(7)
    return generate(do_sample=True, temperature=0.8, top_p=0.9)


def _model(family: str, overrides: dict):
    """A tiny transformers model of `family`, or paratrain's own family ("paratrain:<preset>")."""
    if family.startswith("paratrain:"):
        from paratrain.models import build_model

        torch.manual_seed(3)
        return build_model(family.removeprefix("paratrain:"), **overrides)
    return tiny_hf(family, **overrides)


def _transformers_copy(engine, model, directory: str):
    """The engine's model as transformers loads it (collective): what save_pretrained writes, or for paratrain's
    Llama (no saved-model format of its own) a LlamaForCausalLM of its shape given its full state dict, whose
    names are transformers'."""
    import transformers

    if not hasattr(model, "generation_config") and type(model).__name__ == "Llama":
        c = model.config
        config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                                          num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                                          num_key_value_heads=c.n_kv_head, rope_theta=c.rope_theta,
                                          rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                                          max_position_embeddings=c.seq_len)
        reference = transformers.LlamaForCausalLM(config)
        reference.load_state_dict(engine.full_state_dict())
        return reference
    if type(model).__name__ == "GPT":  # no transformers format: the one-process model, decoded by the test's loop
        return _OneProcess(engine.full_state_dict(), model.config)
    engine.save_pretrained(directory)
    return transformers.AutoModelForCausalLM.from_pretrained(directory)


class _OneProcess:
    """The single-process reference for a family transformers does not load (paratrain's GPT): a plain copy of
    the model given the engine's full state dict, decoded by this test's own loop, not paratrain's: each prompt
    alone (its padding removed), the whole sequence through the model at every step (no cache), the next token
    by argmax or, sampling, through transformers' warpers (temperature, then top-p) and `torch.multinomial` over
    the batch's rows from the global seed, as transformers' `generate` draws."""

    def __init__(self, state: dict, config):
        from paratrain.models import build_model

        self.model = build_model("gpt-tiny", **{f: getattr(config, f) for f in ("n_layer", "d_model", "seq_len")})
        self.model.load_state_dict(state)

    def eval(self):
        self.model.eval()
        return self

    def generate(self, ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id=None, do_sample=False,
                 temperature=1.0, top_p=None, **_):
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        assert eos_token_id is None  # no row stops early: every row takes max_new_tokens steps
        warpers = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)] if do_sample else []
        rows, new = [row[mask.bool()] for row, mask in zip(ids, attention_mask)], []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                scores = torch.stack([self.model(row[None])[0, -1] for row in rows]).float()
                for warp in warpers:
                    scores = warp(None, scores)
                token = torch.multinomial(scores.softmax(-1), 1).squeeze(-1) if do_sample else scores.argmax(-1)
                rows = [torch.cat([row, t[None]]) for row, t in zip(rows, token)]
                new.append(token)
        return torch.cat([ids, torch.stack(new, 1)], 1)


def _case(family: str, overrides: dict, layout: dict, directory: str) -> dict:
    model = _model(family, overrides)
    vocab = model.config.vocab_size
    ids, mask = _prompts(vocab)
    hf_config = getattr(model, "generation_config", None)
    eos = hf_config.eos_token_id if hf_config is not None else None  # transformers stops a row there (Llama: 2)
    engine, *_ = paratrain.initialize(model=model, config=_config(layout))
    ours = lambda **kw: engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0,  # noqa: E731
                                        eos_token_id=eos, **kw).cpu()
    engine.comm_stats(reset=True)
    before = ours()
    gathers = engine.comm_stats(by_tag=True).get("dp", {}).get("all_gather", {}).get("param", {}).get("calls", 0)
    units = len(getattr(engine.grad_sync, "units", [])) + 1
    uncached, sampled = ours(use_cache=False), _sample(ours)
    reference = _transformers_copy(engine, model, f"{directory}/before")
    _train(engine, vocab)
    after, after_uncached = ours(), ours(use_cache=False)
    trained = _transformers_copy(engine, model, f"{directory}/after")
    theirs = lambda m, **kw: _hf_generate(m, ids, mask, eos_token_id=eos, **kw)  # noqa: E731
    want_before, want_after = theirs(reference), theirs(trained)
    want_sampled = _sample(lambda **kw: theirs(reference, top_k=0, **kw))
    return {"before": torch.equal(before, want_before), "uncached": torch.equal(uncached, want_before),
            "after": torch.equal(after, want_after), "after_uncached": torch.equal(after_uncached, want_after),
            "sampled": torch.equal(sampled, want_sampled), "trained": not torch.equal(want_after, want_before),
            "sampling_differs": not torch.equal(sampled, want_before),
            "gathers": gathers, "units": units, "tokens": before[:, 7:].tolist()}


def _cases(cases: dict, root: str) -> dict:
    return {name: _case(family, overrides, layout, f"{root}/{name}")
            for name, (family, overrides, layout) in cases.items()}


ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
TWO_RANKS = {
    "ddp2": ("llama", {}, {}),
    "zero3": ("llama", {}, ZERO3),
    "tp2": ("llama", {}, {"tensor_parallel": {"size": 2}}),
    "tp2_sp": ("qwen2", {}, {"tensor_parallel": {"size": 2, "sequence_parallel": True}}),
    "pp2_1f1b": ("llama", {}, {"pipeline": {"stages": 2, "schedule": "1f1b"}}),
    "pp2_zbv": ("llama", LLAMA4, {"pipeline": {"stages": 2, "schedule": "zb-v"}}),
    "ep2_mixtral": ("mixtral", {}, {"expert_parallel": {"size": 2}}),
    # a sliding window shorter than the prompts (transformers masks by cache position, as the core does)
    "ddp2_mistral_window3": ("mistral", {"sliding_window": 3}, {}),
    # paratrain's own families: the Llama (RoPE, GQA) and the GPT (a learned position table) in their tp layouts
    "tp2_paratrain_llama": ("paratrain:llama-tiny", {}, {"tensor_parallel": {"size": 2}}),
    "zero3_paratrain_gpt": ("paratrain:gpt-tiny", {}, ZERO3),
}


def _check(results: dict) -> None:
    for name, r in results.items():
        assert r["before"] and r["uncached"] and r["after"] and r["after_uncached"] and r["sampled"], (name, r)
        assert r["trained"], (name, "training changed no generated token: the 'after' comparison shows nothing")
        assert r["sampling_differs"], (name, "sampling drew the greedy tokens: the 'sampled' comparison shows nothing")
        if name.startswith("zero3") or "zero3" in name:
            assert 0 < r["gathers"] <= r["units"], (name, r)  # once per unit per call, not per token


def _refused_under_context_parallelism() -> str:
    from paratrain.errors import RunError

    engine, *_ = paratrain.initialize(model=tiny_hf("llama"), config=_config({"context_parallel": {"size": 2}}))
    ids, mask = _prompts(engine.module.config.vocab_size)
    with pytest.raises(RunError) as refused:
        engine.generate(ids, attention_mask=mask)
    return str(refused.value)


def test_generate_equals_transformers_in_every_layout_of_two_ranks(world2, tmp_path):
    _check(world2.run(_cases, TWO_RANKS, str(tmp_path))[0])
    assert all("context_parallel.size = 2" in message for message in world2.run(_refused_under_context_parallelism))


EIGHT_RANKS = {
    "dp4_tp2_zero3": ("llama", {}, {**ZERO3, "tensor_parallel": {"size": 2}}),
    "dp2_pp2_tp2": ("llama", {}, {"pipeline": {"stages": 2}, "tensor_parallel": {"size": 2}}),
}


def test_generate_equals_transformers_in_hybrid_layouts_of_eight_ranks(world8, tmp_path):
    _check(world8.run(_cases, EIGHT_RANKS, str(tmp_path))[0])
