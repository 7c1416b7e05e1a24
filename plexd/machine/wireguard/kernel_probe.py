"""Whether this kernel has WireGuard, asked the way that also loads it.

On a server freshly booted, the wireguard module is on disk but not loaded: nothing has used it yet, so
`/sys/module/wireguard` is absent. Under plexd's unit (`ProtectKernelModules=yes`) plexd can neither load it nor
read `/lib/modules` to see that it exists. But the kernel loads a generic-netlink family's module by itself when
the family is asked for by name (its `net-pf-16-proto-16-family-wireguard` alias), in its own context: so asking
the generic-netlink controller for the `wireguard` family answers "is there kernel WireGuard here" and loads it
when there is, which is what `mesh.backend: auto` needs to pick the kernel backend on every kernel from 5.6.

Raw netlink, a few bytes each way; its request is also how the kernel backend finds the family's id
(plexd.machine.wireguard.genl).
"""

from __future__ import annotations

import os
import socket
import struct

_NETLINK_GENERIC = 16
_GENL_ID_CTRL = 0x10
_CTRL_CMD_GETFAMILY = 3
_CTRL_ATTR_FAMILY_NAME = 2
_NLM_F_REQUEST = 0x1
_NLMSG_ERROR = 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_GENL = struct.Struct("=BBH")  # genlmsghdr: cmd, version, reserved
_ATTR = struct.Struct("=HH")

MODULE_DIR = "/sys/module/wireguard"


def kernel_module_loaded() -> bool:
    """True when the kernel has WireGuard now (loaded module or built in: both show /sys/module/wireguard, since
    the module declares a version). Cheaper and quieter than asking netlink; it loads nothing."""
    return os.path.isdir(MODULE_DIR)


def getfamily_request(name: str) -> bytes:
    value = name.encode() + b"\0"
    attr = _ATTR.pack(_ATTR.size + len(value), _CTRL_ATTR_FAMILY_NAME) + value
    attr += b"\0" * (-len(attr) % 4)
    body = _GENL.pack(_CTRL_CMD_GETFAMILY, 1, 0) + attr
    return _HEADER.pack(_HEADER.size + len(body), _GENL_ID_CTRL, _NLM_F_REQUEST, 1, 0) + body


def has_genl_family(name: str, timeout: float = 5.0) -> bool:
    """Whether the kernel has the generic-netlink family `name`, having let it load the family's module. False
    when netlink cannot be asked at all (no permission, no generic netlink)."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_GENERIC)
    except OSError:
        return False
    with sock:
        sock.settimeout(timeout)
        try:
            sock.send(getfamily_request(name))
            data = sock.recv(65536)
        except OSError:
            return False
    if len(data) < _HEADER.size:
        return False
    _length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data)
    if kind != _NLMSG_ERROR:
        return kind == _GENL_ID_CTRL  # CTRL_CMD_NEWFAMILY: it exists
    return struct.unpack_from("=i", data, _HEADER.size)[0] == 0  # -ENOENT: no such family, nor module


def kernel_wireguard_available() -> bool:
    """Kernel WireGuard is here: loaded already, or loaded now because the kernel has it as a module."""
    return kernel_module_loaded() or has_genl_family("wireguard")
