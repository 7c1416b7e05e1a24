"""`plexd-devplane admin ...`: the admin API from a shell (tables by default, `--json` for scripts).

    plexd-devplane admin --url http://127.0.0.1:8080 --token-file devplane.db.admin-token nodes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from plexd.base import boundedjson
from plexd.base.errors import ConfigError

RECORD_COMMANDS = ("drift", "executions", "reports", "metrics", "logs", "audit", "integrity", "heartbeats",
                   "endpoints", "tunnels", "session-activity", "capabilities")


def add_parser(sub: argparse._SubParsersAction) -> None:
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON (for scripts)")

    admin = sub.add_parser(
        "admin", help="drive a running devplane through its admin API",
        description="Drive a running devplane. The token comes from --token-file or $PLEXD_DEVPLANE_ADMIN_TOKEN "
                    "(serve writes it to <db>.admin-token).")
    admin.add_argument("--url", default=os.environ.get("PLEXD_DEVPLANE_URL", "http://127.0.0.1:8080"),
                       help="devplane URL (default $PLEXD_DEVPLANE_URL or %(default)s)")
    admin.add_argument("--token-file", help="file holding the admin token")
    admin.add_argument("--json", action="store_true", default=False, help="print JSON (for scripts)")
    cmds = admin.add_subparsers(dest="admin_command", metavar="COMMAND")
    cmds.required = True

    def leaf(parent: argparse._SubParsersAction, name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        p = parent.add_parser(name, parents=[out], help=help_text, description=help_text)
        p.set_defaults(func=_run, handler=func)
        return p

    def group(name: str, help_text: str) -> argparse._SubParsersAction:
        p = cmds.add_parser(name, help=help_text, description=help_text)
        g = p.add_subparsers(dest=f"{name}_command", metavar="COMMAND")
        g.required = True
        return g

    leaf(cmds, "status", do_status, "deployment summary: nodes by status, open streams, signing keys, faults")

    g = group("token", "bootstrap tokens")
    p = leaf(g, "create", do_token_create, "create a one-time bootstrap token and print it")
    p.add_argument("--kind", choices=("node", "bridge"), help="platform dialect: a bridge token (default node)")
    p.add_argument("--ttl", help="Go duration after which the token expires (default: never)")
    leaf(g, "list", do_token_list, "list tokens (abbreviated) and who used them")
    leaf(g, "revoke", do_token_revoke, "make a token unusable (a used one stays used)").add_argument("token")

    p = leaf(cmds, "nodes", do_nodes, "list nodes with their status")
    p.add_argument("--all", action="store_true", help="include deregistered/forgotten nodes")

    g = group("node", "one node")
    leaf(g, "show", do_node_show, "everything about a node").add_argument("node_id")
    leaf(g, "forget", do_node_forget, "remove a node (its peers are told; its secret stops working)"
         ).add_argument("node_id")

    g = group("policies", "access policies (which nodes see each other)")
    leaf(g, "show", do_policies_show, "print the policies")
    leaf(g, "set", do_policies_set, "replace all policies from a JSON file (or - for stdin)"
         ).add_argument("file", nargs="?", default="-", help="JSON array of policies (default: stdin)")

    g = group("bridge", "a bridge node's block: relay sessions, user access, ingress, site-to-site")
    p = leaf(g, "set", do_bridge_set, "replace a node's bridge block from a JSON file (or - for stdin; null: "
             "not a bridge any more)")
    p.add_argument("node_id")
    p.add_argument("file", nargs="?", default="-", help="JSON object {relay, user_access, ingress, site_to_site}")
    leaf(g, "show", do_bridge_show, "print a node's bridge block and what it last reported").add_argument("node_id")

    g = group("metadata", "node metadata")
    p = leaf(g, "set", do_metadata_set, "replace a node's metadata")
    p.add_argument("node_id")
    p.add_argument("pairs", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--file", help="JSON object file instead of KEY=VALUE pairs")

    g = group("data", "node data entries")
    p = leaf(g, "set", do_data_set, "set a data entry (its version goes up by one)")
    p.add_argument("node_id")
    p.add_argument("key")
    p.add_argument("--content-type", default="application/json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--payload", help="the payload as JSON text")
    src.add_argument("--file", help="file holding the JSON payload")

    g = group("secret", "node secrets (sent AES-256-GCM encrypted with the node's key)")
    p = leaf(g, "set", do_secret_set, "set a secret (its version goes up by one)")
    p.add_argument("node_id")
    p.add_argument("key")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--value")
    src.add_argument("--value-file")

    g = group("report", "report entries nodes sent (written by their workloads through the node API)")
    leaf(g, "list", do_report_list, "a node's current report entries").add_argument("node_id")
    p = leaf(g, "get", do_report_get, "one report entry's payload")
    p.add_argument("node_id")
    p.add_argument("key")

    g = group("endpoint", "node endpoints")
    p = leaf(g, "set", do_endpoint_set, "set a node's public endpoint (HOST:PORT); its peers are told")
    p.add_argument("node_id")
    p.add_argument("endpoint")

    g = group("flags", "one-shot heartbeat flags")
    p = leaf(g, "set", do_flags_set, "ask a node to reconcile / rotate keys on its next heartbeat")
    p.add_argument("node_id")
    p.add_argument("--reconcile", action="store_true")
    p.add_argument("--rotate-keys", action="store_true")

    g = group("keys", "a node's mesh key")
    leaf(g, "rotate", do_keys_rotate, "ask a node for a new mesh key (platform dialect: until it completes the "
         "rotation, with a rotate_keys event)").add_argument("node_id")

    g = group("action", "actions (hooks and built-ins) on nodes")
    p = leaf(g, "request", do_action_request, "send an action_request; prints the execution id")
    p.add_argument("node_id")
    p.add_argument("action")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--timeout", help="Go duration, e.g. 30s")
    p.add_argument("--checksum", help="hex SHA-256 of the hook (default: the one the node announced)")
    p.add_argument("--type", choices=("builtin", "hook"),
                   help="platform dialect: the execution's type (default: hook if the node declared one so named)")
    p = leaf(g, "resend", do_action_resend, "publish an execution's request again (the node must not re-run it)")
    p.add_argument("node_id")
    p.add_argument("execution_id")

    g = group("artifact", "plexd releases the devplane serves at /v1/artifacts/plexd/VERSION/OS/ARCH")
    p = leaf(g, "put", do_artifact_put, "store a release file (make release builds one) and its signature FILE.sig")
    p.add_argument("version")
    p.add_argument("file")
    p.add_argument("--signature", help="the signature file (default: FILE.sig; none there: the file alone)")
    p.add_argument("--os", default="linux")
    p.add_argument("--arch", help="Go's name (default: this machine's)")

    p = leaf(cmds, "upgrade", do_upgrade, "ask a node to upgrade itself (service.upgrade); prints the execution id")
    p.add_argument("node_id")
    p.add_argument("version")
    p.add_argument("--checksum", help="the SHA-256 to require (default: the stored artifact's)")
    p.add_argument("--allow-downgrade", action="store_true",
                   help="let the node install an older release (its upgrade.allow_downgrade must be true too)")

    g = group("event", "raw events")
    p = leaf(g, "publish", do_event_publish, "publish a signed event to a node; prints the event id")
    p.add_argument("node_id")
    p.add_argument("event_type")
    p.add_argument("--payload", default="null", help="payload JSON text (key order kept)")

    g = group("signing-key", "the deployment's event signing key")
    p = leaf(g, "rotate", do_signing_rotate, "new key; the old one stays valid for the transition")
    p.add_argument("--transition", default="24h", help="Go duration (default %(default)s)")

    g = group("session", "access sessions (SSH, TCP, Kubernetes) into nodes, authorized by session tokens")
    p = leaf(g, "create", do_session_create, "mint a session; prints its token and how to connect")
    p.add_argument("--node", required=True, help="the node to enter")
    p.add_argument("--kind", required=True, choices=("ssh", "tcp", "k8s"))
    p.add_argument("--user", help="the login user (ssh) or the Kubernetes user impersonated (k8s)")
    p.add_argument("--ttl", default="30m", help="lifetime, Go duration (default %(default)s; 2s works too)")
    p.add_argument("--idle", default="0s", help="idle timeout, Go duration (default: none)")
    p.add_argument("--target", help="tcp: HOST:PORT the node forwards to (HOST defaults to 127.0.0.1)")
    p.add_argument("--group", action="append", default=[], help="k8s: a group impersonated (repeatable)")
    p.add_argument("--allow", action="append", default=[], metavar="COMMAND",
                   help="ssh: a command line the session may run (repeatable; default: any, and a shell)")
    p.add_argument("--wait", type=float, default=5.0,
                   help="seconds to wait for the node to report the session's listener (default %(default)s)")
    p = leaf(g, "revoke", do_session_revoke, "end a session now (the node closes it)")
    p.add_argument("--node", help="the session's node (default: looked up; a session id names one session)")
    p.add_argument("session_id")
    p = leaf(g, "list", do_session_list, "sessions and where their listeners are")
    p.add_argument("--node", help="only this node's")

    g = group("faults", "fault injection on the agent API (never on /admin)")
    p = leaf(g, "set", do_faults_set, "set faults, e.g. events_status=503 retry_after=2 silent=true")
    p.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    leaf(g, "clear", do_faults_clear, "remove all faults")

    for name in RECORD_COMMANDS:
        g = group(name, f"{name} received from a node")
        leaf(g, "show", do_records, f"show the {name} a node sent").add_argument("node_id")


# -- plumbing ---------------------------------------------------------------------------------------------------

def _token(args: argparse.Namespace) -> str:
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {args.token_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--token-file {args.token_file}: not text (is it the admin token file?)") from None
    else:
        token = os.environ.get("PLEXD_DEVPLANE_ADMIN_TOKEN", "").strip()
    if not token:
        raise ConfigError("no admin token: pass --token-file (serve writes <db>.admin-token) "
                          "or set PLEXD_DEVPLANE_ADMIN_TOKEN")
    if not token.isascii() or not token.isprintable() or len(token) > 512:
        # never quoted: it may be a secret, or a whole file passed by mistake (httpx would print it)
        raise ConfigError("the admin token is not one line of printable ASCII (is it the admin token file?)")
    return token


def _run(args: argparse.Namespace) -> int:
    import httpx

    from plexd.devplane.harness import AdminClient

    token = _token(args)
    try:
        client = AdminClient(args.url, token)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ConfigError(f"--url {args.url}: {exc}") from None
    try:
        result = args.handler(client, args)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"--url {args.url}: {exc}") from None
    finally:
        client.close()
    human = None
    if isinstance(result, tuple):
        result, human = result
    if args.json or human is None:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print(human)
    return 0


def table(rows: list[list[str]], header: list[str]) -> str:
    if not rows:
        return "(none)"
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _read_json(path: str, what: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path}: not UTF-8 text") from None
    try:
        return boundedjson.parse(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                          ) from None


def _json_arg(text: str, what: str) -> Any:
    try:
        return boundedjson.parse(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: not valid JSON: {exc.msg} at column {exc.colno}") from None


# -- commands ---------------------------------------------------------------------------------------------------

def do_status(c: Any, args: argparse.Namespace) -> Any:
    s = c.status()
    keys = s["signing_keys"]
    lines = [f"nodes: {s['nodes']} ({', '.join(f'{k} {v}' for k, v in s['by_status'].items())})",
             f"open event streams: {s['streams']}", f"last event: {s['last_event_id'] or '-'}",
             f"signing key: {keys['current']}" + (f" ({keys['key_id']})" if keys.get("key_id") else "")]
    if s.get("dialect"):
        lines[:0] = [f"dialect: {s['dialect']} (project {s['project_id']})"]
    if keys.get("previous"):
        lines.append(f"previous key: {keys['previous']} (until {keys['transition_expires']})")
    lines.append(f"faults: {json.dumps(s['faults']) if s['faults'] else 'none'}")
    return s, "\n".join(lines)


def do_token_create(c: Any, args: argparse.Namespace) -> Any:
    ttl = _seconds(args.ttl, "--ttl") if args.ttl else None
    info = c.create_token_info(args.kind, ttl)
    return info, info["token"]


def do_token_revoke(c: Any, args: argparse.Namespace) -> Any:
    c.revoke_token(args.token)
    return {"revoked": True}, "token revoked"


def do_keys_rotate(c: Any, args: argparse.Namespace) -> Any:
    c.request_key_rotation(args.node_id)
    return {"rotate_keys": True}, f"{args.node_id} is asked for a new mesh key"


def do_token_list(c: Any, args: argparse.Namespace) -> Any:
    tokens = c.tokens()
    rows = [[t["token"], t["created_at"], t["used_at"] or "-", t["node_id"] or "-"] for t in tokens]
    return tokens, table(rows, ["TOKEN", "CREATED", "USED", "NODE"])


def do_nodes(c: Any, args: argparse.Namespace) -> Any:
    nodes = c.nodes(include_removed=args.all)
    rows = [[n["id"], n["hostname"], n["mesh_ip"], n["status"], n["last_seen"] or "-", n["endpoint"] or "-",
             str(n["streams"])] for n in nodes]
    return nodes, table(rows, ["NODE", "HOSTNAME", "MESH IP", "STATUS", "LAST SEEN", "ENDPOINT", "STREAMS"])


def do_node_show(c: Any, args: argparse.Namespace) -> Any:
    n = c.node(args.node_id)
    lines = [f"{k}: {n[k]}" for k in ("id", "hostname", "mesh_ip", "public_key", "status", "last_seen", "endpoint",
                                      "nat_type", "registered_at", "streams")]
    lines.append(f"metadata: {json.dumps(n['metadata'])}")
    lines.append(f"peers: {', '.join(n['peers']) or '-'}")
    lines.append(f"data: {', '.join(d['key'] + ' v' + str(d['version']) for d in n['data']) or '-'}")
    lines.append(f"secrets: {', '.join(s['key'] + ' v' + str(s['version']) for s in n['secret_refs']) or '-'}")
    return n, "\n".join(lines)


def do_node_forget(c: Any, args: argparse.Namespace) -> Any:
    c.forget_node(args.node_id)
    return {"forgotten": args.node_id}, f"node {args.node_id} forgotten"


def do_policies_show(c: Any, args: argparse.Namespace) -> Any:
    policies = c.policies()
    rows = [[p["id"], r["src"], r["dst"], str(r["port"] or "any"), r["protocol"] or "any", r["action"]]
            for p in policies for r in p["rules"]]
    return policies, table(rows, ["POLICY", "SRC", "DST", "PORT", "PROTO", "ACTION"])


def do_policies_set(c: Any, args: argparse.Namespace) -> Any:
    policies = c.set_policies(_read_json(args.file, "policies file"))
    return policies, f"{len(policies)} policies set"


def do_bridge_set(c: Any, args: argparse.Namespace) -> Any:
    block = _read_json(args.file, "bridge file")
    c.set_bridge(args.node_id, block)
    return block, f"bridge block of {args.node_id} set ({', '.join(sorted(block)) if block else 'none'})"


def do_bridge_show(c: Any, args: argparse.Namespace) -> Any:
    node = c.node(args.node_id)
    reports = {e["key"]: e.get("payload", e.get("value")) for e in c.report_entries(args.node_id)
               if e["key"].startswith("status.")}
    doc = {"bridge": node.get("bridge"), "status": reports}
    return doc, json.dumps(doc, indent=2)


def do_metadata_set(c: Any, args: argparse.Namespace) -> Any:
    meta = _read_json(args.file, "--file") if args.file else _pairs(args.pairs, "metadata")
    result = c.set_metadata(args.node_id, meta)
    return result, f"metadata of {args.node_id}: {json.dumps(result)}"


def do_data_set(c: Any, args: argparse.Namespace) -> Any:
    payload = _read_json(args.file, "--file") if args.file else _json_arg(args.payload, "--payload")
    entry = c.set_data(args.node_id, args.key, args.content_type, payload)
    return entry, f"data {args.key} of {args.node_id} is now version {entry['version']}"


def do_secret_set(c: Any, args: argparse.Namespace) -> Any:
    if args.value_file:
        try:
            value = Path(args.value_file).read_text()
        except OSError as exc:
            raise ConfigError(f"--value-file {args.value_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--value-file {args.value_file}: not UTF-8 text (a secret value is text)") from None
    else:
        value = args.value
    version = c.set_secret(args.node_id, args.key, value)
    return {"key": args.key, "version": version}, f"secret {args.key} of {args.node_id} is now version {version}"


def do_report_list(c: Any, args: argparse.Namespace) -> Any:
    entries = c.report_entries(args.node_id)
    def line(e: dict[str, Any]) -> str:  # what a node sent: any of it may be missing
        if "value" in e:  # the platform dialect's entries: a key and an opaque value
            return f"{e.get('key', '?')}  {str(e['value'])[:80]}"
        return (f"{e.get('key', '?')}  v{e.get('version', '?')}  {e.get('content_type', '?')}  "
                f"{e.get('updated_at', '?')}")

    lines = [line(e) for e in entries]
    return entries, "\n".join(lines) or f"no report entries from {args.node_id}"


def do_report_get(c: Any, args: argparse.Namespace) -> Any:
    entry = next((e for e in c.report_entries(args.node_id) if e["key"] == args.key), None)
    if entry is None:
        raise ConfigError(f"node {args.node_id} has no report entry {args.key!r}")
    payload = entry["payload"] if "payload" in entry else entry.get("value")  # the platform's entries hold a value
    return entry, payload if isinstance(payload, str) else json.dumps(payload, indent=2, ensure_ascii=False)


def do_endpoint_set(c: Any, args: argparse.Namespace) -> Any:
    c.set_node_endpoint(args.node_id, args.endpoint)
    return {"endpoint": args.endpoint}, f"endpoint of {args.node_id}: {args.endpoint}"


def do_flags_set(c: Any, args: argparse.Namespace) -> Any:
    if not (args.reconcile or args.rotate_keys):
        raise ConfigError("flags set: give --reconcile and/or --rotate-keys")
    c.request_heartbeat_flags(args.node_id, reconcile=args.reconcile, rotate_keys=args.rotate_keys)
    return {"reconcile": args.reconcile, "rotate_keys": args.rotate_keys}, "flags set for the next heartbeat"


def do_action_request(c: Any, args: argparse.Namespace) -> Any:
    eid = c.request_action(args.node_id, args.action, _pairs(args.param, "--param"), timeout=args.timeout,
                           checksum=args.checksum, action_type=args.type)
    return {"execution_id": eid}, eid


def do_action_resend(c: Any, args: argparse.Namespace) -> Any:
    event_id = c.resend_action(args.node_id, args.execution_id)
    return {"execution_id": args.execution_id, "event_id": event_id}, event_id


def do_artifact_put(c: Any, args: argparse.Namespace) -> Any:
    try:
        data = Path(args.file).read_bytes()
    except OSError as exc:
        raise ConfigError(f"artifact put: cannot read {args.file}: {exc.strerror}") from None
    sig_path = Path(args.signature or f"{args.file}.sig")
    try:
        signature = sig_path.read_bytes()
    except FileNotFoundError:
        if args.signature:
            raise ConfigError(f"artifact put: no signature file {sig_path}") from None
        signature = None
    except OSError as exc:
        raise ConfigError(f"artifact put: cannot read {sig_path}: {exc.strerror}") from None
    doc = c.put_artifact(args.version, data, os_name=args.os, arch=args.arch, signature=signature)
    signed = f", signature {sig_path}" if signature is not None else ", UNSIGNED (nodes will refuse it)"
    return doc, f"stored plexd/{doc['path']}: {doc['size']} bytes, sha256 {doc['sha256']}{signed}"


def do_upgrade(c: Any, args: argparse.Namespace) -> Any:
    doc = c.start_upgrade(args.node_id, args.version, args.checksum, allow_downgrade=args.allow_downgrade)
    return doc, doc["execution_id"]


def do_event_publish(c: Any, args: argparse.Namespace) -> Any:
    _json_arg(args.payload, "--payload")
    eid = c.publish_event(args.node_id, args.event_type, payload_raw=args.payload)
    return {"event_id": eid}, eid


def do_signing_rotate(c: Any, args: argparse.Namespace) -> Any:
    keys = c.rotate_signing_key(args.transition)
    return keys, (f"new signing key {keys['current']}\nprevious {keys['previous']} accepted until "
                  f"{keys['transition_expires']}")


def do_faults_set(c: Any, args: argparse.Namespace) -> Any:
    faults: dict[str, Any] = {}
    for key, value in _pairs(args.pairs, "fault").items():
        if value.lower() in ("true", "false"):
            faults[key] = value.lower() == "true"
        elif value.isdigit():
            faults[key] = int(value)
        else:
            faults[key] = value
    if "retry_after" in faults:
        faults["retry_after"] = str(faults["retry_after"])
    result = c.set_faults(**faults)
    return result, f"faults: {json.dumps(result)}"


def do_faults_clear(c: Any, args: argparse.Namespace) -> Any:
    c.clear_faults()
    return {}, "faults cleared"


def do_records(c: Any, args: argparse.Namespace) -> Any:
    kind = args.admin_command
    items = c.records(args.node_id, kind)
    if kind == "executions" and any("callbacks" in e for e in items):  # the platform dialect's executions
        rows = [[e["execution_id"], e["action"], e["type"], e["status"], str(e.get("exit_code", "-"))] for e in items]
        return items, table(rows, ["EXECUTION", "ACTION", "TYPE", "STATUS", "EXIT"])
    if kind == "executions":
        rows = [[e["execution_id"], e["action"] or "-", (e["ack"] or {}).get("status", "-"),
                 (e["result"] or {}).get("status", "-"), str((e["result"] or {}).get("exit_code", "-"))]
                for e in items]
        return items, table(rows, ["EXECUTION", "ACTION", "ACK", "RESULT", "EXIT"])
    if kind == "drift":
        lines = []
        for report in items:
            lines.append(f"{report.get('timestamp', '?')}:")
            lines += [f"  {c_.get('type', '?')}: {c_.get('detail', '')}" if isinstance(c_, dict) else f"  {c_!r}"
                      for c_ in report.get("corrections") or []]
        return items, "\n".join(lines) or "(none)"
    return items, "\n".join(json.dumps(i, ensure_ascii=False) for i in items) or "(none)"



def _seconds(text: str, what: str) -> float:
    from plexd.base.gojson import parse_duration

    try:
        return parse_duration(text)
    except ValueError:
        raise ConfigError(f"{what} {text!r}: not a Go duration (e.g. 30s, 10m, 1h30m)") from None


def _target(args: argparse.Namespace) -> dict[str, Any]:
    if args.kind == "tcp":
        if not args.target:
            raise ConfigError("--target HOST:PORT is required for a tcp session")
        host, sep, port = args.target.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"--target {args.target!r}: expected HOST:PORT or :PORT")
        return {"host": host if sep and host else "127.0.0.1", "port": int(port)}
    if not args.user:
        raise ConfigError(f"--user is required for a {args.kind} session")
    if args.kind == "ssh":
        return {"user": args.user, **({"allowed_commands": args.allow} if args.allow else {})}
    return {"user": args.user, **({"groups": args.group} if args.group else {})}


def _how_to_connect(session: dict[str, Any]) -> str:
    endpoint = session.get("listener_endpoint") or ""
    if not endpoint:
        return ("the node has not reported the session's listener yet; "
                f"`plexd-devplane admin session list --node {session['node_id']}` shows it once it has")
    host, _, port = endpoint.rpartition(":")
    kind = session["kind"]
    # Never the token in a command's arguments: `ps` shows them to every local user.
    if kind == "ssh":
        user = session["target"]["ssh"]["user"]
        return (f"ssh -p {port} {user}@{host}    (password: the token; in a script: SSHPASS=\"$TOKEN\" sshpass -e "
                f"ssh -p {port} {user}@{host}, not with -p)")
    if kind == "tcp":
        return f"connect to {endpoint} from an allowed mesh peer"
    return (f"kubectl --kubeconfig FILE get pods    (FILE: server https://{endpoint}, insecure-skip-tls-verify, "
            "and the token as the user's `token`; never --token)")


def do_session_create(c: Any, args: argparse.Namespace) -> Any:
    import time

    ttl = _seconds(args.ttl, "--ttl")
    idle = int(_seconds(args.idle, "--idle"))
    created = c.create_session(args.node, args.kind, ttl, idle_timeout_seconds=idle, **_target(args))
    session, token = created["session"], created["token"]
    deadline = time.monotonic() + max(args.wait, 0.0)
    while not session.get("listener_endpoint") and time.monotonic() < deadline:
        time.sleep(0.2)
        session = next((s for s in c.sessions(args.node) if s["session_id"] == session["session_id"]), session)
    created["session"] = session
    lines = [f"session {session['session_id']} ({session['kind']}) on {args.node} until {session['expires_at']}",
             f"token: {token}", _how_to_connect(session)]
    return created, "\n".join(lines)


def do_session_revoke(c: Any, args: argparse.Namespace) -> Any:
    node = args.node
    if not node:
        node = next((s.get("node_id") for s in c.sessions() if s.get("session_id") == args.session_id), None)
        if not node:
            raise ConfigError(f"no session {args.session_id!r} (plexd-devplane admin session list shows them)")
    c.revoke_session(node, args.session_id)
    return {"revoked": args.session_id, "node": node}, f"session {args.session_id} revoked (node {node})"


def do_session_list(c: Any, args: argparse.Namespace) -> Any:
    found = c.sessions(args.node)
    rows = [[s["session_id"], s["node_id"], s["kind"], _who(s), s["expires_at"], _state(s),
             s["listener_endpoint"] or "-"] for s in found]
    return found, table(rows, ["SESSION", "NODE", "KIND", "TARGET", "EXPIRES", "STATE", "LISTENER"])


def _who(session: dict[str, Any]) -> str:
    target = session["target"][session["kind"]]
    return target.get("user") or f"{target.get('host')}:{target.get('port')}"


def _state(session: dict) -> str:
    if session["live"]:
        return "live"
    return "revoked" if session.get("revoked_at") else "expired"
