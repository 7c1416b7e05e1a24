"""The platform contract's state snapshot turned into the one desired model (`plexd.state.model.State`).

The snapshot has eight blocks, every key always present, ``null`` meaning "not populated" (docs/platform-dialect.md,
State). What each becomes:

- ``peers`` ``[{node_id, mesh_ip, public_key, fallback_endpoint?}]``: the peers, each routing its mesh IP (/32 or
  /128) and reached at ``fallback_endpoint`` when there is one (the snapshot's only endpoint field). The snapshot
  lists exactly the peers this node may see, so the policy only filters traffic (`State.peers_by_policy`).
- ``policy`` ``{revision_id, fingerprint, rules[{action, protocol, source_cidr, destination_cidr, ports?}]}``: one
  policy of the same rules. ``any`` is every protocol, a /0 is anyone, a port range of up to 256 ports becomes one
  rule per port and the whole range ``1-65535`` any port. A rule this engine cannot enforce (``log``, a wider range)
  is kept with its reason, which the policy engine reports as a skipped rule. ``null`` (the platform has no policy
  for this node) is one rule allowing everything, said once in the log: never all traffic dropped for a policy
  nobody wrote.
- ``state`` ``{metadata[], data[], reports[]}``: metadata and data for the node API; a data value is an opaque
  string. ``reports`` (the node's own, echoed) and the ``reports`` block are not desired state.
- ``sessions`` and ``bridge``: already in the shapes the model reads.
- ``executions``: the actions to run, as `State.action_requests` (`plexd.controlplane.platform_actions`);
  ``reachability``: a diagnostic the client logs when it changes.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import replace
from typing import Any

from plexd.base.errors import WireFormatError
from plexd.base.gojson import GO_ZERO_TIME
from plexd.controlplane.platform_actions import action_requests
from plexd.state.fields import join, kind
from plexd.state.model import PEER_VISIBILITY, DataEntry, Policy, PolicyRule, State, _fields

log = logging.getLogger(__name__)

BLOCKS = ("peers", "reachability", "policy", "bridge", "state", "reports", "executions", "sessions")
PROTOCOLS = {"tcp": "tcp", "udp": "udp", "icmp": "icmp", "any": ""}
MAX_EXPANDED_PORTS = 256  # a range becomes one rule per port up to this many
UNPOPULATED_POLICY_ID = "platform:no-policy"

_said_no_policy = False


def state_from_snapshot(doc: Any) -> State:
    """The model of one ``GET /v1/nodes/{id}/state`` answer; WireFormatError naming the field on a wrong shape."""
    f = _fields(doc, "state")
    node_state = f.get("state")
    translated: dict[str, Any] = {
        "peers": [_peer(p, f"peers[{i}]") for i, p in enumerate(_array(f, "peers"))],
        "sessions": f.get("sessions"),
        PEER_VISIBILITY: "all",
    }
    block = None if node_state is None else _fields(node_state, "state")
    if block is not None:
        translated["metadata"] = _metadata(block)
    if "bridge" in f:
        translated["bridge"] = f["bridge"]
    state = State.from_wire(translated)
    return replace(state, policies=_policies(f.get("policy")), data=() if block is None else _data(block),
                   action_requests=action_requests(f.get("executions")))


def reachability(doc: Any) -> str:
    """The platform's verdict on this node (``healthy``, ``stale``, ...), "" when absent or not readable."""
    block = doc.get("reachability") if isinstance(doc, dict) else None
    value = block.get("state") if isinstance(block, dict) else None
    return value[:40] if isinstance(value, str) else ""


def _array(f: dict[str, Any], key: str) -> list[Any]:
    value = f.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise WireFormatError(key, f"must be an array, got {kind(value)}")
    return value


def _text(f: dict[str, Any], key: str, path: str) -> str:
    value = f.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WireFormatError(join(path, key), f"must be a string, got {kind(value)}")
    return value


