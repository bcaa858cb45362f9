"""Generation from a model in its training layout: a KV cache that lives in the attention cores, token
choice (greedy, sampling, keyed sampling for rollouts), and the decoding loop (docs/evaluation.md)."""

from paratrain.generation.kv_cache import DecodeRows, KVCache, kv_caches
from paratrain.generation.loop import Decoded, GenerationSettings, decode, decode_rollout
from paratrain.generation.rollout import Rollout, rollout_keys
from paratrain.generation.sampling import keyed_next_tokens, keyed_uniform, next_tokens

__all__ = ["Decoded", "DecodeRows", "GenerationSettings", "KVCache", "Rollout", "decode", "decode_rollout",
           "keyed_next_tokens", "keyed_uniform", "kv_caches", "next_tokens", "rollout_keys"]
