"""The kernel WireGuard backend: generic netlink (`wireguard` family) through pyroute2.

Message building (`build_set_messages`) and dump parsing/merging (`parse_dump`) are pure and unit-tested; the
I/O around them (`KernelBackend`) needs the kernel module, which these machines do not have (see
`tests/unit/test_kernel_messages.py`). The kernel splits a large device into several dump messages: the device
fields come in the first, and a peer whose allowed IPs do not fit continues in the next message under the same
public key, so the parser merges by key. On the way in, a device with many peers is sent as several SET_DEVICE
messages (like `wg` does), the first carrying the device fields.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
from collections.abc import Iterable, Mapping
from socket import AF_INET, AF_INET6, inet_ntop, inet_pton

from pyroute2.netlink import NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST
from pyroute2.netlink.generic.wireguard import (
    WG_CMD_GET_DEVICE,
    WG_CMD_SET_DEVICE,
    WG_GENL_VERSION,
    WGDEVICE_F_REPLACE_PEERS,
    WGPEER_F_REMOVE_ME,
    WGPEER_F_REPLACE_ALLOWEDIPS,
    WGPEER_F_UPDATE_ONLY,
    wgmsg,
)

from plexd.mesh.wireguard import (
    ZERO_KEY,
    CounterRow,
    DeviceConfig,
    DeviceUpdate,
    PeerConfig,
    PeerCounters,
    PeerUpdate,
    WireGuardError,
    b64_to_hex,
    check_interface_name,
)

log = logging.getLogger(__name__)

PEERS_PER_MESSAGE = 64  # keeps each SET_DEVICE well under the netlink message size limit


def _split_endpoint(endpoint: str) -> dict:
    addr, _, port = endpoint.rpartition(":")
    return {"addr": addr.strip("[]"), "port": int(port)}


def _allowed_ip_attrs(cidr: str) -> dict:
    net = ipaddress.ip_network(cidr, strict=False)
    family = AF_INET if net.version == 4 else AF_INET6
    return {"attrs": [["WGALLOWEDIP_A_FAMILY", family],
                      ["WGALLOWEDIP_A_IPADDR", inet_pton(family, str(net.network_address))],
                      ["WGALLOWEDIP_A_CIDR_MASK", net.prefixlen]]}


def _peer_attrs(p: PeerUpdate) -> dict:
    attrs: list = [["WGPEER_A_PUBLIC_KEY", p.public_key]]
    flags = 0
    if p.remove:
        attrs.append(["WGPEER_A_FLAGS", WGPEER_F_REMOVE_ME])
        return {"attrs": attrs}
    if p.update_only:
        flags |= WGPEER_F_UPDATE_ONLY
    if p.allowed_ips is not None:
        flags |= WGPEER_F_REPLACE_ALLOWEDIPS
    attrs.append(["WGPEER_A_FLAGS", flags])
    if p.psk is not None:
        attrs.append(["WGPEER_A_PRESHARED_KEY", p.psk or ZERO_KEY])
    if p.endpoint:
        attrs.append(["WGPEER_A_ENDPOINT", _split_endpoint(p.endpoint)])
    if p.persistent_keepalive is not None:
        attrs.append(["WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", p.persistent_keepalive])
    if p.allowed_ips is not None:
        attrs.append(["WGPEER_A_ALLOWEDIPS", [_allowed_ip_attrs(ip) for ip in sorted(p.allowed_ips)]])
    return {"attrs": attrs}


def build_set_messages(interface: str, update: DeviceUpdate, peers_per_message: int = PEERS_PER_MESSAGE) -> list[wgmsg]:
    """SET_DEVICE messages (not yet encoded) for one update; at least one when the update is not empty."""
    if update.is_empty():
        return []
    chunks = [update.peers[i:i + peers_per_message] for i in range(0, len(update.peers), peers_per_message)] or [()]
    messages = []
    for n, chunk in enumerate(chunks):
        msg = wgmsg()
        msg["cmd"] = WG_CMD_SET_DEVICE
        msg["version"] = WG_GENL_VERSION
        msg["attrs"].append(["WGDEVICE_A_IFNAME", interface])
        if n == 0:
            if update.private_key is not None:
                msg["attrs"].append(["WGDEVICE_A_PRIVATE_KEY", update.private_key or ZERO_KEY])
            if update.listen_port is not None:
                msg["attrs"].append(["WGDEVICE_A_LISTEN_PORT", update.listen_port])
            if update.fwmark is not None:
                msg["attrs"].append(["WGDEVICE_A_FWMARK", update.fwmark])
            if update.replace_peers:
                msg["attrs"].append(["WGDEVICE_A_FLAGS", WGDEVICE_F_REPLACE_PEERS])
        if chunk:
            msg["attrs"].append(["WGDEVICE_A_PEERS", [_peer_attrs(p) for p in chunk]])
        messages.append(msg)
    return messages


def build_get_message(interface: str) -> wgmsg:
    msg = wgmsg()
    msg["cmd"] = WG_CMD_GET_DEVICE
    msg["version"] = WG_GENL_VERSION
    msg["attrs"].append(["WGDEVICE_A_IFNAME", interface])
    return msg


def _key(value: object) -> str:
    """pyroute2 hands keys back as base64 bytes (or, depending on the version, an nla dict with `value`)."""
    if isinstance(value, dict) or (hasattr(value, "get") and not isinstance(value, bytes | str)):
        value = value.get("value")
    return value.decode() if isinstance(value, bytes) else str(value)


def _endpoint(ep: dict | None) -> str:
    if not ep or not ep.get("port"):
        return ""
    addr = ep.get("addr", "")
    return f"[{addr}]:{ep['port']}" if ":" in addr else f"{addr}:{ep['port']}"


def _allowed_ip(a) -> str:
    family = a.get_attr("WGALLOWEDIP_A_FAMILY")
    raw = a.get_attr("WGALLOWEDIP_A_IPADDR")
    if isinstance(raw, str):  # pyroute2 decodes the address as "0a:64:00:01"
        raw = bytes.fromhex(raw.replace(":", ""))
    return str(ipaddress.ip_network(f"{inet_ntop(family, raw)}/{a.get_attr('WGALLOWEDIP_A_CIDR_MASK')}",
                                    strict=False))


def parse_dump(messages: Iterable[wgmsg]) -> DeviceConfig:
    """Merge the parts of a GET_DEVICE dump into one `DeviceConfig`."""
    private_key = ""
    listen_port = 0
    fwmark = 0
    peers: dict[str, dict] = {}
    for msg in messages:
        if msg.get_attr("WGDEVICE_A_PRIVATE_KEY") is not None:
            private_key = _key(msg.get_attr("WGDEVICE_A_PRIVATE_KEY"))
        if msg.get_attr("WGDEVICE_A_LISTEN_PORT") is not None:
            listen_port = msg.get_attr("WGDEVICE_A_LISTEN_PORT")
        if msg.get_attr("WGDEVICE_A_FWMARK") is not None:
            fwmark = msg.get_attr("WGDEVICE_A_FWMARK")
        for peer in msg.get_attr("WGDEVICE_A_PEERS") or []:
            key = _key(peer.get_attr("WGPEER_A_PUBLIC_KEY"))
            cur = peers.setdefault(key, {"endpoint": "", "allowed": set(), "psk": "", "keepalive": 0, "hs": 0.0,
                                         "rx": 0, "tx": 0})
            psk = peer.get_attr("WGPEER_A_PRESHARED_KEY")
            if psk is not None:
                value = _key(psk)
                cur["psk"] = "" if value == ZERO_KEY else value
            if peer.get_attr("WGPEER_A_ENDPOINT") is not None:
                cur["endpoint"] = _endpoint(peer.get_attr("WGPEER_A_ENDPOINT"))
            if peer.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") is not None:
                cur["keepalive"] = peer.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL")
            hs = peer.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME")
            if hs is not None:
                cur["hs"] = hs.get("tv_sec", 0) + hs.get("tv_nsec", 0) / 1e9
            for field_, attr in (("rx", "WGPEER_A_RX_BYTES"), ("tx", "WGPEER_A_TX_BYTES")):
                if peer.get_attr(attr) is not None:
                    cur[field_] = peer.get_attr(attr)
            for a in peer.get_attr("WGPEER_A_ALLOWEDIPS") or []:
                cur["allowed"].add(_allowed_ip(a))
    if private_key == ZERO_KEY:
        private_key = ""
    return DeviceConfig(
        private_key=private_key, listen_port=listen_port, fwmark=fwmark,
        peers={k: PeerConfig(public_key=k, endpoint=v["endpoint"], allowed_ips=frozenset(v["allowed"]), psk=v["psk"],
                             persistent_keepalive=v["keepalive"], last_handshake=v["hs"], rx=v["rx"], tx=v["tx"])
               for k, v in peers.items()},
    )


class KernelBackend:
    """`WireGuardBackend` over generic netlink, in the current or a named network namespace. Where the kernel has
    the module, tests/e2e/test_converge.py runs its drift test through it; these machines have none."""

    def __init__(self, interface: str, netns: str | None = None) -> None:
        self.interface = interface
        self.netns = netns

    def _socket(self):
        """The generic-netlink socket, opened in the backend's network namespace (a socket stays in the namespace
        it was created in; `pushns` moves only this worker thread, and only for the moment of the open)."""
        from pyroute2 import WireGuard, netns
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            if self.netns is None:
                return WireGuard()
            netns.pushns(self.netns)
            try:
                return WireGuard()
            finally:
                netns.popns()
        except NetlinkError as e:
            if e.code == errno.ENOENT:
                raise WireGuardError("the kernel has no WireGuard generic-netlink family (module not loaded)") from None
            if e.code == errno.EPERM:
                raise WireGuardError("no permission for netlink: plexd must run as root or with CAP_NET_ADMIN") \
                    from None
            raise WireGuardError(f"cannot open WireGuard netlink: {e}") from None

    def process_gone(self) -> bool:
        return False

    async def close(self) -> None:
        """Nothing to let go of: the device is the kernel's (`delete_device` removes it)."""

    async def observe(self) -> DeviceConfig | None:
        return await asyncio.to_thread(self._observe)

    async def counters(self) -> Mapping[str, PeerCounters] | None:
        device = await self.observe()  # the netlink dump has no lighter form
        if device is None:
            return None
        return {key: PeerCounters(p.last_handshake, p.rx, p.tx) for key, p in device.peers.items()}

    async def counter_rows(self) -> list[CounterRow] | None:
        device = await self.observe()
        if device is None:
            return None
        rows: list[CounterRow] = []
        for key, p in device.peers.items():
            seconds = int(p.last_handshake)
            rows.append((b64_to_hex(key), str(seconds), str(round((p.last_handshake - seconds) * 1e9)),
                         str(p.tx), str(p.rx)))
        return rows

    def _observe(self) -> DeviceConfig | None:
        from pyroute2.netlink.exceptions import NetlinkError

        wg = self._socket()
        try:
            msg = build_get_message(self.interface)
            parts = list(wg.nlm_request(msg, msg_type=wg.prid, msg_flags=NLM_F_REQUEST | NLM_F_DUMP))
            return parse_dump(parts)
        except NetlinkError as e:
            if e.code in (errno.ENODEV, errno.ENOENT):
                return None
            raise WireGuardError(f"cannot read WireGuard device {self.interface}: {e}") from None
        finally:
            wg.close()

    async def apply(self, update: DeviceUpdate) -> None:
        await asyncio.to_thread(self._apply, update)

    def _apply(self, update: DeviceUpdate) -> None:
        from pyroute2.netlink.exceptions import NetlinkError

        wg = self._socket()
        try:
            for msg in build_set_messages(self.interface, update):
                try:
                    list(wg.nlm_request(msg, msg_type=wg.prid, msg_flags=NLM_F_REQUEST | NLM_F_ACK))
                except NetlinkError as e:
                    raise WireGuardError(f"WireGuard refused a set on {self.interface}: {e}") from None
        finally:
            wg.close()

    async def ensure_device(self) -> bool:
        check_interface_name(self.interface)
        return await asyncio.to_thread(self._ensure)

    def _ensure(self) -> bool:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute(netns=self.netns) if self.netns else IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.interface):
                return False
            try:
                ipr.link("add", ifname=self.interface, kind="wireguard")
            except NetlinkError as e:
                if e.code == errno.EOPNOTSUPP:
                    raise WireGuardError("the kernel has no WireGuard (link type wireguard not supported)") from None
                raise WireGuardError(f"cannot create {self.interface}: {e}") from None
            return True

    async def delete_device(self) -> None:
        from plexd.mesh.links import Links

        await Links(self.interface, self.netns).delete_link()
