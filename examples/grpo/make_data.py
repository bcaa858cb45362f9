"""The data of examples/grpo: small sums, a few answered for a short supervised warm-up, all of them asked as
TRL's prompt-only rows for GRPO.

    python examples/grpo/make_data.py
    # runs/grpo/sft.jsonl:     {"prompt": "3+4=", "completion": "7"}  the 15 sums with a <= b, 8 times each
    # runs/grpo/prompts.jsonl: {"prompt": "3+4=", "answer": "7"}      all 25 sums of digits 0-4, 4 times each

The warm-up (sft.json) teaches the answer's format, one digit, and the sums it sees; GRPO (job.json) then learns
the other ten (a > b) from the rewards alone (`rewards.py`: the answer's format, and whether it is the sum). The reward
functions get the `answer` column beside each completion.
"""

import json
from pathlib import Path

OUT = Path("runs/grpo")


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} rows to {path}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    sums = [(a, b) for a in range(5) for b in range(5)]
    _write(OUT / "sft.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b)}
                               for _ in range(8) for a, b in sums if a <= b])
    _write(OUT / "prompts.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for _ in range(4) for a, b in sums])


if __name__ == "__main__":
    main()
