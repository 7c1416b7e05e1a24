"""``plexd`` command line. Argument parsing only: each command is one function that calls into the package.

Start-up time matters for a CLI, so this module imports nothing heavy at the top: each command imports what it
needs inside its function (the HTTP client, PyNaCl, yaml and asyncio stay out of ``plexd --help``).

Adding a command (mesh: ``plexd peers``; events: ``plexd reconcile --once``)::

    def _add_peers(sub: argparse._SubParsersAction) -> None:
        p = sub.add_parser("peers", parents=[_GLOBALS, _JSON], help="...", description="...")
        p.set_defaults(func=cmd_peers)

    def cmd_peers(args: argparse.Namespace, config: Config) -> int:
        ...   # print; return the exit status; raise PlexdError for a user error (one line, exit 1)

and append ``_add_peers`` to `COMMANDS`. `args.json` is set when the parser has the `_JSON` parent; `config` is
the effective configuration (file → env → flags) already loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from plexd import __version__
from plexd.base.errors import PlexdError

if TYPE_CHECKING:
    from plexd.config.settings import Config

EXIT_USER_ERROR = 1
EXIT_USAGE = 2

_DESCRIPTION = """\
plexd joins this machine to an encrypted WireGuard mesh run by a control plane.

First time:   plexd join --api https://cp.example.com --token-file /path/to/token
Then:         plexd up        (or: systemctl enable --now plexd)
Check:        plexd status

Settings come from /etc/plexd/config.yaml (or --config / $PLEXD_CONFIG), then PLEXD_* environment
variables, then the flags below. 'plexd config show' prints every setting and where it came from."""


def _global_flags(defaults: Any) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, argument_default=defaults)
    g = p.add_argument_group("global options")
    g.add_argument("--config", metavar="FILE", help="config file (default /etc/plexd/config.yaml, or $PLEXD_CONFIG)")
    g.add_argument("--api", metavar="URL", help="control plane address, e.g. https://cp.example.com")
    g.add_argument("--mode", choices=("node", "bridge"), help="run as a mesh node (default) or a bridge")
    g.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"),
                   help="log verbosity (default info)")
    g.add_argument("--data-dir", dest="data_dir", metavar="DIR",
                   help="where the identity and state live (default /var/lib/plexd)")
    return p


# Global flags are accepted before or after the command (`plexd --api X up` and `plexd up --api X`). On the
# sub-commands they default to SUPPRESS so they never overwrite a value given before the command.
_ROOT_GLOBALS = _global_flags(None)
_GLOBALS = _global_flags(argparse.SUPPRESS)
_JSON = argparse.ArgumentParser(add_help=False)
_JSON.add_argument("--json", action="store_true", help="print machine-readable JSON")


# ---------------------------------------------------------------------------------------------------------------
# join


def _add_join(sub: Any) -> None:
    p = sub.add_parser(
        "join", parents=[_GLOBALS, _JSON], help="register this machine with the control plane",
        description="Register this machine with the control plane using a one-time bootstrap token, and store "
        "its identity in data_dir. The token is taken from --token-file, --token-env, token.value, "
        "token.file (/etc/plexd/bootstrap-token), $PLEXD_BOOTSTRAP_TOKEN, or asked for on a terminal. "
        "A token file is deleted once used. On a registered machine, join confirms the identity with the "
        "control plane, and registers afresh (with a new token) if the control plane no longer knows the node.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--token-file", metavar="FILE", help="read the bootstrap token from FILE")
    src.add_argument("--token-env", metavar="VAR", help="read the bootstrap token from environment variable VAR")
    p.set_defaults(func=cmd_join)


def cmd_join(args: argparse.Namespace, config: Config) -> int:
    import asyncio

    from plexd.base.log import setup_logging
    from plexd.controlplane.client import ControlPlaneClient
    from plexd.identity.identity_store import IdentityStore
    from plexd.identity.registrar import Registrar

    # join talks to a person: its outcome is printed, logs only when asked for with log_level.
    setup_logging(config.log_level if config.source_of("log_level") != "default" else "error")
    config.require_api()
    prompt = _prompt_token if sys.stdin.isatty() and not (args.token_file or args.token_env) else None

    loaded = IdentityStore(config.data_dir).load()
    sources = {"token_file": args.token_file, "token_env": args.token_env, "prompt": prompt}

    async def join() -> Any:
        dialect = loaded.identity.dialect if loaded.identity else ""
        async with ControlPlaneClient.for_config(config, dialect=dialect) as client:
            registrar = Registrar(config, client, capabilities=_join_capabilities(config),
                                  wait_retry=_show_retry(config.api.url, sys.stderr))
            if loaded.identity is None:
                identity, _ = await registrar.ensure_registered(**sources)
                return identity
            # Already registered: confirm with the control plane (re-registration with the node secret), and
            # register afresh with a token if it no longer knows this node.
            return await registrar.recover(loaded.identity, **sources)

    identity = asyncio.run(join())
    from plexd.node.departure import clear_departed

    clear_departed(config.data_dir)  # registered or confirmed: a deregistration before this is over
    stored_url = _remember_api(args, config)
    previous = loaded.identity
    outcome = ("registered" if previous is None else
               "confirmed" if previous.node_id == identity.node_id else "registered afresh")
    if args.json:
        _print_json({"node_id": identity.node_id, "mesh_ip": identity.mesh_ip, "outcome": outcome,
                     "previous_node_id": previous.node_id if previous else "", "data_dir": config.data_dir,
                     "control_plane": config.api.url, "config_file_updated": stored_url})
        return 0
    if stored_url:
        print(f"control plane address {config.api.url} stored in {stored_url}")
    if loaded.problem:
        print(f"the stored identity was unusable ({loaded.problem}); registered afresh")
    if outcome == "confirmed":
        print(f"already registered as node {identity.node_id} with mesh IP {identity.mesh_ip} "
              "(confirmed with the control plane)")
    else:
        if outcome == "registered afresh":
            print(f"the control plane no longer knew node {previous.node_id}; registered afresh")
        print(f"registered as node {identity.node_id} with mesh IP {identity.mesh_ip} "
              f"(identity saved in {config.data_dir}); start the daemon with 'plexd up'")
    return 0


def _remember_api(args: argparse.Namespace, config: Config) -> str:
    """`plexd join --api URL` writes the URL into the config file it used, so that `plexd up` (and the unit)
    find it. Returns the file's path when it changed."""
    if not config.source_of("api.url").startswith("flag"):
        return ""
    from plexd.config.edit import store_api_url
    from plexd.config.settings import config_path

    path = config_path(getattr(args, "config", None))
    return path if store_api_url(path, config.api.url, allow_insecure=config.api.allow_insecure) else ""


