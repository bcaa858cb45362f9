"""Embedded data and data-parallel sampling."""

from paratrain.data.corpus import corpus_fingerprint, corpus_text, decode, load_corpus
from paratrain.data.datasets import DataParallelLoader, DataParallelSampler, TokenWindows, default_collate

__all__ = ["DataParallelLoader", "DataParallelSampler", "TokenWindows", "corpus_fingerprint", "corpus_text",
           "decode", "default_collate", "load_corpus"]
