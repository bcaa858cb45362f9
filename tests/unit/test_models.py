"""The reference GPT: shapes, presets, parameter and FLOP counts."""

import pytest
import torch

from paratrain.models import GPT, PRESETS, gpt_config


@pytest.mark.parametrize("bias", [True, False])
def test_num_params_formula_matches_the_module(bias):
    cfg = gpt_config("gpt-tiny", bias=bias, n_layer=3)
    assert GPT(cfg).num_params() == cfg.num_params()


def test_presets_span_tiny_to_70b():
    assert PRESETS["gpt-tiny"].num_params() < 100_000
    assert 6.5e9 < PRESETS["gpt-7b"].num_params() < 7.5e9
    assert 65e9 < PRESETS["gpt-70b"].num_params() < 75e9
    cfg = PRESETS["gpt-125m"]
    assert cfg.flops_per_token() == 6 * cfg.num_params() + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def test_forward_returns_logits_or_loss_and_is_causal():
    torch.manual_seed(0)
    model = GPT("gpt-tiny")
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])  # the future does not leak
    loss = model(idx, idx)
    assert loss.dim() == 0 and 4.0 < float(loss) < 7.0  # about ln(256) at init


def test_bad_overrides_are_named():
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        gpt_config("gpt-tiny", layers=3)
    with pytest.raises(ValueError, match="unknown GPT preset 'gpt-huge'"):
        gpt_config("gpt-huge")
    with pytest.raises(ValueError, match="d_model \\(30\\) must be divisible by n_head \\(4\\)"):
        gpt_config("gpt-tiny", d_model=30)
