"""`POST /v1/keys/rotate` in the platform dialect: a node completes the mesh-key rotation the control plane armed.

Armed by the admin (`keys/rotate`, which also sends the node `rotate_keys`, or the heartbeat flag `rotate_keys`);
while armed, every heartbeat answers `rotate_keys: true`. Completing it swaps the node's key (its peers are told
to pull) and answers a receipt `{rotation_id, kid, wrap_key_version}`, kept so that a node repeating the call
with the key it just installed (its answer was lost) gets the same receipt. The same key as now without such a
receipt is `422 keys_rotate_public_key_unchanged`, nothing armed `409 keys_rotate_no_pending_rotation`.
"""

from __future__ import annotations

import json
from typing import Any

from plexd.base import boundedjson
from plexd.devplane.platform_wire import Problem, uuid7
from plexd.devplane.store import Node
from plexd.devplane.wire import DevplaneAPIError

_META = "key_rotation:"  # + node id: {"public_key": the key installed, "receipt": its answer}
KID_PREFIX = "did:web:devplane.invalid#psk-"


def last_rotation(dep: Any, node: Node) -> dict[str, Any] | None:
    raw = dep.store.get_meta(_META + node.id)
    return boundedjson.parse(raw) if raw else None


def complete(dep: Any, node: Node, new_key: str) -> dict[str, Any]:
    last = last_rotation(dep, node)
    if new_key == node.public_key:
        if last is not None and last["public_key"] == new_key:
            return last["receipt"]
        raise Problem(422, "keys_rotate_public_key_unchanged", "new_public_key: is the node's key already")
    if not node.flags.get("rotate_keys"):
        raise Problem(409, "keys_rotate_no_pending_rotation", f"no key rotation is pending for node {node.id}")
    version = (last["receipt"]["wrap_key_version"] if last else 0) + 1
    receipt = {"rotation_id": uuid7(), "kid": f"{KID_PREFIX}{version}", "wrap_key_version": version}
    try:
        with dep.store.transaction():
            dep.rotate_node_key(node, new_key)
            node.flags.pop("rotate_keys", None)
            dep.store.save_node(node)
            dep.store.set_meta(_META + node.id, json.dumps({"public_key": new_key, "receipt": receipt}))
    except DevplaneAPIError as exc:
        if exc.status == 401:
            raise Problem(401, "nsk_revoked", exc.message) from None
        raise Problem(422, "keys_rotate_public_key_invalid", exc.message) from None  # another node's key
    return receipt
