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
