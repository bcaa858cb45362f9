"""The embedded default corpus: Python's own documentation, shipped with every CPython.

`pydoc_data.topics` holds the language reference topics (about 0.5 MB of English prose and code) behind
`help()`. It needs no download, so every machine and every CI run trains on the same text. Tokens are bytes
(vocabulary 256). If a distribution stripped pydoc_data, the sources of a fixed list of standard-library
modules are used instead.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

import torch

_FALLBACK_MODULES = ("argparse", "textwrap", "difflib", "json.decoder", "collections", "functools",
                     "dataclasses", "string", "heapq", "bisect", "fractions", "statistics")


def corpus_text() -> str:
    try:
        from pydoc_data.topics import topics
        return "\n\n".join(topics[key] for key in sorted(topics))
    except ImportError:
        return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in _FALLBACK_MODULES)


def load_corpus(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tokens as int64 tensors; the last `val_fraction` is validation."""
    data = torch.frombuffer(bytearray(corpus_text().encode("utf-8")), dtype=torch.uint8).long()
    split = int(len(data) * (1.0 - val_fraction))
    return data[:split], data[split:]


def corpus_fingerprint() -> str:
    """Short hash of the corpus text, recorded in run directories so results name their data."""
    return hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()[:12]


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
