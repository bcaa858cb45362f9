"""Write the preference pairs the DPO example trains on, from the embedded corpus only (there is no hub here):

    python examples/dpo/make_data.py              # -> runs/dpo/train.jsonl, runs/dpo/validation.jsonl

Each pair is TRL's standard preference row {"prompt", "chosen", "rejected"} of plain text: the prompt is a
sentence's beginning from Python's reference documentation (the embedded corpus), `chosen` its real continuation,
`rejected` the same continuation corrupted: the inner letters of each word shuffled, its first and last kept
("statement is evaluated" -> "seamntet is eavtuaeld"). Both completions have the same length and the same letters,
and short words stay as they are, so only the order of some letters tells them apart, which a byte-level model
learns from English spelling. Every tenth pair is held out for validation.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

PROMPT_WORDS, COMPLETION_WORDS = 8, 6


def sentences() -> list[str]:
    """The corpus's sentences of plain words (no code, no markup), in a fixed order."""
    from paratrain.data import corpus_text

    out = []
    for sentence in re.split(r"(?<=[.!?])\s+", " ".join(corpus_text().split())):
        words = sentence.split()
        if len(words) >= PROMPT_WORDS + COMPLETION_WORDS and all(re.fullmatch(r"[A-Za-z,;.'()-]+", w) for w in words):
            out.append(" ".join(words))
    return out


def scrambled(word: str, rng: random.Random) -> str:
    """The word with its inner letters shuffled (its first and last kept)."""
    inner = list(word[1:-1])
    rng.shuffle(inner)
    return word[:1] + "".join(inner) + word[1:][-1:] if len(word) > 3 else word


def pairs() -> list[dict]:
    rng = random.Random(0)
    out = []
    for sentence in sentences():
        words = sentence.split()
        prompt = " ".join(words[:PROMPT_WORDS])
        completion = words[PROMPT_WORDS:PROMPT_WORDS + COMPLETION_WORDS]
        out.append({"prompt": prompt, "chosen": " " + " ".join(completion),
                    "rejected": " " + " ".join(scrambled(word, rng) for word in completion)})
    return [p for p in out if p["chosen"] != p["rejected"]]  # a shuffle that changed nothing tells nothing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/dpo", help="directory for train.jsonl and validation.jsonl")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = pairs()
    for name, part in (("train", [r for i, r in enumerate(rows) if i % 10 != 9]),
                       ("validation", [r for i, r in enumerate(rows) if i % 10 == 9])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{out / name}.jsonl: {len(part)} pairs")


if __name__ == "__main__":
    main()
