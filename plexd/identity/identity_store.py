"""The node's identity in ``data_dir`` (docs/protocol.md §5.2, §5.4), with the Go agent's file names and formats.

    identity.json        0600  {"node_id","mesh_ip","signing_public_key"}, 2-space indent, no trailing newline; a
                               node of the platform contract adds "dialect", "signing_key_id", "domain_mesh_cidr"
    private_key          0600  std base64 of the 32-byte clamped X25519 private key, no newline
    private_key.next     0600  the same, for a key rotation not yet taken by the control plane (renamed over
                               private_key when it is: plexd.node.key_rotation)
    private_key.registering  0600  {"private_key","token_sha256","written_at"}: a fresh registration's key, from
                               before its token is spent until the answer is saved (plexd adds; an hour at most)
    node_secret_key      0600  the raw node secret string from the register response
    node_secret_kdf      0600  "hkdf-sha256" when the control plane took the derivation (plexd.identity.node_secret);
                               absent: compatibility mode (the node secret is bearer and AES key, as in Go)
    signing_public_key   0600  the control plane's Ed25519 public key, std base64 (wins over the JSON field)

``data_dir`` is created 0700. Every file is written as ``.tmp-<name>`` with its final mode, fsynced, renamed over
the target, and the directory fsynced. ``identity.json`` is written last: it is the commit marker, so a crash
mid-save leaves "not registered" rather than a mix of old and new files. A save that fails removes what it
wrote. Loading trims whitespace; an identity that cannot be used is reported as `IdentityLoad.problem` and
treated as absent (the caller says so and registers afresh).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from plexd.base import boundedjson
from plexd.base.atomicfile import rename_atomic, write_atomic
from plexd.base.errors import PlexdError, WireFormatError
from plexd.base.hostname import is_ip
from plexd.base.wgkeys import b64, decode_key, public_key_of
from plexd.config import datadir
from plexd.identity import node_secret

IDENTITY_FILE = datadir.IDENTITY
PRIVATE_KEY_FILE = datadir.PRIVATE_KEY
NEXT_PRIVATE_KEY_FILE = datadir.NEXT_PRIVATE_KEY
REGISTERING_KEY_FILE = datadir.REGISTERING_KEY
REGISTERING_KEY_TTL = 3600.0  # seconds a registration's key is kept for the same token after plexd died
NODE_SECRET_FILE = datadir.NODE_SECRET
NODE_SECRET_KDF_FILE = datadir.NODE_SECRET_KDF
SIGNING_KEY_FILE = datadir.SIGNING_KEY
IDENTITY_FILES = (PRIVATE_KEY_FILE, NODE_SECRET_FILE, SIGNING_KEY_FILE, IDENTITY_FILE)  # write order


class DataDirError(PlexdError):
    """data_dir cannot be created or written; `errno` is the file system's answer when it gave one."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True)
class Identity:
    node_id: str
    mesh_ip: str
    signing_public_key: str
    node_secret_key: str
    private_key: bytes
    node_secret_kdf: str = ""  # plexd.identity.node_secret: "" (compatibility mode) or "hkdf-sha256"
    # The contract the node registered with (plexd.controlplane.dialect): "spec" or "platform". The platform's
    # registration also names the signing key and the mesh's whole range.
    dialect: str = "spec"
    signing_key_id: str = ""
    domain_mesh_cidr: str = ""

    @property
    def bearer(self) -> str:
        """The Authorization bearer for the control plane: the node secret, derived from it, or (platform) the
        envelope of the node id and the NSK."""
        if self.dialect == "platform":
            from plexd.controlplane.platform_envelope import bearer

            return bearer(self.node_id, self.node_secret_key)
        return node_secret.bearer(self.node_secret_key, self.node_secret_kdf)

    @property
    def public_key(self) -> str:
        """The WireGuard public key, std base64 (44 chars)."""
        return b64(public_key_of(self.private_key))

    @property
    def private_key_b64(self) -> str:
        return b64(self.private_key)

    def __repr__(self) -> str:  # never print the private key or the node secret
        return f"Identity(node_id={self.node_id!r}, mesh_ip={self.mesh_ip!r})"


@dataclass(frozen=True)
class IdentityLoad:
    """What `IdentityStore.load` found: an identity, or None with `problem` saying why ('' = never registered)."""

    identity: Identity | None
    problem: str = ""


