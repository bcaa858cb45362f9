"""The import structure of paratrain, drawn from the code's imports: `docs/images/imports.png`.

    python -m paratrain.report.imports [--out docs/images/imports.png]

Each box is a unit of the layering contract in pyproject.toml (a subpackage, or a module at the package root),
in its layer's row, top to bottom as the contract lists them; an arrow is an import from one unit to another
(lazy imports inside functions included, found by grimp as import-linter finds them). An arrow that runs up a
row, and a circle between two modules, would be drawn red; `lint-imports` and tests/unit/test_import_cycles.py
keep there being none, and the summary line printed says how many were found.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def contract_layers(pyproject: Path = ROOT / "pyproject.toml") -> list[list[str]]:
    """The "layers" contract's rows, each a list of units (`|` and `:` both separate units of a row)."""
    config = tomllib.loads(pyproject.read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
    return [[unit.strip() for unit in row.replace("|", ":").split(":")] for row in contract["layers"]]


def unit_edges(rows: list[list[str]]) -> tuple[set[tuple[str, str]], int]:
    """(importing unit, imported unit) pairs between different units, and the number of module circles."""
    import grimp

    graph = grimp.build_graph("paratrain")
    units = sorted((u for row in rows for u in row), key=len, reverse=True)  # the most specific name first

    def unit_of(module: str) -> str | None:
        return next((u for u in units if module == u or module.startswith(u + ".")), None)

    edges, circles = set(), 0
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = unit_of(module), unit_of(imported)
            if a and b and a != b:
                edges.add((a, b))
            if graph.chain_exists(importer=imported, imported=module):
                circles += 1
    return edges, circles // 2


def draw(rows: list[list[str]], edges: set[tuple[str, str]], out: Path) -> int:
    """Draw the rows and arrows; returns the number of arrows running up a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where, layer = {}, {}
    for y, row in enumerate(rows):
        for x, unit in enumerate(row):
            where[unit] = ((x + 0.5) / len(row), -y)
            layer[unit] = y
    fig, ax = plt.subplots(figsize=(16, 0.75 * len(rows) + 1))
    upward = 0
    for a, b in sorted(edges):
        up = layer[b] < layer[a]
        upward += up
        (x0, y0), (x1, y1) = where[a], where[b]
        ax.annotate("", xy=(x1, y1 + 0.18), xytext=(x0, y0 - 0.18),
                    arrowprops={"arrowstyle": "-|>", "lw": 0.6, "alpha": 0.9 if up else 0.12,
                                "color": "red" if up else "tab:blue", "shrinkA": 0, "shrinkB": 0})
    for unit, (x, y) in where.items():
        ax.text(x, y, unit.removeprefix("paratrain.") or "paratrain", ha="center", va="center", fontsize=7,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.5", "lw": 0.6})
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    ax.axis("off")
    ax.set_title(f"paratrain's imports by layer ({len(edges)} unit-to-unit imports; {upward} running up a layer)",
                 loc="left", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return upward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "imports.png")
    args = parser.parse_args(argv)
    rows = contract_layers()
    edges, circles = unit_edges(rows)
    upward = draw(rows, edges, args.out)
    print(f"{args.out}: {sum(map(len, rows))} units in {len(rows)} layers, {len(edges)} imports between units, "
          f"{upward} running up a layer, {circles} module circles")
    return 1 if upward or circles else 0


if __name__ == "__main__":
    sys.exit(main())
