"""Embedded data, data-parallel sampling, and a fine-tuning job's dataset files as token ids and labels."""

from paratrain.data.corpus import corpus_fingerprint, corpus_text, decode, load_corpus
from paratrain.data.datasets import DataParallelLoader, DataParallelSampler, TokenWindows, default_collate
from paratrain.data.formats import DataSummary, Example, UntrainableRecordError, tokenize_record, tokenize_records
from paratrain.data.sources import DataError, iter_records
from paratrain.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "DataError", "DataParallelLoader", "DataParallelSampler", "DataSummary", "Example",
           "TokenWindows", "UntrainableRecordError", "corpus_fingerprint", "corpus_text", "decode", "default_collate",
           "iter_records", "load_corpus", "load_tokenizer", "tokenize_record", "tokenize_records"]
