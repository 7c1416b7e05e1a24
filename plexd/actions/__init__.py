"""Actions: hooks and built-ins run on request, from the control plane (``action_request``) or a local operator.

    request.py     the ``action_request`` payload, parsed and bounded; the ack reasons; the hook's environment
    journal.py     the on-disk journal (exactly-once) and outbox (acks, results, violations) in one SQLite file
    runner.py      one process: no shell, its own process group, capped output, timeout and cancel
    builtins.py    the built-in actions and what they may read of the node
    dispatcher.py  validate → ack → run → result; concurrency, drain on shutdown, the local path
    outbox.py      delivers the outbox to the control plane in order, with jittered backoff
    hooks.py       the hook set: watched with watchfiles, re-announced when it changes
    action_routes.py  the daemon's socket routes for ``plexd actions`` and ``plexd hooks``
"""
