"""`plexd status` for a person: the status document (plexd/node/control.py) as aligned lines."""

from __future__ import annotations

import time
from typing import Any


def utc(ts: float) -> str:
    """Unix seconds as a person reads them: 2026-11-23 12:00:00 UTC."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "never"
    seconds = max(0, int(now - ts))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m ago"


def format_status(doc: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    node = doc.get("node", {})
    lines = []
    if node.get("registered"):
        lines += ["registered:     yes", f"node id:        {node['node_id']}", f"mesh IP:        {node['mesh_ip']}"]
    elif node.get("identity_problem"):
        lines.append(f"registered:     no (stored identity unusable: {node['identity_problem']}; run 'plexd join')")
    else:
        lines.append("registered:     no (run 'plexd join')")
    dialect = f" ({node['dialect']} contract)" if node.get("dialect") else ""
    lines += [f"control plane:  {node.get('control_plane') or '(not configured)'}{dialect}",
              f"data dir:       {node.get('data_dir', '')}"]
    daemon = doc.get("daemon", {})
    if not daemon.get("running"):
        lines.append("daemon:         not running (showing stored state; start it with 'plexd up')")
        return "\n".join(lines)
    lines.append(f"daemon:         running, pid {daemon['pid']}, up {int(daemon['uptime_seconds'])}s"
                 + (f", plexd {daemon['version']}" if daemon.get("version") else ""))
    upgrade = doc.get("upgrade")
    if upgrade and (upgrade.get("installing") or upgrade.get("pending") or upgrade.get("last")):
        lines.append(f"upgrade:        {_upgrade_line(upgrade)}")
    health = doc.get("health") or {}
    if health.get("status") == "degraded":
        lines.append(f"health:         DEGRADED: {health.get('reason') or 'see the log'}")
    ev = doc["event_stream"]
    last = (f", last event {ev['last_event_id']} {_ago(ev['last_event_at'], now)}" if ev["last_event_id"]
            else ", no event yet")
    lines.append(f"event stream:   {ev['state']} since {_ago(ev['since'], now)}{last}")
    mode = ev.get("delivery_mode")
    if mode:
        lines.append(f"delivery mode:  {mode}")
    if mode == "pull_only":
        lines.append("connection:     the control plane has no signed event bus: the state is pulled every "
                     "reconcile interval, and the stream tried again every 10 minutes")
    elif ev["state"] != "connected":
        lines.append(f"connection:     offline since {utc(ev['since'])} ({_ago(ev['since'], now)}): running "
                     "from the state in data_dir and retrying")
    rec = doc["reconcile"]
    if rec["hold"]:
        h = rec["hold"]
        lines.append(f"reconcile hold: until {h['until']} ({h['remaining_seconds']}s left): "
                     f"{h['reason'] or 'no reason given'}")
    if rec["last"] is None:
        lines.append("last reconcile: none yet")
    else:
        r = rec["last"]
        outcome = "ok" if r["ok"] else f"failed: {r['error']}"
        lines.append(f"last reconcile: {_ago(r['at'], now)} ({', '.join(r['reasons'])}): {outcome}, "
                     f"{len(r['corrections'])} correction(s), {len(r['updates'])} update(s), "
                     f"{len(r['held'])} held")
        lines += [f"                  corrected {c['type']}: {c['detail']}" for c in r["corrections"]]
        lines += [f"                  held {c['type']}: {c['detail']}" for c in r["held"]]
    if rec.get("last_pull_age_seconds") is not None:
        due = f"; the next cycle pulls: {rec['pull_due']}" if rec.get("pull_due") else ""
        lines.append(f"last state pull: {rec['last_pull_age_seconds']:.0f}s ago{due}")
    hb = doc["heartbeat"]
    hb_state = "none yet" if hb["ok"] is None else "ok" if hb["ok"] else f"failing ({hb['error']})"
    lines.append(f"heartbeat:      {hb_state}, last {_ago(hb['last_at'], now)}")
    peers = doc["peers"]
    on_device = "no device" if peers["on_device"] is None else (
        f"{peers['on_device']} on the device, {peers['recent_handshake']} with a recent handshake")
    lines.append(f"peers:          {peers['desired']} desired, {on_device}"
                 + (f", {peers['rejected']} rejected" if peers["rejected"] else "")
                 + (f", {peers['hidden_by_policy']} hidden by policy" if peers.get("hidden_by_policy") else ""))
    pol = doc.get("policy")
    if pol:
        state = pol["enforcement"] + (f" ({pol['reason']})" if pol["enforcement"] != "enforced" else "")
        lines.append(f"policy:         {state}, {pol['policies']} policies, {pol['rules']} rules"
                     + (f", {pol['skipped_rules']} skipped" if pol["skipped_rules"] else "")
                     + " ('plexd policies' for counters)")
    nat = doc.get("nat")
    if nat:
        lines.append(f"nat:            {_nat_line(nat, now)}")
    api = doc.get("node_api")
    if api:
        sync = api["report_sync"]
        queued = f"{sync['pending']} change(s) queued" + (f" ({sync['last_error']})" if sync["last_error"] else "")
        lines.append(f"node API:       {api['socket']}" + (f" and tcp {api['tcp']}" if api["tcp"] else "")
                     + f", {api['reports']} report entries, {queued}"
                     + (f", {api['rate_limited']} requests rate-limited" if api["rate_limited"] else ""))
    actions = doc.get("actions")
    if actions:
        lines.append(f"actions:        {_actions_line(actions)}")
    telemetry = doc.get("telemetry")
    if telemetry:
        lines.append(f"telemetry:      {_telemetry_line(telemetry)}")
    lines += _bridge_lines(doc.get("domains") or {})
    lines.append("services:")
    for svc in doc["services"]:
        extra = f", last error {_ago(svc['last_error_at'], now)}: {svc['last_error']}" if svc["last_error"] else ""
        lines.append(f"  {svc['name']:<14} {svc['state']:<10} restarts {svc['restarts']}{extra}")
    return "\n".join(lines)


def _upgrade_line(u: dict[str, Any]) -> str:
    if u.get("installing"):
        return f"installing plexd {u['installing']}"
    if u.get("pending"):
        return f"to plexd {u['pending']['to_version']}: {u['pending']['state']}"
    last = u["last"]
    text = f"{last['status']}: {last['from_version']} -> {last['to_version']}"
    return text + (f" ({last['reason']})" if last.get("reason") else "")


def _nat_line(nat: dict[str, Any], now: float) -> str:
    if not nat.get("enabled"):
        return f"off ({nat.get('reason', '')})"
    if nat.get("public_endpoint"):
        line = (f"public endpoint {nat['public_endpoint']} ({nat['nat_type']}), discovered "
                f"{_ago(nat['last_success_at'], now)} via {nat['server']}")
    else:
        line = "public endpoint not discovered yet"
        if nat.get("reported_endpoint"):
            line += f"; reported the local endpoint {nat['reported_endpoint']}"
    if nat.get("last_error"):
        line += f"; last attempt {_ago(nat['last_attempt_at'], now)} failed: {nat['last_error']}"
    if nat.get("report_error"):
        line += f"; report failing: {nat['report_error']}"
    elif nat.get("report_pending"):
        line += "; report queued"
    return line


def _telemetry_line(t: dict[str, Any]) -> str:
    parts = []
    for stream, s in t.items():
        if not s["enabled"]:
            parts.append(f"{stream} off")
            continue
        part = f"{stream} {s['sent']} sent, {s['pending']} queued"
        if s["dropped"]:
            part += f", {s['dropped']} dropped"
        if s["last_error"]:
            part += f" ({s['last_error']})"
        parts.append(part)
    return "; ".join(parts)


def _actions_line(a: dict[str, Any]) -> str:
    if not a["enabled"]:
        return "disabled (actions.enabled: false)"
    hooks, outbox = a["hooks"], a["outbox"]
    line = (f"{len(a['running'])} running (limit {a['max_concurrent']}), {a['accepted']} accepted, "
            f"{sum(a['rejected'].values())} rejected; {hooks['hooks']} hook(s)")
    if hooks["refused"]:
        line += f", {hooks['refused']} refused"
    if outbox["pending"]:
        line += f"; {outbox['pending']} message(s) to deliver" + (
            f" ({outbox['last_error']})" if outbox["last_error"] else "")
    return line


def _bridge_lines(domains: dict[str, Any]) -> list[str]:
    """A bridge's parts, with the public keys the other ends are configured with (not secret, and needed)."""
    lines = []
    relay = domains.get("relay")
    if relay:
        lines.append(f"relay:          {'listening' if relay.get('listening') else 'NOT listening'} on port "
                     f"{relay.get('port')}, {len(relay.get('sessions') or [])} session(s)")
    access = domains.get("user_access")
    if access:
        if access.get("interface"):
            lines.append(f"user access:    {access['interface']} port {access['listen_port']}, public key "
                         f"{access['public_key']}, {access['peer_count']} peer(s)")
        else:
            lines.append("user access:    off")
    tunnels = domains.get("site_to_site")
    if tunnels:
        shown = tunnels.get("tunnels") or []
        lines.append(f"site-to-site:   {len(shown)} tunnel(s)")
        lines += [f"                  {t['tunnel_id']}: {t['interface']} port {t['listen_port']}, public key "
                  f"{t['public_key']}, remote {', '.join(t['remote_subnets'])}" for t in shown]
    ingress = domains.get("ingress")
    if ingress:
        rules = ingress.get("rules") or []
        lines.append(f"ingress:        {len(rules)} rule(s) on {len(ingress.get('ports') or [])} port(s), "
                     f"{ingress.get('connections', 0)} connection(s) now")
    for part in (relay, access, tunnels, ingress):
        for r in (part or {}).get("refused") or []:
            lines.append(f"                  refused: {r if isinstance(r, str) else r.get('reason', r)}")
    return lines