def _show_retry(url: str, out: Any) -> Callable[..., Any]:
    """Tell the person at `plexd join` at once that the control plane cannot be reached, and count down to the
    next attempt (one line per attempt when not on a terminal)."""
    import asyncio

    tty = hasattr(out, "isatty") and out.isatty()

    async def wait(attempt: int, error: Exception, delay: float, left: float) -> None:
        head = f"cannot reach the control plane at {url} (attempt {attempt}: {error})"
        if not tty:
            print(f"{head}; retrying in {delay:.0f}s, giving up in {left:.0f}s", file=out, flush=True)
            await asyncio.sleep(delay)
            return
        print(head, file=out)
        remaining = delay
        while remaining > 0:
            print(f"\r  retrying in {remaining:3.0f}s (giving up in {left:.0f}s; Ctrl-C to stop) ", end="", file=out,
                  flush=True)
            step = min(1.0, remaining)
            await asyncio.sleep(step)
            remaining -= step
            left -= step
        print("\r\033[K  retrying now", file=out, flush=True)

    return wait


def _join_capabilities(config: Config) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        from plexd.actions.builtins import builtin_capabilities
        from plexd.trust.integrity import binary_checksum, capabilities_document, scan_hooks

        return capabilities_document(__version__, binary_checksum(), scan_hooks(config.hooks.dir).hooks,
                                     builtin_capabilities())

    return build


def _prompt_token() -> str:
    import getpass

    try:
        return getpass.getpass("Bootstrap token (input hidden): ")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return ""


# ---------------------------------------------------------------------------------------------------------------
# up


