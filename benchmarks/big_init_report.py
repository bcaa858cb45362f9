"""`benchmarks/big_init.py`'s results: the fairness check over every rank's setup, and the table (the worst rank's
peak RSS per phase, median over repeats)."""

from __future__ import annotations

import statistics

from benchmarks.common import check_same_setup

MIB = 2**20


def check_fair(cases: dict[str, list]) -> None:
    """Refuse (UnfairComparison) cases whose ranks built different optimizers, threads, dtypes, seeds, micro-batch,
    sequence length or clipping; a case whose every run failed has nothing to compare."""
    setups = {f"{case} (repeat {i + 1}, rank {r})": rank["fair"] for case, runs in cases.items()
              for i, ranks in enumerate(runs) if isinstance(ranks, list) for r, rank in enumerate(ranks)}
    if setups:
        check_same_setup(setups)


def _worst(ranks: list, key: str) -> int:
    return max(r[key] for r in ranks)


def _spread(values: list[float]) -> str:
    """The median over repeats, with the range when there is more than one."""
    median = statistics.median(values)
    return f"{median:.1f}" + (f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else "")


def table(result: dict) -> str:
    lines = ["| case | peak RSS / rank after init (MiB) | after load | after the first steps | formula at init "
             "(MiB) | init / formula | runs |", "|---|---:|---:|---:|---:|---:|---|"]
    for case, repeats in result["cases"].items():
        good = [ranks for ranks in repeats if isinstance(ranks, list)]
        failed = [run for run in repeats if isinstance(run, dict)]
        why = "; ".join(sorted({"a rank was killed (SIGKILL, out of memory)" if run.get("killed") else
                                "a rank failed" for run in failed}))
        runs = f"{len(good)} of {len(repeats)}" + (f": {why}" if failed else "")
        if not good:
            inits = [seen["init"] for run in failed for seen in run["reached"].values() if "init" in seen]
            lines.append(f"| {case} | {_spread([v / MIB for v in inits]) if inits else '-'} | - | - | - | - | {runs} |")
            continue
        init = [_worst(ranks, "init") / MIB for ranks in good]
        worst = max(good[0], key=lambda r: r["init"])
        formula = worst.get("formula_init")
        cells = [_spread(init), _spread([_worst(ranks, "load") / MIB for ranks in good]) if "load" in worst else "-",
                 _spread([_worst(ranks, "step") / MIB for ranks in good]), f"{formula / MIB:.0f}" if formula else "-",
                 f"{statistics.median(init) * MIB / formula:.2f}" if formula else "-", runs]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines += ["", "Each cell: the worst rank's peak, the median over repeats (the range over repeats in brackets)."]
    return "\n".join(lines)