class IdentityStore:
    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)

    def path(self, name: str) -> Path:
        return self.data_dir / name

    # -- directory ---------------------------------------------------------------------------------------------

    def ensure_writable(self) -> None:
        """Create data_dir 0700 if needed and prove we can write into it, before anything irreversible (a token
        is single-use: registering and then failing to save would burn it)."""
        d = self.data_dir
        foreign = _foreign_entries(d)
        if foreign:
            # /var/lib by mistake: plexd would tighten it to 0700 and `deregister --purge` would remove it whole
            raise DataDirError(
                f"data_dir {d} already holds files that are not plexd's ({', '.join(foreign)}) and no plexd "
                "identity: give plexd a directory of its own (the default is /var/lib/plexd; --data-dir, "
                "PLEXD_DATA_DIR)")
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if d.stat().st_uid == os.geteuid():
                os.chmod(d, 0o700)  # it holds private keys
            probe = d / ".tmp-write-probe"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"x")
                os.fsync(fd)
            finally:
                os.close(fd)
            probe.unlink()
        except OSError as exc:
            raise DataDirError(
                f"data_dir {d} is not writable: {exc.strerror or exc} (errno {exc.errno}); "
                "fix its permissions or point data_dir (--data-dir, PLEXD_DATA_DIR) at a writable directory",
                exc.errno) from None

    # -- load ----------------------------------------------------------------------------------------------------

    def load(self) -> IdentityLoad:
        # Temp files are the writer's to clean (`save`): a reader that removed them (plexd status, a test polling
        # the identity) could delete the one a running save is about to rename, and the save fails with ENOENT.
        try:
            text = self.path(IDENTITY_FILE).read_text(encoding="utf-8")
        except FileNotFoundError:
            return IdentityLoad(None)
        except (OSError, UnicodeDecodeError) as exc:
            return IdentityLoad(None, f"{IDENTITY_FILE}: cannot read: {getattr(exc, 'strerror', None) or exc}")
        try:
            doc = json.loads(text)
        except ValueError as exc:
            return IdentityLoad(None, f"{IDENTITY_FILE}: not valid JSON ({exc})")
        if not isinstance(doc, dict):
            return IdentityLoad(None, f"{IDENTITY_FILE}: not a JSON object")
        node_id, mesh_ip = doc.get("node_id"), doc.get("mesh_ip")
        if not isinstance(node_id, str) or not node_id.strip():
            return IdentityLoad(None, f"{IDENTITY_FILE}: node_id is missing or empty")
        if not isinstance(mesh_ip, str) or not mesh_ip.strip():
            return IdentityLoad(None, f"{IDENTITY_FILE}: mesh_ip is missing or empty")
        if not is_ip(mesh_ip.strip()):
            return IdentityLoad(None, f"{IDENTITY_FILE}: mesh_ip {mesh_ip.strip()[:60]!r} is not an IP address")
        try:
            private_key = decode_key(self._read(PRIVATE_KEY_FILE), PRIVATE_KEY_FILE)
            secret = self._read(NODE_SECRET_FILE)
            if not secret:
                return IdentityLoad(None, f"{NODE_SECRET_FILE} is empty")
            signing = self._signing_key(doc)
            decode_key(signing, SIGNING_KEY_FILE)
            kdf = self._kdf()
        except (OSError, ValueError) as exc:
            return IdentityLoad(None, str(exc))
        extra = {}
        for name in ("dialect", "signing_key_id", "domain_mesh_cidr"):
            value = doc.get(name, "")
            if not isinstance(value, str):
                return IdentityLoad(None, f"{IDENTITY_FILE}: {name} must be a string")
            extra[name] = value.strip()
        extra["dialect"] = extra["dialect"] or "spec"  # written before there were two, or by the Go agent
        if extra["dialect"] not in ("spec", "platform"):
            return IdentityLoad(None, f"{IDENTITY_FILE}: dialect {extra['dialect'][:40]!r} is not spec or platform")
        identity = Identity(node_id.strip(), mesh_ip.strip(), signing, secret, private_key, kdf, **extra)
        try:
            identity.bearer  # noqa: B018 (the platform's is built from the node id and the NSK: both must be usable)
        except ValueError as exc:
            return IdentityLoad(None, f"{IDENTITY_FILE}: {exc}")
        return IdentityLoad(identity)

    def _kdf(self) -> str:
        try:
            text = self._read(NODE_SECRET_KDF_FILE)
        except ValueError:
            if self.path(NODE_SECRET_KDF_FILE).exists():
                raise
            return node_secret.COMPATIBLE  # registered before the derivation, or by a Go agent
        return node_secret.check(text, NODE_SECRET_KDF_FILE)

    def _read(self, name: str) -> str:
        try:
            return self.path(name).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise ValueError(f"{name} is missing") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{name}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None

    def _signing_key(self, doc: dict[str, object]) -> str:
        field = doc.get("signing_public_key")
        field = field.strip() if isinstance(field, str) else ""
        try:
            on_disk = self._read(SIGNING_KEY_FILE)
        except ValueError:
            if field:
                return field
            raise
        if field and on_disk != field:
            # The file is updated on key rotation; the JSON copy may lag behind. The file wins (§5.4).
            import logging  # lazily: `plexd status` loads identities and should start fast

            logging.getLogger(__name__).warning("signing_public_key file differs from identity.json; using the file",
                        extra={"component": "identity"})
        return on_disk

    # -- save ----------------------------------------------------------------------------------------------------

    def save(self, identity: Identity) -> None:
        """Write all four files atomically (identity.json last). On failure, remove what this call wrote."""
        self.ensure_writable()
        self._remove_temp_files()  # a save interrupted by a crash left them; readers never look at them
        doc = {"node_id": identity.node_id, "mesh_ip": identity.mesh_ip,
               "signing_public_key": identity.signing_public_key}
        if identity.dialect != "spec":  # the Go agent's file for a spec node, as before
            doc.update(dialect=identity.dialect, signing_key_id=identity.signing_key_id,
                       domain_mesh_cidr=identity.domain_mesh_cidr)
        contents = {
            PRIVATE_KEY_FILE: identity.private_key_b64,
            NODE_SECRET_FILE: identity.node_secret_key,
            SIGNING_KEY_FILE: identity.signing_public_key,
            IDENTITY_FILE: json.dumps(doc, indent=2, ensure_ascii=False),
        }
        written: list[str] = []
        # A new key: retract the commit marker first, so that dying mid-save cannot pair the old identity.json
        # with the new key. The same key (re-registration): any mix of old and new files is still valid.
        new_key = self._stored_private_key() != contents[PRIVATE_KEY_FILE]
        try:
            if new_key:
                with contextlib.suppress(FileNotFoundError):
                    self.path(IDENTITY_FILE).unlink()
            for name in IDENTITY_FILES:
                if name == IDENTITY_FILE:  # before the commit marker: a key the bearer depends on
                    self._save_kdf(identity.node_secret_kdf)
                write_atomic(self.path(name), contents[name].encode())
                written.append(name)
        except OSError as exc:
            self._remove_temp_files()
            why = f"cannot save the identity in {self.data_dir}: {exc.strerror or exc} (errno {exc.errno})"
            if not new_key:
                # Removing what was written would take the node's own key and secret with it (they were
                # rewritten in place): the files as they are still make a valid identity.
                raise DataDirError(f"{why}; the identity on disk is kept") from None
            for name in written:
                with contextlib.suppress(OSError):
                    self.path(name).unlink()
            raise DataDirError(f"{why}; nothing was kept") from None
        with contextlib.suppress(OSError):  # saved: the registration it was kept for is over
            self.drop_registering_key()

    def _save_kdf(self, kdf: str) -> None:
        if kdf:
            write_atomic(self.path(NODE_SECRET_KDF_FILE), kdf.encode())
        else:
            with contextlib.suppress(FileNotFoundError):
                self.path(NODE_SECRET_KDF_FILE).unlink()

    def _stored_private_key(self) -> str:
        try:
            return self.path(PRIVATE_KEY_FILE).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return ""

    def write_signing_key(self, key_b64: str) -> None:
        """Persist a rotated signing key (the file wins over identity.json on load)."""
        decode_key(key_b64, "signing key")
        write_atomic(self.path(SIGNING_KEY_FILE), key_b64.encode())

    # -- a registration in flight (plexd.identity.registrar) ---------------------------------------------------

    def registering_key(self, token: str, now: float | None = None) -> bytes | None:
        """The key a registration with `token` was sent with, when plexd died before saving the answer (the token
        is spent then: only the same token with the same key gets that identity again). None for another token,
        for one older than REGISTERING_KEY_TTL (a control plane repeats an answer for a while only; a machine
        imaged after a failed registration must not hand one key to all its clones), or when there is none; an
        unreadable or expired one is dropped."""
        if not self.path(REGISTERING_KEY_FILE).exists():
            return None
        try:
            doc = boundedjson.loads(self._read(REGISTERING_KEY_FILE), REGISTERING_KEY_FILE)
            age = (time.time() if now is None else now) - float(doc["written_at"])
            if not 0 <= age <= REGISTERING_KEY_TTL:
                raise ValueError(f"{REGISTERING_KEY_FILE} is {age:.0f} s old")
            if not hmac.compare_digest(str(doc["token_sha256"]), _token_hash(token)):
                return None
            return decode_key(str(doc["private_key"]), REGISTERING_KEY_FILE)
        except (ValueError, KeyError, TypeError, WireFormatError):  # damaged or stale: a fresh key is made
            self.drop_registering_key()
            return None

    def write_registering_key(self, private_key: bytes, token: str) -> None:
        """Before a fresh registration is sent: the key, and which token it goes with (a hash, never the token)."""
        doc = {"private_key": b64(private_key), "token_sha256": _token_hash(token), "written_at": time.time()}
        try:
            write_atomic(self.path(REGISTERING_KEY_FILE), json.dumps(doc).encode())
        except OSError as exc:
            raise DataDirError(f"cannot write {self.path(REGISTERING_KEY_FILE)} before registering: "
                               f"{exc.strerror or exc}; the token was not sent") from None

    def drop_registering_key(self) -> None:
        """Forget the registration in flight (saved, refused for good, or stale). A file that cannot be removed
        is said, not raised: a fresh key is made whenever this one does not fit."""
        try:
            self.path(REGISTERING_KEY_FILE).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            import logging

            logging.getLogger(__name__).warning("cannot remove %s: %s", REGISTERING_KEY_FILE, exc.strerror or exc)

    # -- key rotation (plexd.node.key_rotation) ---------------------------------------------------------------

    def next_private_key(self) -> bytes | None:
        """The key a rotation started with and did not finish, or None. An unreadable one is dropped (said so):
        it was never the node's key, and the rotation starts again with a fresh one."""
        try:
            return decode_key(self._read(NEXT_PRIVATE_KEY_FILE), NEXT_PRIVATE_KEY_FILE)
        except ValueError as exc:
            if self.path(NEXT_PRIVATE_KEY_FILE).exists():
                import logging

                logging.getLogger(__name__).warning("%s; removing it", exc)
                self.drop_next_private_key()
            return None

    def write_next_private_key(self, private_key: bytes) -> None:
        self._remove_temp_files()
        write_atomic(self.path(NEXT_PRIVATE_KEY_FILE), b64(private_key).encode())

    def commit_next_private_key(self) -> None:
        """The rename is the commit: private_key is the old key or the new one, never a mix."""
        rename_atomic(self.path(NEXT_PRIVATE_KEY_FILE), self.path(PRIVATE_KEY_FILE))

    def drop_next_private_key(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(NEXT_PRIVATE_KEY_FILE).unlink()

    def remove(self) -> None:
        self.drop_next_private_key()
        self.drop_registering_key()
        with contextlib.suppress(FileNotFoundError):
            self.path(NODE_SECRET_KDF_FILE).unlink()
        for name in IDENTITY_FILES:
            with contextlib.suppress(FileNotFoundError):
                self.path(name).unlink()

    def _remove_temp_files(self) -> None:
        """Leftovers of a save interrupted by a crash are never valid: drop them."""
        with contextlib.suppress(OSError):
            for entry in self.data_dir.iterdir():
                if entry.name.startswith(".tmp-") and entry.name[5:] in (*IDENTITY_FILES, NEXT_PRIVATE_KEY_FILE,
                                                                          REGISTERING_KEY_FILE):
                    entry.unlink()


# What only plexd puts in data_dir: one of them there, and the directory is plexd's (also with a damaged identity,
# which a fresh registration replaces).
_PLEXD_NAMES = frozenset({
    datadir.IDENTITY, datadir.PRIVATE_KEY, datadir.NEXT_PRIVATE_KEY, datadir.REGISTERING_KEY, datadir.NODE_SECRET,
    datadir.NODE_SECRET_KDF, datadir.SIGNING_KEY, datadir.EVENT_LEDGER, datadir.UPLINK_DB, datadir.ACTIONS_DB,
    datadir.TELEMETRY_DB, datadir.DEPARTED, datadir.UPGRADE, datadir.NONCES, datadir.LAST_EVENT_ID, "state",
    "bridge", "actions"})


def _foreign_entries(d: Path, show: int = 3) -> list[str]:
    """A few entries of an existing `d` that is not plexd's: nothing of plexd's in it and something else."""
    try:
        names = []
        with os.scandir(d) as entries:
            for entry in entries:
                if entry.name in _PLEXD_NAMES:
                    return []
                if not entry.name.startswith(".tmp-"):
                    names.append(entry.name)
    except OSError:  # absent (to be created) or unreadable (the write probe says why)
        return []
    return sorted(names)[:show] + (["..."] if len(names) > show else [])


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