def _add_up(sub: Any) -> None:
    p = sub.add_parser(
        "up", parents=[_GLOBALS], help="run the daemon in the foreground",
        description="Run plexd: check its own code and hooks, register (or reuse the stored identity), then "
        "keep the node connected until SIGINT or SIGTERM. Logs go to stderr (JSON lines unless a terminal).",
    )
    p.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace, config: Config) -> int:
    import asyncio

    from plexd.base.children import watch_children_with_pidfds
    from plexd.base.log import setup_logging
    from plexd.node import assembly
    from plexd.upgrade import launcher

    setup_logging(config.log_level)
    config.require_api()
    launcher.launch(config, args.argv)  # the current release, if that is not this code; an upgrade's rollback
    watch_children_with_pidfds()
    code = asyncio.run(assembly.run(config))
    return launcher.restart(config, args.argv) if code == launcher.EXIT_RESTART else code


# ---------------------------------------------------------------------------------------------------------------
# status


def _add_status(sub: Any) -> None:
    p = sub.add_parser("status", parents=[_GLOBALS, _JSON], help="show the node and the running daemon",
                       description="Ask the running daemon over its socket (node_api.socket_path): event stream, "
                       "last event, last reconcile and its corrections, heartbeat, peers on the device, each "
                       "service's health and restarts, a reconcile hold. Without a running daemon, show what "
                       "data_dir holds (node id, mesh IP). Needs root or the node_api.admin_group when the "
                       "daemon runs. --json prints the documented status document (plexd/node/control.py).")
    p.set_defaults(func=cmd_status)


def status_document(config: Config) -> dict[str, Any]:
    """The live daemon's status document, or the stored one when no daemon is running."""
    from plexd.node.control import STATUS_PATH, stored_status
    from plexd.node.control_client import DaemonNotRunning, call

    try:
        return call(config.node_api.socket_path, "GET", STATUS_PATH, admin_group=config.node_api.admin_group)
    except DaemonNotRunning:
        return stored_status(config)


def cmd_status(args: argparse.Namespace, config: Config) -> int:
    doc = status_document(config)
    if args.json:
        _print_json(doc)
        return 0
    from plexd.node.status_text import format_status

    print(format_status(doc))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# config show


def _add_config(sub: Any) -> None:
    p = sub.add_parser("config", parents=[_GLOBALS], help="inspect the configuration",
                       description="Inspect the effective configuration.")
    csub = p.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    show = csub.add_parser("show", parents=[_GLOBALS, _JSON], help="print every setting and where it came from",
                           description="Print the effective value of every setting and its source: default, "
                           "the config file, a PLEXD_* environment variable, or a flag. Secrets are hidden.")
    show.set_defaults(func=cmd_config_show)


def cmd_config_show(args: argparse.Namespace, config: Config) -> int:
    from plexd.config.settings import display_value

    if args.json:
        _print_json(config.shown())
        return 0
    rows = [(key, display_value(key, value), source) for key, value, source in config.items()]
    print(f"# config file: {config.config_file or '(none, defaults)'}")
    width = max(len(key) for key, _, _ in rows)
    for key, value, source in rows:
        shown = json.dumps(_jsonable(value)) if not isinstance(value, str) or value == "" else value
        print(f"{key:<{width}}  {shown}  ({source})")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# deregister


def _add_deregister(sub: Any) -> None:
    p = sub.add_parser(
        "deregister", parents=[_GLOBALS, _JSON], help="leave the mesh (and with --purge, forget this node)",
        description="Tell the control plane this node is leaving, then remove the interface, its peers and the "
        "nftables table. With a running daemon, the daemon does it (finishing running actions first) and stops; "
        "without one, this command does. The identity stays in data_dir, so the next 'plexd up' (or boot) "
        "rejoins as the same node. --purge also deletes data_dir, the bootstrap token file and, when systemd "
        "runs, disables and stops plexd.service. If the control plane cannot be told, nothing is changed; "
        "--force goes on anyway.")
    p.add_argument("--purge", action="store_true", help="also delete all local plexd data and disable the unit")
    p.add_argument("--force", action="store_true", help="go on even when the control plane cannot be told")
    p.set_defaults(func=cmd_deregister)


def cmd_deregister(args: argparse.Namespace, config: Config) -> int:
    from plexd.node.departure import deregister_command, format_deregister

    doc = deregister_command(config, purge=args.purge, force=args.force)
    if args.json:
        _print_json(doc)
    else:
        print(format_deregister(doc, config))
    failed = (doc.get("purge") or {}).get("failed") or doc.get("teardown_error")
    return EXIT_USER_ERROR if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# rotate-keys


