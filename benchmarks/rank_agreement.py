"""How well a predicted ordering agrees with a measured one: Spearman's rho and Kendall's tau-b over tie-averaged
ranks, and the pairs the prediction separates decisively that the measurement orders the same way (used by
`benchmarks/planner_ranking.py`; pure, no dependency)."""

from __future__ import annotations

import statistics


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            out[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of the (tie-averaged) ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    norm = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / norm if norm else 0.0


def kendall(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b: concordant minus discordant pairs, ties neither, normalized for ties."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    signs = [((a[i] > a[j]) - (a[i] < a[j]), (b[i] > b[j]) - (b[i] < b[j])) for i, j in pairs]
    score = sum(x * y for x, y in signs)
    untied_a, untied_b = sum(x != 0 for x, _ in signs), sum(y != 0 for _, y in signs)
    return score / (untied_a * untied_b) ** 0.5 if untied_a and untied_b else 0.0


def decisive_agreement(predicted: list[float], measured: list[float], margin: float = 0.05) -> tuple[int, int]:
    """Among pairs the model separates by more than `margin`, how many the measurement orders the same way."""
    agree = total = 0
    for i in range(len(predicted)):
        for j in range(i + 1, len(predicted)):
            lo, hi = sorted((predicted[i], predicted[j]))
            if hi > lo * (1 + margin):
                total += 1
                agree += (predicted[i] < predicted[j]) == (measured[i] < measured[j])
    return agree, total
