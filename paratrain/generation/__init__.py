"""Generation from a model in its training layout: a KV cache that lives in the attention cores, token
choice (greedy, sampling), and the decoding loop (docs/evaluation.md)."""

from paratrain.generation.kv_cache import DecodeRows, KVCache, kv_caches
from paratrain.generation.loop import GenerationSettings, decode
from paratrain.generation.sampling import next_tokens

__all__ = ["DecodeRows", "GenerationSettings", "KVCache", "decode", "kv_caches", "next_tokens"]
