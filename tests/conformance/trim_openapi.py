"""Regenerate tests/conformance/platform/openapi-node.yaml from the platform's published OpenAPI.

    .venv/bin/python tests/conformance/trim_openapi.py PATH/TO/openapi.yaml [--commit SHA --date YYYY-MM-DD]

PATH is `api/openapi.yaml` of plexsphere/plexsphere-sdk-go (the platform's published contract). Only the
node-facing operations are kept (NODE_PATHS), with every component they reference, transitively; the rest of the
platform's API (operators, tenancy, audit, ...) is dropped. The header names where the copy came from: the info
block's title and version, and the commit and date given on the command line (the info block carries no date).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).parent / "platform" / "openapi-node.yaml"
SOURCE = "plexsphere/plexsphere-sdk-go api/openapi.yaml"

# What plexd (a node) calls or may call, as the platform names them ({id} is the node's id).
NODE_PATHS = (
    "/v1/register",
    "/v1/nodes/{id}/state",
    "/v1/nodes/{id}/heartbeat",
    "/v1/nodes/{id}/events",
    "/v1/nodes/{id}/executions/{exec_id}",
    "/v1/nodes/{id}/capabilities",
    "/v1/nodes/{id}/integrity-violations",
    "/v1/nodes/{id}/state/reports/{key}",
    "/v1/nodes/{id}/secrets/{name}",
    "/v1/nodes/{id}/endpoint",
    "/v1/nodes/{id}/sessions/{session_id}",
    "/v1/nodes/{id}/metrics",
    "/v1/nodes/{id}/logs",
    "/v1/nodes/{id}/audit",
    "/v1/keys/rotate",
    "/v1/health",
    "/v1/version",
)
COMPONENT_PREFIX = "#/components/"


def references(node: Any) -> set[str]:
    """Every local `$ref` under `node`."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith(COMPONENT_PREFIX):
                found.add(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def security_schemes(paths: dict[str, Any], spec: dict[str, Any]) -> set[str]:
    """The security schemes the kept operations (or the document's default) name: they are named, not $ref'd."""
    names: set[str] = set()
    requirements = list(spec.get("security") or [])
    for item in paths.values():
        for operation in item.values():
            if isinstance(operation, dict):
                requirements.extend(operation.get("security") or [])
    for requirement in requirements:
        names.update(requirement)
    return names


def trim(spec: dict[str, Any]) -> dict[str, Any]:
    missing = [p for p in NODE_PATHS if p not in spec["paths"]]
    if missing:
        raise SystemExit(f"trim_openapi: the source has no {', '.join(missing)}")
    paths = {p: spec["paths"][p] for p in NODE_PATHS}
    components = spec.get("components", {})
    kept: dict[str, dict[str, Any]] = {}
    pending = references(paths)
    seen: set[str] = set()
    while pending:
        ref = pending.pop()
        if ref in seen:
            continue
        seen.add(ref)
        section, _, name = ref[len(COMPONENT_PREFIX):].partition("/")
        try:
            value = components[section][name]
        except KeyError:
            raise SystemExit(f"trim_openapi: {ref} is referenced but not defined") from None
        kept.setdefault(section, {})[name] = value
        pending |= references(value)
    schemes = security_schemes(paths, spec)
    if schemes:
        kept["securitySchemes"] = {n: components["securitySchemes"][n] for n in sorted(schemes)}
    tag_names = {t for item in paths.values() for op in item.values() if isinstance(op, dict)
                 for t in op.get("tags", [])}
    out: dict[str, Any] = {"openapi": spec["openapi"], "info": spec["info"]}
    if "servers" in spec:
        out["servers"] = spec["servers"]
    if "security" in spec:
        out["security"] = spec["security"]
    out["tags"] = [t for t in spec.get("tags", []) if t.get("name") in tag_names]
    out["paths"] = paths
    out["components"] = {section: dict(sorted(items.items())) for section, items in sorted(kept.items())}
    return out


def header(spec: dict[str, Any], commit: str, date: str) -> str:
    info = spec.get("info", {})
    where = f" at commit {commit}" if commit else ""
    when = f" ({date})" if date else ""
    return (
        f"# The node-facing part of the platform's published OpenAPI: {SOURCE}{where}{when}.\n"
        f"# Its info block: title {info.get('title')!r}, version {info.get('version')!r} (it carries no date).\n"
        "# Trimmed to the operations a node calls and the components they reference, transitively; nothing else\n"
        "# is changed. Regenerate with tests/conformance/trim_openapi.py; do not edit by hand.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="the platform's openapi.yaml")
    parser.add_argument("--commit", default="", help="the source's commit, for the header")
    parser.add_argument("--date", default="", help="the source's date, for the header")
    parser.add_argument("--output", type=Path, default=OUT)
    args = parser.parse_args(argv)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    spec = yaml.load(args.source.read_text(encoding="utf-8"), Loader=loader)  # a safe loader
    trimmed = trim(spec)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    text = yaml.dump(trimmed, Dumper=dumper, sort_keys=False, allow_unicode=True, width=100)
    args.output.write_text(header(spec, args.commit, args.date) + text, encoding="utf-8")
    print(f"{args.output}: {len(trimmed['paths'])} paths, "
          f"{sum(len(v) for v in trimmed['components'].values())} components", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