def _add_rotate_keys(sub: Any) -> None:
    p = sub.add_parser(
        "rotate-keys", parents=[_GLOBALS, _JSON], help="give this node a new WireGuard key pair, tunnels kept",
        description="Ask the running daemon for a WireGuard key rotation: a new key pair on the interface, the "
        "new public key announced to the control plane (which passes it to the peers), the new private key kept "
        "in data_dir once the control plane took it. If the control plane refuses or cannot be reached, the node "
        "keeps its old key (an unanswered rotation is tried again in the background).")
    p.set_defaults(func=cmd_rotate_keys)


def cmd_rotate_keys(args: argparse.Namespace, config: Config) -> int:
    from plexd.machine.wireguard import key_fingerprint
    from plexd.node.control import ROTATE_KEYS_PATH

    doc = _ask_daemon(config, "POST", ROTATE_KEYS_PATH, {}, otherwise="start it ('systemctl start plexd' or "
                      "'plexd up'); the daemon rotates the key on the live interface")
    if args.json:
        _print_json(doc)
    else:
        print(f"new WireGuard public key {doc['public_key']} (was {key_fingerprint(doc['previous_public_key'])}); "
              f"{doc['updated_peers']} peer(s) updated")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plexd reconcile --once [--dry-run]  (connected-state engineer)


def _add_reconcile(sub: Any) -> None:
    p = sub.add_parser(
        "reconcile", parents=[_GLOBALS, _JSON], help="run one reconcile cycle now, or hold/release corrections",
        description="--once: pull the full state, diff it against the live device and correct the drift "
        "(reported to the control plane), or with --dry-run only print the plan. The running daemon does it when "
        "there is one. 'hold --for D [--reason TEXT]' pauses the daemon's corrections while you debug by hand "
        "(default 10m, at most 24h; drift is reported as held, events still update the desired state); "
        "'release' ends the hold at once.")
    p.add_argument("action", nargs="?", choices=("hold", "release"), help="hold or release the daemon's corrections")
    p.add_argument("--once", action="store_true", help="run exactly one cycle")
    p.add_argument("--dry-run", action="store_true", help="print what would be corrected; change nothing")
    p.add_argument("--for", dest="hold_for", metavar="DURATION", default="10m",
                   help="how long a hold lasts (Go duration, default 10m, at most 24h)")
    p.add_argument("--reason", default="", help="why you hold (shown in plexd status)")
    p.set_defaults(func=cmd_reconcile)


def cmd_reconcile(args: argparse.Namespace, config: Config) -> int:
    if args.action is None and not args.once:
        raise PlexdError("say what to do: 'plexd reconcile --once [--dry-run]', 'plexd reconcile hold --for 10m' "
                         "or 'plexd reconcile release'")
    if args.action is not None and (args.once or args.dry_run):
        raise PlexdError(f"'plexd reconcile {args.action}' takes no --once or --dry-run")
    if args.action is not None:
        return _reconcile_hold(args, config)
    import asyncio

    from plexd.node.control import RECONCILE_PATH
    from plexd.node.control_client import DaemonNotRunning, call
    from plexd.node.reconcile_once import format_outcome, reconcile_standalone

    try:
        doc = call(config.node_api.socket_path, "POST", RECONCILE_PATH, {"dry_run": args.dry_run},
                   admin_group=config.node_api.admin_group)
        doc["by_daemon"] = True
    except DaemonNotRunning:
        config.require_api()
        doc = asyncio.run(reconcile_standalone(config, dry_run=args.dry_run))
    if args.json:
        _print_json(doc)
    else:
        print(format_outcome(doc))
    return 0 if doc["ok"] else EXIT_USER_ERROR


def _ask_daemon(config: Config, method: str, path: str, body: Any = None, *, otherwise: str,
                headers: dict[str, str] | None = None, group: str | None = None) -> Any:
    """A route of the running daemon; without one, a PlexdError ending in `otherwise`. `group`: who besides root
    may use it (the admin group by default), for the message when the socket refuses us."""
    from plexd.node.control_client import DaemonNotRunning, call

    try:
        return call(config.node_api.socket_path, method, path, body, headers=headers,
                    admin_group=group or config.node_api.admin_group)
    except DaemonNotRunning:
        raise PlexdError(f"no plexd daemon is running (nothing listens on {config.node_api.socket_path}): "
                         f"{otherwise}") from None


