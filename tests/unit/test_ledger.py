"""The event ledger (data_dir/events.db, SQLite WAL): cursor and nonces noted per event, committed in groups,
refused after a restart once committed, and nothing lost to a torn file or a failed write."""

from __future__ import annotations

import base64
import json
import os
import sqlite3
from datetime import UTC, datetime

import nacl.signing
import pytest

from plexd.base.clock import FakeClock
from plexd.controlplane.envelope import parse_envelope, sign_event
from plexd.controlplane.event_signing import EventRejected, NonceStore, Verifier
from plexd.controlplane.ledger import EventLedger
from plexd.state.model import SigningKeys

NOW = datetime(2025, 1, 15, 10, 30, tzinfo=UTC)
KEY = nacl.signing.SigningKey.generate()
KEYS = SigningKeys(current=base64.b64encode(bytes(KEY.verify_key)).decode())


@pytest.fixture
def clock():
    return FakeClock(NOW)


def event(nonce: str, issued_at: str = "2025-01-15T10:30:00Z"):
    return parse_envelope(sign_event(KEY, "peer_added", f"evt_{nonce}", {"id": "n_a"}, issued_at=issued_at,
                                     nonce=nonce))


def accept(ledger: EventLedger, verifier: Verifier, env) -> None:
    """What the event stream does: verify (the nonce store remembers), then note cursor and nonce together."""
    verifier.verify(env)
    ledger.note(env.event_id, env.nonce, NOW.timestamp())


def test_committed_nonces_are_refused_after_a_restart_and_the_cursor_resumes(tmp_path, clock):
    ledger = EventLedger(tmp_path / "events.db")
    accept(ledger, Verifier(KEYS, NonceStore(clock, ledger), clock), event("once"))
    ledger.close(NOW.timestamp())
    assert oct((tmp_path / "events.db").stat().st_mode & 0o777) == "0o600"

    again = EventLedger(tmp_path / "events.db")  # "after a restart"
    assert again.cursor == "evt_once"
    with pytest.raises(EventRejected) as info:
        Verifier(KEYS, NonceStore(clock, again), clock).verify(event("once"))
    assert info.value.reason == "duplicate_nonce"


def test_notes_are_one_group_and_nothing_is_on_disk_before_the_commit(tmp_path, clock):
    ledger = EventLedger(tmp_path / "events.db")
    pokes = []
    ledger.on_pending = lambda: pokes.append(1)
    verifier = Verifier(KEYS, NonceStore(clock, ledger), clock)
    for i in range(50):
        accept(ledger, verifier, event(f"n{i}"))
    assert pokes == [1]  # the first note asks for a commit; the rest join it
    assert EventLedger(tmp_path / "events.db").stored() == (None, set())  # a crash now: nothing acknowledged
    ledger.commit(NOW.timestamp())
    assert ledger.commits == 1
    assert EventLedger(tmp_path / "events.db").stored() == ("evt_n49", {f"n{i}" for i in range(50)})


def test_expired_nonces_leave_the_table_and_unexpired_ones_never_do(tmp_path):
    """Past max_nonces nothing is evicted: forgetting an unexpired nonce would reopen a replay (the nonce store
    refuses events instead, tests/security/test_nonce_store.py)."""
    ledger = EventLedger(tmp_path / "events.db", max_nonces=3)
    t = NOW.timestamp()
    ledger.note("e1", "old", t - 301)
    for i in range(5):
        ledger.note(f"e{i + 2}", f"n{i}", t + i)
    ledger.commit(t)
    assert ledger.stored()[1] == {"n0", "n1", "n2", "n3", "n4"}


def test_a_failed_write_keeps_the_notes_for_the_next_commit(tmp_path):
    ledger = EventLedger(tmp_path / "events.db")
    ledger.note("e1", "a", NOW.timestamp())
    batch = ledger.take()
    ledger.note("e2", "b", NOW.timestamp())
    ledger._db.close()  # the disk went away under it
    assert ledger.write(batch, NOW.timestamp()) is False
    ledger.give_back(batch)
    ledger._db = sqlite3.connect(tmp_path / "events.db", isolation_level=None, check_same_thread=False)
    ledger.commit(NOW.timestamp())
    assert ledger.stored() == ("e2", {"a", "b"})  # the newer cursor wins; both nonces kept


def test_a_torn_database_is_moved_aside_and_the_daemon_starts_empty(tmp_path, clock):
    (tmp_path / "events.db").write_bytes(b"SQLite format 3\x00" + os.urandom(3000))
    ledger = EventLedger(tmp_path / "events.db")
    assert (tmp_path / "events.db.corrupt").exists()
    assert ledger.cursor is None
    accept(ledger, Verifier(KEYS, NonceStore(clock, ledger), clock), event("x"))
    ledger.commit(NOW.timestamp())
    assert ledger.stored() == ("evt_x", {"x"})


