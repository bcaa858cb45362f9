"""How often the GRPO run answered right, over windows of its steps, for the sums the warm-up saw (a <= b) and
the ones it did not (a > b): read from the run's completions.jsonl (every completion of every step).

    python examples/grpo/accuracy.py runs/grpo/run    # prints the table, writes runs/grpo/run/accuracy.json
"""

import json
import sys
from pathlib import Path

WINDOW = 30


def main(run_dir: str = "runs/grpo/run", prompts: str = "runs/grpo/prompts.jsonl") -> None:
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines()]
    completions = [json.loads(line) for line in (Path(run_dir) / "completions.jsonl").read_text().splitlines()]
    last = max(c["step"] for c in completions)
    table = []
    for start in range(1, last + 1, WINDOW):
        window = [c for c in completions if start <= c["step"] < start + WINDOW]
        entry = {"steps": f"{start}-{min(start + WINDOW - 1, last)}"}
        for name, seen in (("seen", True), ("unseen", False)):
            picked = [c for c in window if (rows[c["prompt"]]["prompt"][0] <= rows[c["prompt"]]["prompt"][2]) == seen]
            right = sum(c["text"] == rows[c["prompt"]]["answer"] for c in picked)
            entry[f"{name}_accuracy"], entry[f"{name}_completions"] = round(right / len(picked), 3), len(picked)
        table.append(entry)
        print(f"steps {entry['steps']:>9}: sums the warm-up saw {entry['seen_accuracy']:.1%} right, "
              f"the others {entry['unseen_accuracy']:.1%}")
    (Path(run_dir) / "accuracy.json").write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
