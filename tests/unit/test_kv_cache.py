"""The KV cache is allocated once per attention core, to the decode's capacity, and written in place; decoding with
it gives the tokens and log-probs of decoding without it (the whole sequence through the model each step)."""

from __future__ import annotations

from unittest import mock

import torch

from paratrain.generation import GenerationSettings, decode_rollout, rollout_keys
from paratrain.generation.kv_cache import KVCache, attention_cores
from paratrain.models import build_model


def test_the_cache_is_allocated_once_per_core_and_equals_the_uncached_decode():
    torch.manual_seed(0)
    model = build_model("llama-tiny").eval()
    ids = torch.randint(3, 200, (3, 5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    keys = rollout_keys(1, 1, torch.arange(3), torch.zeros(3))

    def forward(x, positions, documents, keep):
        return model(x, position_ids=positions, **({"documents": documents} if documents is not None else {}))[:, keep]

    allocated = []
    real = KVCache._allocated

    def counted(self, cached, new, end):
        out = real(self, cached, new, end)
        allocated.append(out.shape[2])
        return out

    with torch.no_grad(), mock.patch.object(KVCache, "_allocated", counted):
        cached = decode_rollout(forward, model, ids, mask, GenerationSettings(max_new_tokens=7, do_sample=True),
                                keys)
    with torch.no_grad():
        whole = decode_rollout(forward, model, ids, mask,
                               GenerationSettings(max_new_tokens=7, do_sample=True, use_cache=False), keys)
    cores = len(attention_cores(model))
    assert len(allocated) == 2 * cores and set(allocated) == {5 + 7}  # k and v of each core, once, at capacity
    assert torch.equal(cached.ids, whole.ids)
    assert torch.allclose(cached.log_probs, whole.log_probs, atol=1e-6)
