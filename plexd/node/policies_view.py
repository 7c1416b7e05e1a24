"""`plexd policies [--json]`: the active policies, the peers they make visible, and each rule's packet counters.

The document (``GET /v1/daemon/policies`` on the daemon's socket)::

    enforcement     enforced | degraded | disabled
    reason          why not enforced ("" when enforced)
    table_present   whether table inet plexd is on the machine now
    policies        [{id, rules: [{index, rule, chains: {input|forward: {packets, bytes}}}]}]
    skipped         ["policy web rule 2: port 70000 is out of range ..."]
    visible_peers   peer ids the policies allow on the device
    hidden_peers    peer ids the control plane sent that no rule allows
    default_deny    {input: {packets, bytes}, forward: {...}}: what the last rule of each chain dropped

Counters are read from the live table at the time of the request.
"""

from __future__ import annotations

from typing import Any

from plexd.machine.nft import FirewallError
from plexd.node.domain_list import firewall as firewall_of
from plexd.node.mesh import MeshHandle


async def policies_document(mesh: MeshHandle) -> dict[str, Any]:
    desired = mesh.get_desired()
    firewall = firewall_of(mesh.engine)
    compiled = desired.compiled_policy
    enforcement, why = mesh.enforcement()
    doc: dict[str, Any] = {
        "enforcement": enforcement,
        "reason": why,
        "table_present": False,
        "policies": [],
        "skipped": [str(s) for s in compiled.skipped],
        "visible_peers": sorted(desired.shown_peers),
        "hidden_peers": sorted(set(desired.peers) - set(desired.shown_peers)),
        "default_deny": {},
    }
    counters: dict[tuple[str, str], tuple[int, int]] = {}
    if firewall is not None and desired.enforce_policy and not firewall.unavailable:
        try:
            live = await firewall.read()
        except FirewallError as e:
            doc["reason"] = doc["reason"] or str(e)
            live = None
        if live is not None:
            doc["table_present"] = True
            for chain in live.chains.values():
                for r in chain.rules:
                    counters[(chain.name, r.key)] = (r.packets, r.bytes)
    want = firewall.want(desired) if firewall is not None else None
    by_rule: dict[tuple[str, int], dict[str, Any]] = {}
    if want is not None:
        for chain in want.chains.values():
            for spec in chain.rules:
                packets, nbytes = counters.get((chain.name, spec.key), (0, 0))
                if not spec.policy_id:
                    if spec.label == "default deny":
                        doc["default_deny"][chain.name] = {"packets": packets, "bytes": nbytes}
                    continue
                entry = by_rule.setdefault((spec.policy_id, spec.rule_index), {})
                seen = entry.setdefault(chain.name, {"packets": 0, "bytes": 0})
                seen["packets"] += packets
                seen["bytes"] += nbytes
    policies: dict[str, list[dict[str, Any]]] = {}
    for rule in compiled.rules:
        policies.setdefault(rule.policy_id, []).append(
            {"index": rule.index, "rule": rule.describe(), "chains": by_rule.get((rule.policy_id, rule.index), {})})
    doc["policies"] = [{"id": pid, "rules": rules} for pid, rules in policies.items()]
    return doc


def format_policies(doc: dict[str, Any]) -> str:
    lines = [f"enforcement: {doc['enforcement']}" + (f" ({doc['reason']})" if doc.get("reason") else "")]
    if not doc["policies"]:
        lines.append("no usable policies: no peer is visible")
    for pol in doc["policies"]:
        lines.append(f"policy {pol['id']}")
        for r in pol["rules"]:
            counts = ", ".join(f"{chain} {c['packets']} pkts" for chain, c in sorted(r["chains"].items()))
            lines.append(f"  rule {r['index']}: {r['rule']}" + (f"  [{counts}]" if counts else ""))
    for s in doc["skipped"]:
        lines.append(f"skipped: {s}")
    deny = doc.get("default_deny") or {}
    if deny:
        lines.append("default deny: " + ", ".join(f"{chain} {c['packets']} pkts" for chain, c in sorted(deny.items())))
    lines.append(f"visible peers ({len(doc['visible_peers'])}): {', '.join(doc['visible_peers']) or '-'}")
    if doc["hidden_peers"]:
        lines.append(f"hidden by policy ({len(doc['hidden_peers'])}): {', '.join(doc['hidden_peers'])}")
    return "\n".join(lines)
