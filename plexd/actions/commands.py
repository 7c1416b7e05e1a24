"""What ``plexd actions`` and ``plexd hooks`` print, and how ``actions run --local`` ends.

Exit status of ``plexd actions run --local``: the action's own — 0 on success, the hook's exit status when it
failed, 128+N when signal N ended it, 124 on timeout (as timeout(1)), 125 when cancelled (plexd stopping), 1 for
an error (the hook could not run) — and 1 with one line on stderr when the daemon refused the request.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from plexd.base.errors import PlexdError

EXIT_TIMEOUT = 124
EXIT_CANCELLED = 125


def parse_params(pairs: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise PlexdError(f"--param {pair!r}: expected NAME=VALUE")
        if name in out:
            raise PlexdError(f"--param {name}: given twice")
        out[name] = value
    return out


def exit_status(result: dict[str, Any]) -> int:
    status, code, sig = result.get("status"), result.get("exit_code", 1), result.get("signal", 0)
    if status == "success":
        return 0
    if status == "timeout":
        return EXIT_TIMEOUT
    if status == "cancelled":
        return EXIT_CANCELLED
    if sig:
        return 128 + sig
    if status == "failed" and isinstance(code, int) and 0 < code < 256:
        return code
    return 1


def show_stream(lines: Iterable[dict[str, Any]], *, as_json: bool, out: TextIO = sys.stdout,
                err: TextIO = sys.stderr) -> int:
    """Print a local run as it comes: the hook's stdout to ours, its stderr to ours (or NDJSON with --json);
    a summary line on stderr at the end. Returns the exit status."""
    result: dict[str, Any] | None = None
    for doc in lines:
        if as_json:
            print(json.dumps(doc, ensure_ascii=False), file=out, flush=True)
        elif doc.get("type") == "output":
            target = out if doc.get("stream") == "stdout" else err
            target.write(doc.get("data", ""))
            target.flush()
        if doc.get("type") == "result":
            result = doc
    if result is None:
        raise PlexdError("the daemon ended the answer without a result; see its log")
    if not as_json and result["status"] != "success":
        print(f"plexd: action {result['execution_id']}: {result['status']} (exit code {result['exit_code']}) "
              f"after {result['duration']}", file=err)
    return exit_status(result)


def format_actions(doc: dict[str, Any]) -> str:
    lines = ["BUILT-IN ACTIONS"]
    for b in doc["builtin_actions"]:
        lines.append(f"  {b['name']:<24} {b['description']}{_params(b)}")
    lines.append("HOOKS")
    for h in doc["hooks"]:
        lines.append(f"  {h['name']:<24} {h['description'] or '-'}{_params(h)}"
                     + (f"  timeout {h['timeout']}" if h["timeout"] else ""))
    if not doc["hooks"]:
        lines.append("  (none)")
    for r in doc["refused_hooks"]:
        lines.append(f"  {r['name']:<24} REFUSED: {r['reason']}")
    if doc["running"]:
        lines.append("RUNNING")
        lines += [f"  {r['execution_id']}  {r['action']}  from {r['origin']}, {r['running_seconds']}s"
                  for r in doc["running"]]
    if not doc["enabled"]:
        lines.append("actions are disabled (actions.enabled: false)")
    return "\n".join(lines)


def _params(action: dict[str, Any]) -> str:
    """``  [name, optional?]`` for an action's declared parameters, or ''."""
    names = ", ".join(p["name"] + ("" if p["required"] else "?") for p in action["parameters"] or [])
    return f"  [{names}]" if names else ""


def format_hooks(doc: dict[str, Any]) -> str:
    lines = [f"hooks directory: {doc['directory']}"]
    for h in doc["hooks"]:
        announced = h.get("announced_checksum")
        note = "" if announced in (None, h["checksum"]) else (
            "  (not announced yet)" if not announced else f"  (announced {announced[:12]}…)")
        lines.append(f"  {h['name']:<24} sha256 {h['checksum'][:16]}…{note}")
    for r in doc["refused"]:
        lines.append(f"  {r['name']:<24} REFUSED: {r['reason']}")
    lines += [f"  warning: {w}" for w in doc.get("warnings", ())]
    if not doc["hooks"] and not doc["refused"]:
        lines.append("  (no hooks)")
    return "\n".join(lines)


def format_verify(doc: dict[str, Any]) -> str:
    lines = [f"  {r['name']:<24} {'ok' if r['ok'] else 'MISMATCH: ' + r['problem']}" for r in doc["hooks"]]
    lines += [f"  {r['name']:<24} {r['problem']}" for r in doc["refused"]]
    return "\n".join(["hooks verified: " + ("all ok" if doc["ok"] else "problems found"), *lines])
