"""How many requests each node made of the agent API, by route: what a node costs its control plane.

Counted as they arrive (before any injected fault), keyed by the node the path names and the route's template
(`POST /v1/nodes/{node_id}/heartbeat`), so `bench idle_cost` can say where a node's requests per hour go. A
request no route matches is counted under its method and `(no route)`; one that names no node under `-`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from starlette.routing import BaseRoute, Match
from starlette.types import Scope

NO_NODE = "-"


class RequestTally:
    def __init__(self) -> None:
        self._counts: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def count(self, routes: Iterable[BaseRoute], scope: Scope) -> None:
        node, name = NO_NODE, f"{scope.get('method', '?')} (no route)"
        for route in routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                node = str(child.get("path_params", {}).get("node_id", NO_NODE))
                name = f"{scope['method']} {getattr(route, 'path', '?')}"
                break
        self._counts[node][name] += 1

    def by_node(self) -> dict[str, dict[str, int]]:
        return {node: dict(counts) for node, counts in self._counts.items()}

    def clear(self) -> None:
        self._counts.clear()
