"""The Llama family: transformers' LlamaForCausalLM computes the same logits on the same weights (same names,
no mapping), the presets have the published parameter counts, and its spec refuses a tp that splits k/v heads."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.config import ConfigError
from paratrain.engine.strategies import strategies_of
from paratrain.models import LLAMA_PRESETS, Llama, LlamaConfig
from paratrain.parallel.checks import check_model
from tests.cases import import_or_skip, tiny_llama

# Meta's published counts (the model cards; 405B: Llama 3.1).
PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(preset):
    assert LLAMA_PRESETS[preset].num_params() == PUBLISHED[preset]


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}, {"n_kv_head": 4}])
def test_the_parameter_formula_counts_the_built_model(overrides):
    model = tiny_llama(**overrides)
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())


def _hf_pair(**overrides):
    transformers = import_or_skip("transformers")
    ours = tiny_llama(seed=3, **overrides)
    cfg = ours.config
    rope_scaling = None
    if cfg.rope_scaling is not None:
        factor, low, high, old = cfg.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": old}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=max(cfg.seq_len, 64), rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=rope_scaling, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False)
    hf_cfg._attn_implementation = "eager"
    theirs = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert [k for k in missing if not k.endswith("rotary_emb.inv_freq")] == [] and unexpected == []
    return ours.eval(), theirs


@pytest.mark.parametrize("overrides", [{}, {"rope_scaling": (8.0, 1.0, 4.0, 8)}, {"tie_embeddings": True},
                                       {"n_kv_head": 1}])
def test_logits_equal_transformers_llama(overrides):
    ours, theirs = _hf_pair(**overrides)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(input_ids=idx).logits
        got = ours(idx)
        # positions other than arange: what context parallelism passes for a chunk
        positions = torch.arange(5, 21).unsqueeze(0).expand(2, -1)
        want_shifted = theirs(input_ids=idx, position_ids=positions).logits
        got_shifted = ours(idx, position_ids=positions)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got_shifted - want_shifted).abs().max() <= 1e-5 * want_shifted.abs().max()
    assert not torch.allclose(got, got_shifted)  # the positions matter


def test_tp_that_splits_kv_heads_is_refused_by_name():
    cfg = paratrain.resolve_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"size": 4}}, 4)
    with pytest.raises(ConfigError, match=r"tensor_parallel.size = 4 does not divide the Llama's n_kv_head \(2\).*"
                                          r"use a tensor_parallel.size in \[1, 2\]"):
        check_model(tiny_llama(), strategies_of(cfg))


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match=r"n_head \(4\) must be a multiple of n_kv_head \(3\)"):
        LlamaConfig(n_head=4, n_kv_head=3, d_model=32)
    assert Llama("llama-tiny").config.d_ff == 64
