"""docs/architecture.md shows the layers of the import contract in pyproject.toml, which is the source of truth
(`lint-imports` enforces it); this keeps the two from drifting apart."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_layers_are_the_import_contracts_layers():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers:begin -->\n```\n(.*?)```\n<!-- layers:end -->", doc, re.S)
    assert block, "docs/architecture.md lost its layers block"
    assert block.group(1).splitlines() == layers, "docs/architecture.md's layers differ from pyproject.toml's contract"


def test_no_module_of_the_core_is_missing_from_the_layers():
    # A new top-level module outside every layer would escape the contract silently.
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = {name.strip() for line in next(c for c in contracts if c["id"] == "layers")["layers"]
               for name in re.split(r"[|:]", line)}
    top = {f"paratrain.{p.stem}" for p in (ROOT / "paratrain").iterdir()
           if (p.suffix == ".py" and p.stem != "__init__" and p.stem != "__main__")
           or (p.is_dir() and (p / "__init__.py").exists())}
    covered = {name.split(".")[0] + "." + name.split(".")[1] for name in layered}
    assert top - covered == set(), f"modules in no layer of pyproject.toml's contract: {sorted(top - covered)}"