def _reconcile_hold(args: argparse.Namespace, config: Config) -> int:
    from plexd.base.gojson import parse_duration
    from plexd.node.control import HOLD_PATH

    nothing = "there is nothing to hold or release"
    if args.action == "hold":
        try:
            seconds = parse_duration(args.hold_for)
        except ValueError as exc:
            raise PlexdError(f"--for {args.hold_for!r}: {exc}") from None
        if not 0 < seconds <= 24 * 3600:
            raise PlexdError(f"--for {args.hold_for}: a hold lasts more than 0s and at most 24h")
        doc = _ask_daemon(config, "POST", HOLD_PATH, {"seconds": seconds, "reason": args.reason}, otherwise=nothing)
    else:
        doc = _ask_daemon(config, "DELETE", HOLD_PATH, otherwise=nothing)
    if args.json:
        _print_json(doc)
    elif args.action == "hold":
        hold = doc["hold"]
        print(f"reconcile held until {hold['until']}: drift is reported, not corrected "
              f"('plexd reconcile release' to end it now)")
    else:
        print("reconcile hold released: the daemon corrects drift again" if doc["released"]
              else "no hold was active")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plexd peers [--json]  (mesh engineer)


def _add_peers(sub: Any) -> None:
    p = sub.add_parser("peers", parents=[_GLOBALS, _JSON], help="list the mesh peers on the live device",
                       description="Each peer on the WireGuard device: id, mesh IP, endpoint, allowed IPs, latest "
                                   "handshake and traffic (reads the live device, like 'wg show').")
    p.set_defaults(func=cmd_peers)


def cmd_peers(args: argparse.Namespace, config: Config) -> int:
    import asyncio

    from plexd.mesh.peers import format_table, peers_report

    peer_rows, now = asyncio.run(peers_report(config))
    if args.json:
        _print_json([r.to_json(now) for r in peer_rows])
    else:
        print(format_table(peer_rows, now))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plexd policies [--json]


def _add_policies(sub: Any) -> None:
    p = sub.add_parser("policies", parents=[_GLOBALS, _JSON], help="show the active policies and their counters",
                       description="Ask the running daemon: whether policies are enforced (and why not), each "
                                   "policy's rules with the packets each matched (read from the live nftables "
                                   "table), the rules skipped and why, and which peers the policies make visible. "
                                   "Needs root or the node_api.admin_group.")
    p.set_defaults(func=cmd_policies)


def cmd_policies(args: argparse.Namespace, config: Config) -> int:
    from plexd.node.control import POLICIES_PATH
    from plexd.node.policies_view import format_policies

    doc = _ask_daemon(config, "GET", POLICIES_PATH, otherwise="policies are applied by the daemon ('plexd up')")
    if args.json:
        _print_json(doc)
    else:
        print(format_policies(doc))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plexd sessions [--json]


def _add_sessions(sub: Any) -> None:
    p = sub.add_parser("sessions", parents=[_GLOBALS, _JSON], help="list the live access sessions (SSH, TCP, k8s)",
                       description="Ask the running daemon: each access session it serves (kind, listener, user or "
                                   "target, live connections), the sessions that ended by themselves and why, and "
                                   "the entries of the control plane's sessions block it refused. Needs root or "
                                   "the node_api.admin_group.")
    p.set_defaults(func=cmd_sessions)


