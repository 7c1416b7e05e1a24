"""The node runtime: the composition root (`assembly`), supervision (`supervisor`), the node's mesh (`mesh`) and
the daemon's local socket (`local_api`, `control`). Nothing is imported here, so that importing one part does
not import the others (the package has no import cycles; tests/unit/test_import_graph.py checks it)."""