def _peer(doc: Any, path: str) -> dict[str, Any]:
    f = _fields(doc, path)
    mesh_ip = _text(f, "mesh_ip", path)
    try:
        routed = [str(ipaddress.ip_network(mesh_ip))] if mesh_ip else []
    except ValueError:
        routed = []  # the desired-state builder refuses the peer with its own reason
    return {"id": _text(f, "node_id", path), "public_key": _text(f, "public_key", path), "mesh_ip": mesh_ip,
            "endpoint": _text(f, "fallback_endpoint", path), "allowed_ips": routed}


def _policies(block: Any) -> tuple[Policy, ...]:
    global _said_no_policy
    if block is None:
        if not _said_no_policy:
            _said_no_policy = True
            log.info("the control plane sends no policy for this node: mesh traffic is not filtered until it does")
        return (Policy(UNPOPULATED_POLICY_ID, (PolicyRule("*", "*", 0, "", "allow"),)),)
    try:
        f = _fields(block, "policy")
        rules: list[PolicyRule] = []
        for i, raw in enumerate(_array(f, "rules")):
            rules.extend(_rules(raw, f"policy.rules[{i}]"))
        return (Policy(_text(f, "revision_id", "policy") or "platform", tuple(rules)),)
    except WireFormatError as exc:  # the policy engine skips it whole, with the reason: nothing is allowed
        return (Policy("platform", problem=str(exc), raw=block),)


def _rules(doc: Any, path: str) -> list[PolicyRule]:
    """The spec-shaped rules one platform rule stands for; a rule that cannot be enforced is kept as a shape the
    policy engine refuses with this reason (`PolicyRule.problem`)."""
    try:
        f = _fields(doc, path)
        action, protocol = _text(f, "action", path), _text(f, "protocol", path)
        src, dst = _end(f, "source_cidr", path), _end(f, "destination_cidr", path)
        if action not in ("allow", "deny"):
            raise WireFormatError(join(path, "action"), f"{action[:20]!r} is not enforced here (allow or deny)")
        if protocol not in PROTOCOLS:
            raise WireFormatError(join(path, "protocol"), f"{protocol[:20]!r} is not tcp, udp, icmp or any")
        ports = _ports(f.get("ports"), join(path, "ports"))
    except WireFormatError as exc:
        return [PolicyRule("", "", problem=str(exc), raw=doc)]
    return [PolicyRule(src, dst, port, PROTOCOLS[protocol], action) for port in ports]


def _end(f: dict[str, Any], key: str, path: str) -> str:
    text = _text(f, key, path)
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise WireFormatError(join(path, key), f"{text[:50]!r} is not a CIDR") from None
    return "*" if net.prefixlen == 0 else str(net)


def _ports(doc: Any, path: str) -> list[int]:
    if doc is None:
        return [0]
    f = _fields(doc, path)
    low, high = f.get("from"), f.get("to")
    if not all(type(v) is int and 0 <= v <= 65535 for v in (low, high)) or low > high:  # type: ignore[operator]
        raise WireFormatError(path, "must be {from, to} with 0 <= from <= to <= 65535")
    if low <= 1 and high == 65535:
        return [0]
    if high - low + 1 > MAX_EXPANDED_PORTS:
        raise WireFormatError(path, f"a range of {high - low + 1} ports is not enforced here "
                                    f"(at most {MAX_EXPANDED_PORTS}, or the whole range)")
    return list(range(max(low, 1), high + 1))


def _metadata(block: dict[str, Any]) -> dict[str, str]:
    out = {}
    for i, entry in enumerate(_array(block, "metadata")):
        e = _fields(entry, f"state.metadata[{i}]")
        out[_text(e, "key", f"state.metadata[{i}]")] = _text(e, "value", f"state.metadata[{i}]")
    return out


def _data(block: dict[str, Any]) -> tuple[DataEntry, ...]:
    out = []
    for i, entry in enumerate(_array(block, "data")):
        path = f"state.data[{i}]"
        e = _fields(entry, path)
        out.append(DataEntry(key=_text(e, "key", path), content_type="text/plain", payload=_text(e, "value", path),
                             version=0, updated_at=GO_ZERO_TIME))
    return tuple(out)
