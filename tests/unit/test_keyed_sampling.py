"""Keyed sampling (`paratrain.generation.sampling`, its note): a row's draw depends on its key and the token index
only, never on the rows beside it; the draws are uniform; a filtered token is never drawn; and `Rollout.of` gives
TRL's completion mask."""

from __future__ import annotations

import torch

from paratrain.generation import Decoded, Rollout, keyed_next_tokens, keyed_uniform, rollout_keys


def _keys(n: int, step: int = 3) -> torch.Tensor:
    return rollout_keys(seed=7, step=step, prompt_index=torch.arange(n) // 2, generation_index=torch.arange(n) % 2)


def test_a_rows_draw_depends_on_its_key_and_index_only():
    keys = _keys(64)
    whole = keyed_uniform(keys, 5)
    assert torch.equal(whole[10:20], keyed_uniform(keys[10:20], 5))  # another batch split: the same draws
    assert torch.equal(whole.flip(0), keyed_uniform(keys.flip(0), 5))  # another order: the same draws
    assert not torch.equal(whole, keyed_uniform(keys, 6))  # the next token draws anew
    assert not torch.equal(whole, keyed_uniform(_keys(64, step=4), 5))  # the next step too
    assert len(set(whole.tolist())) == 64


def test_the_draws_are_uniform():
    u = keyed_uniform(_keys(200_000), 0)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    chi2 = float(((counts - 20_000) ** 2 / 20_000).sum())
    assert chi2 < 30, chi2  # 9 degrees of freedom: p < 0.0005 above 30
    assert abs(float(torch.corrcoef(torch.stack([u, keyed_uniform(_keys(200_000), 1)]))[0, 1])) < 0.01


def test_keyed_tokens_follow_the_warped_probabilities_and_never_a_filtered_token():
    n = 100_000
    probs = torch.tensor([0.1, 0.2, 0.0001, 0.6999])
    tokens = keyed_next_tokens(probs.log().expand(n, 4), _keys(n), 0)
    share = torch.bincount(tokens, minlength=4) / n
    assert torch.allclose(share, probs, atol=0.005), share
    top_p = keyed_next_tokens(probs.log().expand(n, 4), _keys(n), 0, top_p=0.7)  # keeps 0.6999 and 0.2 only
    assert set(top_p.unique().tolist()) == {1, 3}
    top_k = keyed_next_tokens(probs.log().expand(n, 4), _keys(n), 0, top_k=1)
    assert set(top_k.unique().tolist()) == {3}


def test_the_completion_mask_ends_at_the_first_end_token():
    ids = torch.tensor([[9, 9, 5, 2, 7, 0], [9, 9, 5, 6, 7, 8], [9, 9, 2, 0, 0, 0]])
    log_probs = torch.full((3, 4), -0.5)
    rollout = Rollout.of(Decoded(ids, log_probs), prompt_length=2, eos_ids=[2])
    assert rollout.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert rollout.log_probs.tolist() == [[-0.5, -0.5, 0, 0], [-0.5] * 4, [-0.5, 0, 0, 0]]
    wider = rollout.padded(6)
    assert wider.completion_ids.shape == (3, 6) and int(wider.completion_mask[:, 4:].sum()) == 0
