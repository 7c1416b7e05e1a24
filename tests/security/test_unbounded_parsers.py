"""Attack: outside input reaching a parser without a nesting bound. Python's json and yaml decoders recurse once
per level, so a few kilobytes of brackets raise RecursionError wherever a plain json.loads meets them. Every
json.load(s)/yaml.(safe_)load call in plexd/ must either go through plexd.base.boundedjson or be listed here with the
reason its input is not outside input (or is bounded just before)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "plexd"
PARSERS = {("json", "loads"), ("json", "load"), ("yaml", "load"), ("yaml", "safe_load"), ("yaml", "full_load"),
           ("yaml", "unsafe_load")}

OWN_FILE = "plexd's own file or database, written 0600 by plexd itself"
DEVPLANE_OWN = "the reference control plane's own database, written by itself"
# (path relative to plexd/, enclosing function) -> why the call needs no bound
ALLOWED: dict[tuple[str, str], str] = {
    ("base/boundedjson.py", "loads"): "the bounded parser itself, after check_depth",
    ("base/boundedjson.py", "parse"): "the bounded parser itself, after too_deep_at",
    ("telemetry/queue.py", "position"): OWN_FILE,
    ("actions/journal.py", "_read_legacy"): OWN_FILE + " (an older version's actions.db)",
    ("actions/journal.py", "_execution"): OWN_FILE,
    ("config/settings.py", "_read_file"): "the operator's root-owned config file, not outside input",
    ("config/edit.py", "_without_token_value"): "one flow mapping of the operator's root-owned config file",
    ("controlplane/ledger.py", "_import_legacy"): OWN_FILE,
    ("controlplane/ledger.py", "_read_mirror"): OWN_FILE,
    ("controlplane/envelope.py", "top_level_string"): "both envelope parsers ran boundedjson.check_depth on the "
                                                      "whole text (fuzzed: test_platform_event_signatures.py too)",
    ("firewall/script.py", "expr_text"): "a rule expression plexd itself serialised (plexd.firewall.ruleset)",
    ("controlplane/uplink.py", "body"): OWN_FILE,
    ("access/token.py", "_json_object"): "nesting_depth_exceeds(text, 8) is checked on the line before",
    ("devplane/demo.py", "_nat_table"): "the output of our own lab tooling in the demo",
    ("devplane/demo.py", "_bridge_scenario"): "the output of our own lab tooling in the demo (plexd status --json)",
    ("devplane/deployment.py", "__init__"): DEVPLANE_OWN,
    ("devplane/admin.py", "_event_args"): "validity only, RecursionError caught: hostile-input tests send deep "
                                          "payload_raw through the admin API on purpose",
    ("devplane/admin.py", "node_records"): DEVPLANE_OWN,
    ("devplane/wire.py", "read_json"): "catches RecursionError and answers 400 (the devplane's request parser)",
    ("devplane/store.py", "from_doc"): DEVPLANE_OWN,
    ("devplane/store.py", "execution"): DEVPLANE_OWN,
    ("devplane/store.py", "executions"): DEVPLANE_OWN,
    ("devplane/lab.py", "down_from_state"): "the lab's own state file (test tooling)",
    ("devplane/lab.py", "_identity"): "the lab's own state file (test tooling)",
    ("nodeapi/sync.py", "load"): OWN_FILE,
    ("nodeapi/cache.py", "read_json_file"): OWN_FILE,
    ("identity/identity_store.py", "load"): OWN_FILE,
    ("firewall/ruleset.py", "expr"): "a rule expression plexd itself serialised",
}


def _calls_in(node: ast.AST, rel: str, function: str, found: list[tuple[str, int, str]]) -> None:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        function = node.name
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and (node.func.value.id, node.func.attr) in PARSERS):
        found.append((rel, node.lineno, function))
    for child in ast.iter_child_nodes(node):
        _calls_in(child, rel, function, found)


def _parser_calls() -> list[tuple[str, int, str]]:
    """(file relative to plexd/, line, enclosing function) of every json/yaml parse call."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        _calls_in(tree, path.relative_to(PACKAGE).as_posix(), "<module>", found)
    return found


def test_every_parse_of_outside_input_is_bounded():
    unbounded = [f"plexd/{rel}:{line} in {func}()" for rel, line, func in _parser_calls()
                 if (rel, func) not in ALLOWED]
    assert not unbounded, ("json/yaml parsed without plexd.base.boundedjson (use boundedjson.loads/parse, or add the "
                           "call to ALLOWED with the reason its input is not outside input):\n  "
                           + "\n  ".join(unbounded))


def test_allow_list_has_no_stale_entries():
    present = {(rel, func) for rel, _, func in _parser_calls()}
    stale = sorted(set(ALLOWED) - present)
    assert not stale, f"ALLOWED names calls that no longer exist: {stale}"


def test_the_scan_sees_the_calls_it_must_see():
    """The scanner itself: it finds the bounded parser's own json.loads (were it blind, the test above would
    pass with nothing checked)."""
    assert ("base/boundedjson.py", "loads") in {(rel, func) for rel, _, func in _parser_calls()}