def test_the_files_of_earlier_versions_are_imported_once_and_removed(tmp_path, clock):
    (tmp_path / "last_event_id").write_text("evt_41")
    (tmp_path / "nonces.json").write_text(json.dumps({"old": "2025-01-15T10:00:00Z",
                                                      "fresh": "2025-01-15T10:29:00Z"}))
    ledger = EventLedger(tmp_path / "events.db")
    assert ledger.cursor == "evt_41"
    store = NonceStore(clock, ledger)
    assert "fresh" in store and "old" not in store  # expired on load: the window check refuses it anyway
    assert not (tmp_path / "nonces.json").exists() and not (tmp_path / "last_event_id").exists()


def test_a_torn_legacy_nonce_file_is_ignored(tmp_path, clock):
    (tmp_path / "nonces.json").write_text("{torn")
    ledger = EventLedger(tmp_path / "events.db")
    assert len(NonceStore(clock, ledger)) == 0 and ledger.cursor is None


# --- the desired-state mirror, in the same database ------------------------------------------------------------


def _model(peers):
    from plexd.state.desired import DesiredState

    d = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420,
                             private_key=base64.b64encode(bytes([7]) * 32).decode(), mesh_ip="10.100.0.1")
    return d.with_peers(peers)


def _peer(i):
    from plexd.state.model import Peer

    key = base64.b64encode(bytes(nacl.signing.SigningKey(bytes([i + 1]) * 32).verify_key)).decode()
    return Peer(id=f"n_{i}", public_key=key, mesh_ip=f"10.100.0.{i + 10}")


def test_the_mirror_is_written_by_changed_rows_and_read_back_whole(tmp_path):
    from plexd.node.durable import mirror_change

    ledger = EventLedger(tmp_path / "events.db")
    first = _model([_peer(i) for i in range(5)])
    full = mirror_change(None, first)
    assert full.full and len(full.upserts) == 5
    ledger.write(None, NOW.timestamp(), full)
    second = first.without_peer("n_1").with_peer(_peer(7))
    change = mirror_change(first, second)
    assert not change.full and change.deletes == ["n_1"] and [pid for pid, _ in change.upserts] == ["n_7"]
    assert mirror_change(first, second, {"n_1", "n_7", "n_3"}) == change  # named ids (a superset): no scan
    ledger.note("evt_9", "z", NOW.timestamp())
    ledger.write(ledger.take(), NOW.timestamp(), change)  # one transaction: rows, cursor and nonce
    ledger.close(NOW.timestamp())

    from plexd.controlplane.ledger import read_mirror
    from plexd.state.desired import DesiredState

    restored = DesiredState.from_json(read_mirror(tmp_path), private_key=second.private_key)
    assert set(restored.peers) == set(second.peers) == {"n_0", "n_2", "n_3", "n_4", "n_7"}
    assert EventLedger(tmp_path / "events.db").stored() == ("evt_9", {"z"})


def test_the_mirror_file_of_an_earlier_version_is_imported(tmp_path):
    (tmp_path / "state").mkdir()
    doc = _model([_peer(1), _peer(2)]).to_json()
    (tmp_path / "state" / "desired.json").write_text(json.dumps(doc))
    ledger = EventLedger(tmp_path / "events.db")
    assert {p["id"] for p in ledger.mirror()["state"]["peers"]} == {"n_1", "n_2"}
    assert ledger.mirror()["mesh_ip"] == "10.100.0.1"
    assert not (tmp_path / "state" / "desired.json").exists()


def test_no_database_no_mirror(tmp_path):
    from plexd.controlplane.ledger import read_mirror

    assert read_mirror(tmp_path) is None


def test_notes_stay_bounded_while_commits_keep_failing(tmp_path):
    """Commits failing for long (disk full): expired notes go, unexpired ones stay (none can be forgotten)."""
    ledger = EventLedger(tmp_path / "events.db", max_nonces=3)
    t = NOW.timestamp()
    for i in range(5):
        ledger.note(f"e{i}", f"old{i}", t - 1000 + i)  # long expired by the time of the newer ones
    for i in range(5):
        ledger.note(f"e{i + 5}", f"n{i}", t + i)
    batch = ledger.take()
    assert batch.cursor == "e9" and [n for n, _ in batch.nonces] == [f"n{i}" for i in range(5)]
