"""Identity files (§5.4): formats, modes, atomic writes, corrupt identities, key generation (§5.2), token rules."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import subprocess

import pytest

from plexd.base.log import fingerprint
from plexd.base.wgkeys import generate_private_key, public_key_of
from plexd.config.settings import load as load_config
from plexd.identity.identity_store import DataDirError, Identity, IdentityStore, write_atomic
from plexd.identity.registrar import TokenError, refusal_message, resolve_token, validate_token

SIGNING = base64.b64encode(b"\x01" * 32).decode()


def ident(**over) -> Identity:
    base = dict(node_id="n_abc", mesh_ip="10.100.0.7", signing_public_key=SIGNING, node_secret_key="S" * 32,
                private_key=generate_private_key())
    base.update(over)
    return Identity(**base)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_private_key_is_clamped_and_matches_wg_pubkey():
    for _ in range(20):
        key = generate_private_key()
        assert key[0] & 7 == 0 and key[31] & 0x80 == 0 and key[31] & 0x40
    key = generate_private_key()
    wg = subprocess.run(["wg", "pubkey"], input=base64.b64encode(key) + b"\n", capture_output=True, check=True)
    assert wg.stdout.decode().strip() == base64.b64encode(public_key_of(key)).decode()


def test_save_writes_go_formats_and_modes(tmp_path):
    d = tmp_path / "data"
    i = ident()
    IdentityStore(d).save(i)
    assert mode(d) == 0o700
    for name in ("identity.json", "private_key", "node_secret_key", "signing_public_key"):
        assert mode(d / name) == 0o600, name
    assert (d / "identity.json").read_text() == (
        '{\n  "node_id": "n_abc",\n  "mesh_ip": "10.100.0.7",\n  "signing_public_key": "' + SIGNING + '"\n}')
    assert (d / "private_key").read_bytes() == base64.b64encode(i.private_key)
    assert (d / "node_secret_key").read_text() == "S" * 32
    assert (d / "signing_public_key").read_text() == SIGNING
    assert sorted(p.name for p in d.iterdir()) == ["identity.json", "node_secret_key", "private_key",
                                                   "signing_public_key"]  # no temp files left


def test_round_trip_and_whitespace_trimmed(tmp_path):
    store = IdentityStore(tmp_path)
    i = ident()
    store.save(i)
    (tmp_path / "node_secret_key").write_text("S" * 32 + "\n")
    loaded = store.load()
    assert loaded.problem == "" and loaded.identity == i


def test_never_registered_is_not_a_problem(tmp_path):
    loaded = IdentityStore(tmp_path / "empty").load()
    assert loaded.identity is None and loaded.problem == ""


@pytest.mark.parametrize("damage,problem", [
    (lambda d: (d / "identity.json").write_text('{"node_id": "n_abc", "mesh_'), "identity.json: not valid JSON"),
    (lambda d: (d / "identity.json").write_text("[]"), "not a JSON object"),
    (lambda d: (d / "identity.json").write_text('{"node_id": "", "mesh_ip": "x"}'), "node_id is missing or empty"),
    (lambda d: (d / "identity.json").write_text('{"node_id": "n", "mesh_ip": "10.1.0.5/16"}'),
     "mesh_ip '10.1.0.5/16' is not an IP address"),
    (lambda d: (d / "identity.json").write_text('{"node_id": "n", "mesh_ip": 5}'), "mesh_ip is missing or empty"),
    (lambda d: (d / "private_key").unlink(), "private_key is missing"),
    (lambda d: (d / "private_key").write_text("!!!"), "private_key is not valid base64"),
    (lambda d: (d / "private_key").write_text("AAAA"), "private_key decodes to 3 bytes"),
    (lambda d: (d / "node_secret_key").write_text("  \n"), "node_secret_key is empty"),
    (lambda d: (d / "signing_public_key").write_text("c2hvcnQ="), "signing_public_key decodes to 5 bytes"),
    (lambda d: (d / "identity.json").write_bytes(b"\xff\xfe"), "identity.json: cannot read"),
])
def test_corrupt_identity_is_treated_as_absent_with_a_reason(tmp_path, damage, problem):
    store = IdentityStore(tmp_path)
    store.save(ident())
    damage(tmp_path)
    loaded = store.load()
    assert loaded.identity is None and problem in loaded.problem


def test_signing_key_file_wins_over_json(tmp_path, caplog):
    store = IdentityStore(tmp_path)
    store.save(ident())
    newer = base64.b64encode(b"\x02" * 32).decode()
    store.write_signing_key(newer)
    assert store.load().identity.signing_public_key == newer
    assert "differs from identity.json" in caplog.text


def test_leftover_temp_files_are_ignored_by_readers_and_removed_by_the_next_save(tmp_path):
    store = IdentityStore(tmp_path)
    store.save(ident())
    (tmp_path / ".tmp-private_key").write_text("half")
    assert store.load().identity is not None
    assert (tmp_path / ".tmp-private_key").exists()  # a reader never touches a writer's files
    store.save(ident())
    assert not (tmp_path / ".tmp-private_key").exists()


def test_a_load_in_the_middle_of_a_save_never_breaks_it(tmp_path, monkeypatch):
    """Another process reading the identity (plexd status, a test) while the daemon saves a new one: the save
    used to fail with ENOENT when the reader removed the temp file it was about to rename."""
    import plexd.identity.identity_store as identity_module

    store, reader = IdentityStore(tmp_path), IdentityStore(tmp_path)
    real = identity_module.write_atomic

    def write_with_a_reader_in_between(path, data, mode=0o600):
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_bytes(data)  # the writer's temp file exists ...
        reader.load()  # ... when a reader comes by
        assert tmp.exists()
        real(path, data, mode)

    monkeypatch.setattr(identity_module, "write_atomic", write_with_a_reader_in_between)
    store.save(ident())
    assert reader.load().identity is not None


def test_failed_save_leaves_nothing_behind(tmp_path):
    # identity.json's temp name is taken by a directory, so the last write fails after three succeeded.
    (tmp_path / ".tmp-identity.json").mkdir()
    store = IdentityStore(tmp_path)
    with pytest.raises(DataDirError, match=r"cannot save the identity in .*: Is a directory.*nothing was kept"):
        store.save(ident())
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-identity.json"]
    assert store.load().identity is None


def test_a_failed_resave_of_the_same_key_keeps_the_identity(tmp_path):
    # A re-registration rewrites the files in place; a write failing half-way used to "roll back" by deleting
    # what it had written: the node's own private key and node secret, an orphaned node.
    import dataclasses

    store = IdentityStore(tmp_path)
    first = ident()
    store.save(first)
    (tmp_path / ".tmp-identity.json").mkdir()  # the last write fails
    with pytest.raises(DataDirError, match=r"cannot save the identity .*the identity on disk is kept"):
        store.save(dataclasses.replace(first, node_secret_key="rotated-secret"))
    loaded = store.load().identity
    assert loaded is not None and loaded.private_key == first.private_key
    assert loaded.node_secret_key in ("rotated-secret", first.node_secret_key)


def test_a_data_dir_that_holds_another_programs_files_is_refused_not_adopted(tmp_path):
    # data_dir: /var/lib by mistake: it was tightened to 0700, and `deregister --purge` then removed it whole.
    shared = tmp_path / "lib"
    (shared / "dpkg").mkdir(parents=True)
    (shared / "apt").mkdir()
    shared.chmod(0o755)
    with pytest.raises(DataDirError, match=r"already holds files that are not plexd's \(apt, dpkg\)"):
        IdentityStore(shared).ensure_writable()
    assert mode(shared) == 0o755
    # plexd's own (an identity being replaced, a damaged one) and an empty directory are fine
    IdentityStore(tmp_path / "empty").ensure_writable()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "events.db").write_text("")
    (mine / "notes.txt").write_text("")
    IdentityStore(mine).ensure_writable()


def test_data_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataDirError) as info:
        IdentityStore(blocker / "data").ensure_writable()
    text = str(info.value)
    assert f"data_dir {blocker / 'data'} is not writable" in text and "errno 20" in text and "--data-dir" in text


def test_existing_data_dir_mode_is_tightened(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o755)
    IdentityStore(d).ensure_writable()
    assert mode(d) == 0o700


def test_write_atomic_replaces_with_mode(tmp_path):
    p = tmp_path / "f"
    p.write_text("old")
    os.chmod(p, 0o644)
    write_atomic(p, b"new")
    assert p.read_bytes() == b"new" and mode(p) == 0o600


def test_identity_repr_hides_secrets():
    i = ident()
    assert "SSSS" not in repr(i) and base64.b64encode(i.private_key).decode() not in repr(i)


# -- bootstrap token rules (§5.1) -----------------------------------------------------------------------------------


def cfg(tmp_path, **token):
    env = {"PLEXD_CONFIG": "", "PLEXD_TOKEN_FILE": str(tmp_path / "token")}
    env.update({f"PLEXD_TOKEN_{k.upper()}": v for k, v in token.items()})
    return load_config(env=env)


async def test_token_sources_in_order(tmp_path):
    (tmp_path / "token").write_text("  from-file\n")
    env = {"PLEXD_BOOTSTRAP_TOKEN": "from-env"}
    t = await resolve_token(cfg(tmp_path, value="from-config"), env)
    assert (t.value, t.source) == ("from-config", "config")
    t = await resolve_token(cfg(tmp_path), env)
    assert (t.value, t.source, t.where) == ("from-file", "file", str(tmp_path / "token"))
    (tmp_path / "token").unlink()
    t = await resolve_token(cfg(tmp_path), env)
    assert (t.value, t.source, t.where) == ("from-env", "env", "PLEXD_BOOTSTRAP_TOKEN")
    t = await resolve_token(cfg(tmp_path, env="MY_TOKEN"), {"MY_TOKEN": "mine"})
    assert t.value == "mine"
    assert await resolve_token(cfg(tmp_path), {}) is None


async def test_join_overrides_replace_configured_file_and_env(tmp_path):
    (tmp_path / "token").write_text("configured")
    other = tmp_path / "other"
    other.write_text("given")
    t = await resolve_token(cfg(tmp_path), {}, token_file=str(other))
    assert (t.value, t.where) == ("given", str(other))
    with pytest.raises(TokenError, match="does not exist"):
        await resolve_token(cfg(tmp_path), {}, token_file=str(tmp_path / "missing"))
    with pytest.raises(TokenError, match="environment variable NOPE is not set"):
        await resolve_token(load_config(env={"PLEXD_CONFIG": "", "PLEXD_TOKEN_FILE": ""}), {}, token_env="NOPE")


async def test_unreadable_token_file_names_path_and_errno(tmp_path):
    (tmp_path / "token").mkdir()
    with pytest.raises(TokenError) as info:
        await resolve_token(cfg(tmp_path), {"PLEXD_BOOTSTRAP_TOKEN": "would-win-next"})
    assert str(info.value) == f"cannot read bootstrap token file {tmp_path / 'token'}: Is a directory (errno 21)"


@pytest.mark.parametrize("value,match", [
    ("x" * 513, "is 513 bytes long; the limit is 512"),
    ("tok\x07en", r"non-printable or non-ASCII byte \(0x07 at offset 3\)"),
    ("tökén", r"non-ASCII byte \(0xc3 at offset 1\)"),
])
def test_token_validation(value, match):
    with pytest.raises(TokenError, match=match):
        validate_token(value, "test")


def test_token_of_exactly_512_printable_bytes_is_fine():
    assert validate_token(" " + "~" * 512 + "\n", "t") == "~" * 512


async def test_invalid_winning_source_does_not_fall_through(tmp_path):
    (tmp_path / "token").write_bytes(b"bad\x00token")
    with pytest.raises(TokenError, match="file"):
        await resolve_token(cfg(tmp_path), {"PLEXD_BOOTSTRAP_TOKEN": "good"})


def test_refusal_messages_tell_the_operator_what_to_do():
    kw = dict(api="http://cp", hostname="web-01")
    assert "already used" in refusal_message(401, "", **kw) and "create a new token" in refusal_message(401, "", **kw)
    assert "malformed" in refusal_message(400, "bad key", **kw) and "bad key" in refusal_message(400, "bad key", **kw)
    assert "forbidden" in refusal_message(403, "", **kw)
    assert "http://cp/v1/register does not exist" in refusal_message(404, "", **kw)
    assert "'web-01' is already registered" in refusal_message(409, "", **kw)


def test_fingerprint_is_short_and_stable():
    assert fingerprint("abc") == fingerprint(b"abc") and fingerprint("abc") != fingerprint("abd")
    assert len(fingerprint("abc")) == 11 and "abc" not in fingerprint("abc")[3:]
    assert json.dumps(fingerprint("")) == '"fp:empty"'


def test_resave_with_the_same_key_keeps_identity_json_in_place(tmp_path, monkeypatch):
    """Re-registration keeps the key: identity.json is never retracted, so a crash mid-save cannot unregister."""
    store = IdentityStore(tmp_path)
    first = ident()
    store.save(first)
    seen: list[bool] = []
    import plexd.identity.identity_store as mod

    real = mod.write_atomic

    def spy(path, data, mode=0o600):
        seen.append((tmp_path / "identity.json").exists())
        real(path, data, mode)

    monkeypatch.setattr(mod, "write_atomic", spy)
    store.save(Identity(first.node_id, first.mesh_ip, SIGNING, "N" * 32, first.private_key))
    assert all(seen) and store.load().identity.node_secret_key == "N" * 32
    seen.clear()
    store.save(ident())  # a new key: the marker is retracted before anything is written
    assert seen == [False, False, False, False]


def test_a_rotation_key_is_kept_apart_until_committed_by_a_rename(tmp_path, caplog):
    store = IdentityStore(tmp_path)
    store.save(ident())
    old = store.load().identity.private_key
    assert store.next_private_key() is None
    new = generate_private_key()
    store.write_next_private_key(new)
    assert mode(tmp_path / "private_key.next") == 0o600
    assert store.next_private_key() == new and store.load().identity.private_key == old  # not the node's yet
    store.commit_next_private_key()
    assert store.load().identity.private_key == new and store.next_private_key() is None
    # a torn write (a crash before the rename) is never used and is dropped by the next write; an unusable file
    # is dropped
    (tmp_path / ".tmp-private_key.next").write_text("half")
    assert store.next_private_key() is None
    store.write_next_private_key(new)
    store.drop_next_private_key()
    assert not (tmp_path / ".tmp-private_key.next").exists()
    (tmp_path / "private_key.next").write_text("not a key")
    assert store.next_private_key() is None and not (tmp_path / "private_key.next").exists()
    assert "private_key.next is not valid base64; removing it" in caplog.text


def test_a_registration_in_flight_keeps_its_key_for_that_token_alone_until_the_answer_is_saved(tmp_path):
    # plexd killed between the control plane's answer and the save asks again with the same token and key
    # (tests/e2e/test_failpoints_lab.py kills it there); another token gets a fresh key.
    store = IdentityStore(tmp_path / "data")
    store.ensure_writable()
    key = generate_private_key()
    store.write_registering_key(key, "tok-1")
    pending = tmp_path / "data" / "private_key.registering"
    assert mode(pending) == 0o600 and "tok-1" not in pending.read_text()  # the token's hash, never the token
    assert store.registering_key("tok-1") == key and store.registering_key("tok-2") is None
    store.save(ident(private_key=key))
    assert not pending.exists() and store.registering_key("tok-1") is None


def test_a_registering_key_older_than_its_ttl_is_dropped(tmp_path):
    import time

    from plexd.identity.identity_store import REGISTERING_KEY_TTL

    store = IdentityStore(tmp_path)
    store.write_registering_key(generate_private_key(), "tok")
    assert store.registering_key("tok", now=time.time() + REGISTERING_KEY_TTL / 2) is not None
    assert store.registering_key("tok", now=time.time() + REGISTERING_KEY_TTL + 60) is None
    assert not (tmp_path / "private_key.registering").exists()


@pytest.mark.parametrize("damage", ["not json", "[]", '{"private_key": "short", "token_sha256": "%s"}'])
def test_a_damaged_registering_key_is_dropped_not_used(tmp_path, damage):
    store = IdentityStore(tmp_path)
    (tmp_path / "private_key.registering").write_text(damage.replace("%s", hashlib.sha256(b"tok").hexdigest()))
    assert store.registering_key("tok") is None and not (tmp_path / "private_key.registering").exists()
