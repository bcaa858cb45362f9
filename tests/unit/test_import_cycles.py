"""No import circles inside paratrain: no module reaches itself through the modules it imports (lazy imports
inside functions included), so every module can be read and loaded bottom-up."""

from __future__ import annotations

import grimp


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("paratrain")
    circles = sorted({tuple(sorted((module, imported)))
                      for module in graph.modules for imported in graph.find_modules_directly_imported_by(module)
                      if graph.chain_exists(importer=imported, imported=module)})
    assert circles == [], circles


def test_the_import_picture_script_sees_the_layers_and_no_import_running_up():
    from paratrain.report.imports import contract_layers, unit_edges

    rows = contract_layers()
    edges, circles = unit_edges(rows)
    layer = {unit: y for y, row in enumerate(rows) for unit in row}
    assert circles == 0 and ("paratrain.cli", "paratrain.trainer") in edges and len(edges) > 100
    assert [(a, b) for a, b in edges if layer[b] < layer[a]] == []
