"""Durable state of the reference control plane: one SQLite file in WAL mode.

The server process is the only writer and keeps the hot state (nodes) in memory, writing through on every
change; SQLite is what makes it survive a restart. Every call runs on the event-loop thread and each mutating
call is one transaction, so a crash (even SIGKILL) leaves either the old or the new state, never a mix.
"""

from __future__ import annotations

import json
import os
import sqlite3
from array import array
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plexd.base.errors import PlexdError
from plexd.identity import node_secret

SCHEMA_VERSION = 2

# token_limits, register_nonces and uploads came later and only add to version 2 (nothing older changed): CREATE
# IF NOT EXISTS puts them into an older file at its next open.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
    token TEXT PRIMARY KEY, created_at TEXT NOT NULL, used_at TEXT, node_id TEXT);
CREATE TABLE IF NOT EXISTS nodes (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS released_ips (ip TEXT PRIMARY KEY, released_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY, event_type TEXT NOT NULL, data TEXT NOT NULL, created_at REAL NOT NULL,
    targets BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY, node_id TEXT NOT NULL, kind TEXT NOT NULL, received_at TEXT NOT NULL,
    body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS records_by_node ON records (node_id, kind, id);
CREATE TABLE IF NOT EXISTS executions (
    node_id TEXT NOT NULL, execution_id TEXT NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (node_id, execution_id));
CREATE TABLE IF NOT EXISTS token_limits (token TEXT PRIMARY KEY, expires_at REAL, revoked_at TEXT);
CREATE TABLE IF NOT EXISTS register_nonces (
    project_id TEXT NOT NULL, nonce TEXT NOT NULL, node_id TEXT NOT NULL, used_at TEXT NOT NULL,
    PRIMARY KEY (project_id, nonce));
CREATE TABLE IF NOT EXISTS uploads (
    token TEXT PRIMARY KEY, node_id TEXT NOT NULL, execution_id TEXT NOT NULL, declared INTEGER NOT NULL,
    sha256 TEXT, data BLOB);
"""

RECORDS_KEPT_PER_KIND = 1000  # per node and kind; older rows are pruned so a chatty node cannot fill the disk


class StoreError(PlexdError):
    """The database cannot be opened or written."""


@dataclass
class Node:
    """One registered node. Kept in memory, persisted as a JSON document."""

    id: str
    hostname: str
    public_key: str
    mesh_ip: str
    secret: str = field(repr=False)  # the node secret: never in a repr
    registered_at: str
    metadata: dict[str, str] = field(default_factory=dict)
    capabilities: Any = None
    endpoint: str = ""
    nat_type: str = ""
    status: str = "online"  # online | unreachable | offline | deregistered
    last_seen: float = 0.0  # wall-clock epoch seconds
    last_heartbeat: Any = None
    data: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> DataEntry wire dict
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)  # key -> {"value", "version"}
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> the ReportEntry the node last sent
    flags: dict[str, bool] = field(default_factory=dict)  # one-shot heartbeat flags
    removed: bool = False
    num: int = 0  # small per-deployment number, used to address events compactly
    # "hkdf-sha256" when the node offered the derivation at registration (plexd.identity.node_secret): its bearer
    # and the key of its secrets are derived from `secret`; "" (nodes that did not offer it, the Go agent):
    # `secret` is both
    kdf: str = ""
    # session id -> session (plexd.devplane.session_issuer)
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    bridge: dict[str, Any] | None = None  # the `bridge` block of a bridge node's state, as the admin set it

    @property
    def bearer(self) -> str:
        """What this node sends as its bearer token."""
        return node_secret.bearer(self.secret, self.kdf)

    def to_doc(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_doc(cls, doc: str) -> Node:
        raw = json.loads(doc)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def secret_refs(self) -> list[dict[str, Any]]:
        """The node's secrets as `secret_refs` (§8.5): key and version, never the value."""
        return [{"key": k, "version": s["version"]} for k, s in self.secrets.items()]

    def peer(self) -> dict[str, Any]:
        """The node as a peer object (§1.3): every field always present."""
        return {
            "id": self.id,
            "public_key": self.public_key,
            "mesh_ip": self.mesh_ip,
            "endpoint": self.endpoint,
            "allowed_ips": [f"{self.mesh_ip}/32", *self.routed()],
            "psk": "",
        }

    def routed(self) -> list[str]:
        """What a bridge carries for the mesh besides itself: its access peers' prefixes and its site-to-site
        tunnels' remote subnets (the other nodes route them to it; the bridge's firewall decides who gets through)."""
        block = self.bridge if isinstance(self.bridge, dict) else {}
        out: list[str] = []
        access = block.get("user_access")
        if isinstance(access, dict) and access.get("enabled", True) is not False:
            for peer in access.get("peers") or []:
                out += [c for c in (peer.get("allowed_ips") or []) if isinstance(c, str)] if isinstance(peer, dict) \
                    else []
        s2s = block.get("site_to_site")
        if isinstance(s2s, dict) and s2s.get("enabled", True) is not False:
            for tunnel in s2s.get("tunnels") or []:
                out += [c for c in (tunnel.get("remote_subnets") or []) if isinstance(c, str)] \
                    if isinstance(tunnel, dict) else []
        return list(dict.fromkeys(out))


class Store:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            if not self.path.parent.is_dir():
                raise StoreError(f"cannot open database {self.path}: directory {self.path.parent} does not exist")
            fresh = not self.path.exists()
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            if fresh:
                os.chmod(self.path, 0o600)  # holds node secrets and the signing key
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL keeps it consistent
            self.db.execute("PRAGMA busy_timeout=5000")
            self.db.executescript(_SCHEMA)
            self._check_version()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open database {self.path}: {exc} (check the path and its permissions)") from None
        except OSError as exc:
            raise StoreError(f"cannot open database {self.path}: {exc.strerror or exc}") from None
        self._record_inserts: dict[tuple[str, str], int] = {}

    def _check_version(self) -> None:
        version = self.get_meta("schema_version")
        if version is None:
            self.set_meta("schema_version", str(SCHEMA_VERSION))
        elif version != str(SCHEMA_VERSION):
            raise StoreError(f"database {self.path} has schema version {version}, this devplane expects "
                             f"{SCHEMA_VERSION}; use a new --db path")

    def close(self) -> None:
        self.db.close()

    def transaction(self) -> _Tx:
        return _Tx(self.db)

    # -- meta ---------------------------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                        (key, value))

    # -- bootstrap tokens ---------------------------------------------------------------------------------------

    def add_token(self, token: str, created_at: str) -> None:
        self.db.execute("INSERT INTO tokens(token, created_at) VALUES(?, ?)", (token, created_at))

    def token_status(self, token: str) -> str:
        """'unknown', 'unused' or 'used'."""
        row = self.db.execute("SELECT used_at FROM tokens WHERE token=?", (token,)).fetchone()
        if row is None:
            return "unknown"
        return "unused" if row[0] is None else "used"

    def token_node(self, token: str) -> str | None:
        """The node a used token registered."""
        row = self.db.execute("SELECT node_id FROM tokens WHERE token=? AND used_at IS NOT NULL", (token,)).fetchone()
        return row[0] if row else None

    def use_token(self, token: str, node_id: str, used_at: str) -> bool:
        cur = self.db.execute("UPDATE tokens SET used_at=?, node_id=? WHERE token=? AND used_at IS NULL",
                              (used_at, node_id, token))
        return cur.rowcount == 1

    def limit_token(self, token: str, *, expires_at: float | None = None, revoked_at: str | None = None) -> None:
        """An expiry (epoch seconds) or a revocation for a token; what is not given stays as it was."""
        self.db.execute("INSERT INTO token_limits(token, expires_at, revoked_at) VALUES(?, ?, ?) ON CONFLICT(token) "
                        "DO UPDATE SET expires_at=COALESCE(excluded.expires_at, expires_at), "
                        "revoked_at=COALESCE(excluded.revoked_at, revoked_at)", (token, expires_at, revoked_at))

    def token_refusal(self, token: str, now: float) -> str | None:
        """'revoked' or 'expired' when an admin limited the token and the limit applies now, else None."""
        row = self.db.execute("SELECT expires_at, revoked_at FROM token_limits WHERE token=?", (token,)).fetchone()
        if row is None:
            return None
        if row[1] is not None:
            return "revoked"
        if row[0] is not None and now >= row[0]:
            return "expired"
        return None

    def tokens(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT token, created_at, used_at, node_id FROM tokens ORDER BY created_at")
        return [{"token": r[0], "created_at": r[1], "used_at": r[2], "node_id": r[3]} for r in rows]

    # -- nodes --------------------------------------------------------------------------------------------------

    def load_nodes(self) -> list[Node]:
        return [Node.from_doc(r[0]) for r in self.db.execute("SELECT doc FROM nodes")]

    def save_node(self, node: Node) -> None:
        self.db.execute("INSERT INTO nodes(id, doc) VALUES(?, ?) ON CONFLICT(id) DO UPDATE SET doc=excluded.doc",
                        (node.id, node.to_doc()))

    def release_ip(self, ip: str, at: float) -> None:
        self.db.execute("INSERT INTO released_ips(ip, released_at) VALUES(?, ?) "
                        "ON CONFLICT(ip) DO UPDATE SET released_at=excluded.released_at", (ip, at))

    def released_ips(self) -> dict[str, float]:
        return dict(self.db.execute("SELECT ip, released_at FROM released_ips").fetchall())

    def forget_released_ip(self, ip: str) -> None:
        self.db.execute("DELETE FROM released_ips WHERE ip=?", (ip,))

    # -- events -------------------------------------------------------------------------------------------------

    def last_event_seq(self) -> int:
        row = self.db.execute("SELECT MAX(seq) FROM events").fetchone()
        return int(row[0] or 0)

    def add_event(self, seq: int, event_type: str, data: str, created_at: float, targets: Iterable[int]) -> None:
        """One row per event; `targets` are node numbers, packed 4 bytes each.

        A row per (node, event) would scatter a full-mesh event over hundreds of B-tree pages (one per node),
        making every registration rewrite megabytes; a packed list keeps it to one row appended at the end.
        """
        packed = array("I", targets).tobytes()
        self.db.execute("INSERT INTO events(seq, event_type, data, created_at, targets) VALUES(?, ?, ?, ?, ?)",
                        (seq, event_type, data, created_at, packed))

    def events_after(self, node_num: int, after_seq: int, since: float | None = None) -> list[tuple[int, str, str]]:
        """(seq, event_type, data) addressed to node `node_num`, oldest first; `since` (epoch) bounds by age."""
        sql = "SELECT seq, event_type, data, targets FROM events WHERE seq>?"
        args: list[Any] = [after_seq]
        if since is not None:
            sql += " AND created_at>=?"
            args.append(since)
        out = []
        for seq, event_type, data, packed in self.db.execute(sql + " ORDER BY seq", args):
            targets = array("I")
            targets.frombytes(packed)
            if node_num in targets:
                out.append((seq, event_type, data))
        return out

    def prune_events(self, keep_after_seq: int) -> int:
        cur = self.db.execute("DELETE FROM events WHERE seq<=?", (keep_after_seq,))
        return cur.rowcount

    # -- records (drift, reports, telemetry, ...) ----------------------------------------------------------------

    def add_record(self, node_id: str, kind: str, received_at: str, body: str) -> None:
        self.db.execute("INSERT INTO records(node_id, kind, received_at, body) VALUES(?, ?, ?, ?)",
                        (node_id, kind, received_at, body))
        key = (node_id, kind)
        count = self._record_inserts.get(key, 0) + 1
        self._record_inserts[key] = count
        if count % 100 == 0:
            self.db.execute(
                "DELETE FROM records WHERE node_id=? AND kind=? AND id <= "
                "(SELECT id FROM records WHERE node_id=? AND kind=? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (node_id, kind, node_id, kind, RECORDS_KEPT_PER_KIND))

    def records(self, node_id: str, kind: str) -> list[tuple[str, str]]:
        """(received_at, body) oldest first."""
        return self.db.execute("SELECT received_at, body FROM records WHERE node_id=? AND kind=? ORDER BY id",
                               (node_id, kind)).fetchall()

    def last_record_time(self, node_id: str, kind: str) -> str | None:
        """When the newest record of `kind` from the node was received."""
        row = self.db.execute("SELECT received_at FROM records WHERE node_id=? AND kind=? ORDER BY id DESC LIMIT 1",
                              (node_id, kind)).fetchone()
        return row[0] if row else None

    # -- registration nonces (the platform contract) ------------------------------------------------------------

    def nonce_node(self, project_id: str, nonce: str) -> str | None:
        """The node a successful registration with this (project, nonce) created, or None."""
        row = self.db.execute("SELECT node_id FROM register_nonces WHERE project_id=? AND nonce=?",
                              (project_id, nonce)).fetchone()
        return row[0] if row else None

    def record_nonce(self, project_id: str, nonce: str, node_id: str, used_at: str) -> None:
        self.db.execute("INSERT INTO register_nonces(project_id, nonce, node_id, used_at) VALUES(?, ?, ?, ?) "
                        "ON CONFLICT(project_id, nonce) DO NOTHING", (project_id, nonce, node_id, used_at))

    # -- over-ceiling execution output (the platform contract) --------------------------------------------------

    def add_upload(self, token: str, node_id: str, execution_id: str, declared: int) -> None:
        self.db.execute("INSERT INTO uploads(token, node_id, execution_id, declared) VALUES(?, ?, ?, ?)",
                        (token, node_id, execution_id, declared))

    def upload(self, token: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT node_id, execution_id, declared, sha256, data FROM uploads WHERE token=?",
                              (token,)).fetchone()
        if row is None:
            return None
        return {"token": token, "node_id": row[0], "execution_id": row[1], "declared": row[2], "sha256": row[3],
                "data": row[4]}

    def finish_upload(self, token: str, sha256: str, data: bytes) -> bool:
        """Store the uploaded bytes once; False when they were already there."""
        cur = self.db.execute("UPDATE uploads SET sha256=?, data=? WHERE token=? AND data IS NULL",
                              (sha256, data, token))
        return cur.rowcount == 1

    # -- executions ---------------------------------------------------------------------------------------------

    def execution(self, node_id: str, execution_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT doc FROM executions WHERE node_id=? AND execution_id=?",
                              (node_id, execution_id)).fetchone()
        return None if row is None else json.loads(row[0])

    def save_execution(self, node_id: str, execution_id: str, doc: dict[str, Any]) -> None:
        self.db.execute("INSERT INTO executions(node_id, execution_id, doc) VALUES(?, ?, ?) "
                        "ON CONFLICT(node_id, execution_id) DO UPDATE SET doc=excluded.doc",
                        (node_id, execution_id, json.dumps(doc, separators=(",", ":"))))

    def prune_executions(self, node_id: str, keep: int) -> None:
        self.db.execute("DELETE FROM executions WHERE node_id=? AND rowid NOT IN (SELECT rowid FROM executions "
                        "WHERE node_id=? ORDER BY rowid DESC LIMIT ?)", (node_id, node_id, keep))

    def executions(self, node_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT doc FROM executions WHERE node_id=? ORDER BY rowid", (node_id,))
        return [json.loads(r[0]) for r in rows]


class _Tx:
    """`with store.transaction():` groups statements into one atomic commit (nests by flattening)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.outer = False

    def __enter__(self) -> _Tx:
        if not self.db.in_transaction:
            self.db.execute("BEGIN IMMEDIATE")
            self.outer = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.outer:
            return
        if exc_type is None:
            self.db.execute("COMMIT")
        else:
            self.db.execute("ROLLBACK")
