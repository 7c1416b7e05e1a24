"""The user-access and site-to-site parts of a bridge's state: one desired value each, from either contract.

Shapes (docs/protocol.md §A2.1): `bridge.user_access` / `bridge.site_to_site` (newer contract) or
`user_access_config` / `site_to_site_config` (older state). A null block, or a null child of `bridge`, means
"nothing desired" (torn down). Parsing here is structural and bounded: an entry of the wrong shape, a duplicate
id or key, or one past the limits (50 access peers, 10 tunnels) is refused by its index with the reason, and
the others apply. What needs the machine or the configuration to judge (subnets overlapping the mesh or this
node's own networks, a default route without the operator's allow) is the domains' to refuse.

Unlike the Go agent, nothing the control plane sends is silently ignored (docs/decisions.md, Go defect D11):
`enabled: false` tears the part down, `interface_name` and `listen_port` are taken when valid, and a site-to-site
`provider_type` other than WireGuard is refused with a reason.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from plexd.base.errors import WireFormatError
from plexd.state.relay_block import Address, parse_endpoint, text_field

MAX_ACCESS_PEERS = 50
MAX_TUNNELS = 10
MAX_INGRESS_RULES = 20
MAX_PEM = 64 * 1024  # a certificate chain or a key
MAX_PREFIXES = 64  # per peer or tunnel side: a list longer than this is not a site, it is a mistake
ACCESS_INTERFACE = "wg-access"
ACCESS_PORT = 51822
TUNNEL_PREFIX = "wg-s2s-"
TUNNEL_PORT = 51823
IFNAME_MAX = 15


@dataclass(frozen=True)
class AccessPeer:
    public_key: str
    allowed_ips: tuple[str, ...]
    psk: str = field(default="", repr=False)
    label: str = ""


@dataclass(frozen=True)
class UserAccess:
    """`enabled` false or no block: no access interface. `refused`: one line per entry not taken."""

    enabled: bool = False
    interface: str = ACCESS_INTERFACE
    listen_port: int = ACCESS_PORT
    peers: tuple[AccessPeer, ...] = ()
    refused: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tunnel:
    tunnel_id: str
    interface: str
    listen_port: int
    remote_endpoint: Address
    remote_public_key: str
    local_subnets: tuple[str, ...]
    remote_subnets: tuple[str, ...]
    psk: str = field(default="", repr=False)


@dataclass(frozen=True)
class SiteToSite:
    enabled: bool = False
    tunnels: tuple[Tunnel, ...] = ()
    refused: tuple[str, ...] = ()


@dataclass(frozen=True)
class IngressRule:
    rule_id: str
    listen_port: int
    target: Address
    mode: str  # "tcp" (passthrough; by SNI when `hostname` is set) or "terminate"
    hostname: str = ""
    cert_pem: str = field(default="", repr=False)
    key_pem: str = field(default="", repr=False)


@dataclass(frozen=True)
class Ingress:
    enabled: bool = False
    rules: tuple[IngressRule, ...] = ()
    refused: tuple[str, ...] = ()


def _block(state: Mapping[str, object], child: str, legacy: str) -> object | None:
    bridge = state.get("bridge")
    if isinstance(bridge, Mapping):
        return bridge.get(child)
    return state.get(legacy)


def has_block(state: Mapping[str, object], legacy: str) -> bool:
    """Whether this state says anything about the part (a `bridge` block, even null, or the older key)."""
    return "bridge" in state or legacy in state


def _key(doc: Mapping[str, object], key: str, path: str, *, required: bool = True) -> str:
    value = doc.get(key)
    if value in (None, "") and not required:
        return ""
    if not isinstance(value, str):
        raise WireFormatError(f"{path}.{key}", "must be a base64 WireGuard key")
    try:
        ok = len(base64.b64decode(value, validate=True)) == 32
    except (binascii.Error, ValueError):
        ok = False
    if not ok:
        raise WireFormatError(f"{path}.{key}", "is not a WireGuard key (standard base64 of 32 bytes)")
    return value


def _prefixes(doc: Mapping[str, object], key: str, path: str, *, required: bool) -> tuple[str, ...]:
    value = doc.get(key)
    if value is None and not required:
        return ()
    if not isinstance(value, list) or (required and not value):
        raise WireFormatError(f"{path}.{key}", "must be a non-empty list of CIDRs" if required else
                              "must be a list of CIDRs")
    if len(value) > MAX_PREFIXES:
        raise WireFormatError(f"{path}.{key}", f"has {len(value)} prefixes; at most {MAX_PREFIXES}")
    out = []
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise WireFormatError(f"{path}.{key}[{i}]", "must be a CIDR string")
        try:
            out.append(str(ipaddress.ip_network(text, strict=False)))
        except ValueError:
            raise WireFormatError(f"{path}.{key}[{i}]", f"{text[:64]!r} is not a CIDR") from None
    return tuple(dict.fromkeys(out))


def _port(doc: Mapping[str, object], key: str, path: str, default: int) -> int:
    value = doc.get(key)
    if value in (None, 0):
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise WireFormatError(f"{path}.{key}", "must be a port number 1-65535")
    return value


def _interface(doc: Mapping[str, object], path: str, default: str, prefix: str) -> str:
    name = text_field(doc, "interface_name", path, required=False) or default
    if not name.startswith(prefix) or len(name) > IFNAME_MAX or any(c in name for c in "/: \t.") :
        raise WireFormatError(f"{path}.interface_name", f"{name!r} must start with {prefix!r}, be at most "
                              f"{IFNAME_MAX} characters and hold no '/', ':', '.' or spaces (plexd never "
                              "configures an interface it did not name)")
    return name


def _enabled(doc: Mapping[str, object], path: str) -> bool:
    value = doc.get("enabled", True)
    if not isinstance(value, bool):
        raise WireFormatError(f"{path}.enabled", "must be true or false")
    return value


def parse_user_access(state: Mapping[str, object]) -> UserAccess:
    doc = _block(state, "user_access", "user_access_config")
    path = "bridge.user_access" if "bridge" in state else "user_access_config"
    if doc is None:
        return UserAccess()
    try:
        if not isinstance(doc, Mapping):
            raise WireFormatError(path, "must be an object")
        enabled = _enabled(doc, path)
        interface = _interface(doc, path, ACCESS_INTERFACE, "wg-")
        port = _port(doc, "listen_port", path, ACCESS_PORT)
        entries = doc.get("peers") or []
        if not isinstance(entries, list):
            raise WireFormatError(f"{path}.peers", "must be a list")
    except WireFormatError as e:
        return UserAccess(refused=(str(e),))
    peers: dict[str, AccessPeer] = {}
    refused: list[str] = []
    for i, entry in enumerate(entries):
        where = f"{path}.peers[{i}]"
        try:
            if not isinstance(entry, Mapping):
                raise WireFormatError(where, "must be an object")
            peer = AccessPeer(_key(entry, "public_key", where), _prefixes(entry, "allowed_ips", where, required=True),
                              _key(entry, "psk", where, required=False),
                              text_field(entry, "label", where, required=False))
        except WireFormatError as e:
            refused.append(str(e))
            continue
        if peer.public_key in peers:
            refused.append(f"{where}: duplicate public_key {peer.public_key[:8]}…")
        elif len(peers) >= MAX_ACCESS_PEERS:
            refused.append(f"{where}: limit of {MAX_ACCESS_PEERS} access peers reached")
        else:
            peers[peer.public_key] = peer
    return UserAccess(enabled, interface, port, tuple(peers.values()), tuple(refused))


def parse_site_to_site(state: Mapping[str, object]) -> SiteToSite:
    doc = _block(state, "site_to_site", "site_to_site_config")
    path = "bridge.site_to_site" if "bridge" in state else "site_to_site_config"
    if doc is None:
        return SiteToSite()
    try:
        if not isinstance(doc, Mapping):
            raise WireFormatError(path, "must be an object")
        enabled = _enabled(doc, path)
        entries = doc.get("tunnels") or []
        if not isinstance(entries, list):
            raise WireFormatError(f"{path}.tunnels", "must be a list")
    except WireFormatError as e:
        return SiteToSite(refused=(str(e),))
    tunnels: dict[str, Tunnel] = {}
    names: set[str] = set()
    ports: set[int] = set()
    refused: list[str] = []
    for i, entry in enumerate(entries):
        where = f"{path}.tunnels[{i}]"
        try:
            tunnel = _tunnel(entry, where, i)
        except WireFormatError as e:
            refused.append(str(e))
            continue
        if tunnel.tunnel_id in tunnels:
            refused.append(f"{where}: duplicate tunnel_id {tunnel.tunnel_id!r}")
        elif tunnel.interface in names:
            refused.append(f"{where}: interface {tunnel.interface} is another tunnel's")
        elif tunnel.listen_port in ports:
            refused.append(f"{where}: listen_port {tunnel.listen_port} is another tunnel's")
        elif len(tunnels) >= MAX_TUNNELS:
            refused.append(f"{where}: limit of {MAX_TUNNELS} site-to-site tunnels reached")
        else:
            tunnels[tunnel.tunnel_id] = tunnel
            names.add(tunnel.interface)
            ports.add(tunnel.listen_port)
    return SiteToSite(enabled, tuple(tunnels.values()), tuple(refused))


def _tunnel(entry: object, where: str, index: int) -> Tunnel:
    if not isinstance(entry, Mapping):
        raise WireFormatError(where, "must be an object")
    provider = entry.get("provider_type") or ""
    if provider not in ("", "wireguard"):
        raise WireFormatError(f"{where}.provider_type", f"{str(provider)[:32]!r} is not supported (only WireGuard "
                              "tunnels: '' or 'wireguard')")
    return Tunnel(
        tunnel_id=text_field(entry, "tunnel_id", where),
        interface=_interface(entry, where, f"{TUNNEL_PREFIX}{index + 1}", TUNNEL_PREFIX),
        listen_port=_port(entry, "listen_port", where, TUNNEL_PORT + index),
        remote_endpoint=parse_endpoint(entry.get("remote_endpoint"), f"{where}.remote_endpoint"),
        remote_public_key=_key(entry, "remote_public_key", where),
        local_subnets=_prefixes(entry, "local_subnets", where, required=False),
        remote_subnets=_prefixes(entry, "remote_subnets", where, required=True),
        psk=_key(entry, "psk", where, required=False),
    )


def parse_ingress(state: Mapping[str, object]) -> Ingress:
    """Rules sharing a listen port must all be `tcp` with distinct hostnames (the listener picks by SNI); any
    other clash on a port is refused."""
    doc = _block(state, "ingress", "ingress_config")
    path = "bridge.ingress" if "bridge" in state else "ingress_config"
    if doc is None:
        return Ingress()
    try:
        if not isinstance(doc, Mapping):
            raise WireFormatError(path, "must be an object")
        enabled = _enabled(doc, path)
        entries = doc.get("rules") or []
        if not isinstance(entries, list):
            raise WireFormatError(f"{path}.rules", "must be a list")
    except WireFormatError as e:
        return Ingress(refused=(str(e),))
    rules: dict[str, IngressRule] = {}
    refused: list[str] = []
    for i, entry in enumerate(entries):
        where = f"{path}.rules[{i}]"
        try:
            rule = _ingress_rule(entry, where)
        except WireFormatError as e:
            refused.append(str(e))
            continue
        sharing = [r for r in rules.values() if r.listen_port == rule.listen_port]
        if rule.rule_id in rules:
            refused.append(f"{where}: duplicate rule_id {rule.rule_id!r}")
        elif sharing and not (rule.mode == "tcp" and rule.hostname and all(
                r.mode == "tcp" and r.hostname and r.hostname != rule.hostname for r in sharing)):
            refused.append(f"{where}: listen_port {rule.listen_port} is rule {sharing[0].rule_id!r}'s (rules may "
                           "share a port only as tcp rules with distinct hostnames)")
        elif len(rules) >= MAX_INGRESS_RULES:
            refused.append(f"{where}: limit of {MAX_INGRESS_RULES} ingress rules reached")
        else:
            rules[rule.rule_id] = rule
    return Ingress(enabled, tuple(rules.values()), tuple(refused))


def _ingress_rule(entry: object, where: str) -> IngressRule:
    if not isinstance(entry, Mapping):
        raise WireFormatError(where, "must be an object")
    rule_id = text_field(entry, "rule_id", where)
    mode = entry.get("mode") or "tcp"
    if mode == "acme":
        raise WireFormatError(f"{where}.mode", "'acme' is not supported: this bridge obtains no certificates; use "
                              "'terminate' with cert_pem and key_pem, or 'tcp' to pass TLS through")
    if mode not in ("tcp", "terminate"):
        raise WireFormatError(f"{where}.mode", f"{str(mode)[:32]!r} is not a mode ('tcp' or 'terminate')")
    port = _port(entry, "listen_port", where, 0)
    if not port:
        raise WireFormatError(f"{where}.listen_port", "must be a port number 1-65535")
    hostname = text_field(entry, "hostname", where, required=False).lower().rstrip(".")
    labels = hostname.split(".")
    if hostname and not all(part and len(part) <= 63 and (all(c.isalnum() or c in "-_" for c in part)
                                                          or (i == 0 and part == "*" and len(labels) > 2))
                            for i, part in enumerate(labels)):
        raise WireFormatError(f"{where}.hostname", f"{hostname!r} is not a host name (a wildcard is '*.' in front "
                              "of at least two labels: *.example.com)")
    cert = key = ""
    if mode == "terminate":
        cert, key = (_pem(entry, name, where) for name in ("cert_pem", "key_pem"))
    return IngressRule(rule_id, port, parse_endpoint(entry.get("target_addr"), f"{where}.target_addr"), mode,
                       hostname, cert, key)


def _pem(doc: Mapping[str, object], key: str, path: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or "-----BEGIN " not in value:
        raise WireFormatError(f"{path}.{key}", "must be PEM text (mode 'terminate' needs cert_pem and key_pem)")
    if len(value) > MAX_PEM:
        raise WireFormatError(f"{path}.{key}", f"is longer than {MAX_PEM} bytes")
    return value