def cmd_sessions(args: argparse.Namespace, config: Config) -> int:
    from plexd.node.control import SESSIONS_PATH

    doc = _ask_daemon(config, "GET", SESSIONS_PATH, otherwise="sessions are served by the daemon ('plexd up')")
    if args.json:
        _print_json(doc)
        return 0
    if not doc.get("enabled"):
        print("access sessions are off (access.enabled: false)")
        return 0
    rows = [("SESSION", "KIND", "LISTENER", "FOR", "CONNECTIONS")]
    for s in doc.get("live", []):
        what = s.get("user") or s.get("target") or ""
        rows.append((s["session_id"], s["kind"], s.get("listener_endpoint", ""), what, str(s.get("connections", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for sid, why in doc.get("ended", {}).items():
        print(f"ended: {sid} ({why})")
    for refused in doc.get("refused", []):
        print(f"refused: {refused['session_id']}: {refused['reason']}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plexd state [get KIND [KEY] | report put KEY ... | report delete KEY] [--json]  (the node API, for scripts)


def _add_state(sub: Any) -> None:
    p = sub.add_parser("state", parents=[_GLOBALS, _JSON], help="read the node's metadata, data, secrets and reports",
                       description="The local node API through the daemon's socket: what the control plane knows "
                                   "about this node (metadata, data, secrets) and the report entries workloads "
                                   "write back. Without a sub-command: a summary. Secrets need root or the "
                                   "node_api.secrets_group.")
    p.set_defaults(func=cmd_state, state_action="summary")
    ssub = p.add_subparsers(dest="state_action", metavar="ACTION")
    g = ssub.add_parser("get", parents=[_GLOBALS, _JSON], help="print one entry, or list a kind without KEY")
    g.add_argument("kind", choices=("metadata", "data", "secret", "report"))
    g.add_argument("key", nargs="?", help="the entry's key (omit to list the keys)")
    r = ssub.add_parser("report", parents=[_GLOBALS, _JSON], help="write or delete a report entry")
    rsub = r.add_subparsers(dest="report_action", metavar="ACTION", required=True)
    put = rsub.add_parser("put", parents=[_GLOBALS, _JSON], help="write a report entry (its version goes up by one)",
                          description="The payload is read from --file (or stdin with '-'). With a JSON content "
                                      "type it must be JSON; with any other it is sent as a JSON string.")
    put.add_argument("key")
    put.add_argument("--content-type", dest="content_type", default="application/json",
                     help="the payload's content type (default application/json)")
    put.add_argument("--file", dest="payload_file", required=True, metavar="FILE", help="the payload, or - for stdin")
    put.add_argument("--if-match", dest="if_match", type=int, metavar="VERSION",
                     help="write only if the entry is at this version (0: only if it does not exist yet)")
    delete = rsub.add_parser("delete", parents=[_GLOBALS, _JSON], help="delete a report entry")
    delete.add_argument("key")


def cmd_state(args: argparse.Namespace, config: Config) -> int:
    from plexd.nodeapi import state_cli

    if args.state_action == "get":
        method, path, body, headers = "GET", state_cli.get_path(args.kind, args.key), None, {}
    elif args.state_action == "report" and args.report_action == "put":
        body = {"content_type": args.content_type,
                "payload": state_cli.read_payload(args.payload_file, args.content_type)}
        method, path = "PUT", state_cli.report_path(args.key)
        headers = {"If-Match": str(args.if_match)} if args.if_match is not None else {}
    elif args.state_action == "report":
        method, path, body, headers = "DELETE", state_cli.report_path(args.key), None, {}
    else:
        method, path, body, headers = "GET", "/v1/state", None, {}
    doc = _ask_daemon(config, method, path, body, headers=headers, group=config.node_api.socket_group,
                      otherwise="the node API is served by the daemon ('plexd up')")
    if args.json:
        _print_json(doc if doc is not None else {"deleted": args.key})
    else:
        print(state_cli.format_answer(args, doc))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plexd actions list | run NAME --local ...   plexd hooks list | verify | reload


def _add_actions(sub: Any) -> None:
    p = sub.add_parser("actions", parents=[_GLOBALS], help="list and run actions (built-ins and hooks)",
                       description="Actions are the built-ins and the hooks in hooks.dir. The control plane "
                                   "requests them; 'run --local' runs one through the daemon's socket, as root (or "
                                   "the actions.local_auth.group when actions.local_auth.require_root is false), "
                                   "even while the control plane is unreachable.")
    asub = p.add_subparsers(dest="actions_command", metavar="COMMAND", required=True)
    ls = asub.add_parser("list", parents=[_GLOBALS, _JSON], help="the actions this node offers, and what runs")
    ls.set_defaults(func=cmd_actions_list)
    run = asub.add_parser(
        "run", parents=[_GLOBALS, _JSON], help="run an action now through the local daemon",
        description="Run NAME through the running daemon and print its output as it comes. The exit status is "
                    "the action's: its exit code, 124 on timeout, 125 if cancelled, 128+N if signal N ended it. "
                    "The run is written to the local audit log and its result reported to the control plane "
                    "(queued while it is unreachable).")
    run.add_argument("name", help="the built-in or hook to run")
    run.add_argument("--local", action="store_true", required=True,
                     help="run on this node through the daemon (the only way to run from here)")
    run.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a parameter (repeatable)")
    run.add_argument("--timeout", metavar="DURATION", help="Go duration, e.g. 30s (default: the hook's, else "
                                                           "actions.timeout; at most 10m)")
    run.set_defaults(func=cmd_actions_run)


def cmd_actions_list(args: argparse.Namespace, config: Config) -> int:
    from plexd.actions.action_routes import ACTIONS_PATH
    from plexd.actions.commands import format_actions

    doc = _ask_daemon(config, "GET", ACTIONS_PATH, otherwise="actions are run by the daemon ('plexd up')",
                      group=config.actions.local_auth.group)
    if args.json:
        _print_json(doc)
    else:
        print(format_actions(doc))
    return 0


def cmd_actions_run(args: argparse.Namespace, config: Config) -> int:
    from plexd.actions.action_routes import RUN_PATH
    from plexd.actions.commands import parse_params, show_stream
    from plexd.node.control_client import DaemonNotRunning, stream

    body = {"action": args.name, "parameters": parse_params(args.param), "timeout": args.timeout or ""}
    try:
        return show_stream(stream(config.node_api.socket_path, "POST", RUN_PATH, body, timeout=700,
                                  admin_group=config.actions.local_auth.group), as_json=args.json)
    except DaemonNotRunning:
        raise PlexdError(f"no plexd daemon is running (nothing listens on {config.node_api.socket_path}): "
                         "local actions run in the daemon ('plexd up')") from None


def _add_hooks(sub: Any) -> None:
    p = sub.add_parser("hooks", parents=[_GLOBALS], help="inspect the hook scripts",
                       description="Hooks are the executable files in hooks.dir (root-owned, not writable by group "
                                   "or other, symlinks only within the directory). The daemon watches the "
                                   "directory and announces changes to the control plane.")
    hsub = p.add_subparsers(dest="hooks_command", metavar="COMMAND", required=True)
    for name, helptext in (("list", "the hooks, their checksums, and the refused ones with the reason"),
                           ("verify", "hash every hook now against its scanned and announced checksum"),
                           ("reload", "re-scan now and announce any change to the control plane")):
        h = hsub.add_parser(name, parents=[_GLOBALS, _JSON], help=helptext)
        h.set_defaults(func=cmd_hooks)


def cmd_hooks(args: argparse.Namespace, config: Config) -> int:
    from plexd.actions.action_routes import HOOKS_PATH, RELOAD_PATH, VERIFY_PATH
    from plexd.actions.commands import format_hooks, format_verify

    command = args.hooks_command
    if command == "list":
        from plexd.node.control_client import DaemonNotRunning, call

        try:
            doc = call(config.node_api.socket_path, "GET", HOOKS_PATH, admin_group=config.node_api.admin_group)
        except DaemonNotRunning:  # no daemon: what a scan of the directory finds now
            doc = _scanned_hooks(config)
        text = format_hooks(doc)
    else:
        path = VERIFY_PATH if command == "verify" else RELOAD_PATH
        doc = _ask_daemon(config, "POST", path, otherwise="hooks are watched by the daemon ('plexd up')")
        text = format_verify(doc) if command == "verify" else ("\n".join(doc["changes"]) or "no change")
    if args.json:
        _print_json(doc)
    else:
        print(text)
    return 1 if command == "verify" and not doc["ok"] else 0


def _scanned_hooks(config: Config) -> dict[str, Any]:
    from plexd.trust.integrity import scan_hooks

    return {**scan_hooks(config.hooks.dir).to_json(config.hooks.dir), "daemon": False}


# ---------------------------------------------------------------------------------------------------------------
# plexd install | uninstall [--purge]


def _add_install(sub: Any) -> None:
    p = sub.add_parser("install", parents=[_GLOBALS, _JSON], help="set this machine up to run plexd under systemd",
                       description="Create the groups plexd, plexd-secrets and plexd-admin, /etc/plexd (0755) with "
                                   "hooks.d, /var/lib/plexd (0700), /run/plexd (0755), a default "
                                   "/etc/plexd/config.yaml only if there is none, the bootstrap token file (0600) "
                                   "with --token-file, the systemd unit starting this plexd, and the "
                                   "/usr/local/bin/plexd link; then systemctl daemon-reload. Needs root.")
    p.add_argument("--token-file", metavar="FILE", default="", help="copy this bootstrap token to the token file")
    p.add_argument("--exec", dest="exec_path", metavar="PATH", help="the plexd the unit starts (default: this one)")
    p.add_argument("--root", default="/", help=argparse.SUPPRESS)  # a scratch root, for tests
    p.set_defaults(func=cmd_install)


def _add_uninstall(sub: Any) -> None:
    p = sub.add_parser("uninstall", parents=[_GLOBALS, _JSON], help="remove the systemd unit (and with --purge, "
                                                                      "all plexd data)",
                       description="Disable and stop plexd.service (a stop deregisters by default), remove the unit "
                                   "and the /usr/local/bin/plexd link. --purge also removes /var/lib/plexd, "
                                   "/etc/plexd, /run/plexd and the groups. The Python package itself stays: remove "
                                   "its venv (/opt/plexd) yourself. Needs root.")
    p.add_argument("--purge", action="store_true", help="also remove data, config and groups")
    p.add_argument("--root", default="/", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_uninstall)


def cmd_install(args: argparse.Namespace, config: Config) -> int:
    from plexd.install.installer import install

    api = config.api.url if config.source_of("api.url").startswith("flag") else ""
    report = install(args.root, exec_path=args.exec_path, api=api, token_file=args.token_file)
    if args.json:
        _print_json(report.to_json())
    else:
        print(report.text())
        print("next: 'plexd join --api URL --token-file FILE', then 'systemctl enable --now plexd'")
    return 0


def cmd_uninstall(args: argparse.Namespace, config: Config) -> int:
    from plexd.install.installer import uninstall

    running = args.root == "/" and os.path.exists(config.node_api.socket_path)
    report = uninstall(args.root, purge=args.purge, daemon_running=running)
    if args.json:
        _print_json(report.to_json())
    else:
        print(report.text())
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plexd doctor [--json]  |  plexd bugreport [--output FILE] [--lines N]


def _add_doctor(sub: Any) -> None:
    p = sub.add_parser("doctor", parents=[_GLOBALS, _JSON], help="check this machine is ready to run plexd",
                       description="A preflight, before and after joining: the WireGuard backend, nftables, "
                                   "capabilities, the control plane (DNS, TCP, TLS, HTTP) and the clock against it, "
                                   "STUN and the NAT type, the MTU towards the control plane, routes or an interface "
                                   "in the mesh's way, who can change data_dir and hooks.dir, and the systemd unit. "
                                   "One line per check (ok, warn or fail, and the fix). Changes nothing. Exit "
                                   "status 1 when a check failed.")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace, config: Config) -> int:
    from plexd.node.doctor import run_doctor

    report = run_doctor(config)
    if args.json:
        _print_json(report.to_json())
    else:
        print(report.text())
    return 0 if report.ok else EXIT_USER_ERROR


def _add_bugreport(sub: Any) -> None:
    p = sub.add_parser("bugreport", parents=[_GLOBALS], help="write one tar.gz to attach to a ticket",
                       description="Write a tar.gz (mode 0600) with the version, the effective config (secrets "
                                   "hidden), status, peers and policies (from the daemon when it runs), the nftables "
                                   "table inet plexd, routes and rules, the last log lines and plexd doctor's "
                                   "report. It holds no private key, node secret, token or secret value.")
    p.add_argument("--output", "-o", metavar="FILE", default="",
                   help="where to write it (default ./plexd-bugreport-HOST-TIME.tar.gz)")
    p.add_argument("--lines", type=int, default=500, metavar="N", help="log lines to include (default 500)")
    p.set_defaults(func=cmd_bugreport)


def cmd_bugreport(args: argparse.Namespace, config: Config) -> int:
    from plexd.node.bugreport import bugreport, format_bugreport

    print(format_bugreport(bugreport(config, args.output, args.lines)))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# plumbing

COMMANDS: list[Callable[[Any], None]] = [_add_join, _add_up, _add_status, _add_config, _add_deregister,
                                         _add_rotate_keys, _add_reconcile, _add_peers, _add_policies, _add_sessions,
                                         _add_state, _add_actions, _add_hooks, _add_install, _add_uninstall,
                                         _add_doctor, _add_bugreport]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plexd", description=_DESCRIPTION, parents=[_ROOT_GLOBALS],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"plexd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, ensure_ascii=False))


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `plexd up` runs a release or itself again with them
    try:
        from plexd.config import settings as config_mod

        flags = {name: getattr(args, name, None) for name in config_mod.FLAG_KEYS}
        config = config_mod.load(getattr(args, "config", None), flags=flags)
        return int(args.func(args, config) or 0)
    except PlexdError as exc:
        print(f"plexd: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("plexd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `plexd config show | head`: the reader went away; that is not an error worth a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
