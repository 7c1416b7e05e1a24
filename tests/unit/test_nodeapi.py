"""The node API's parts that need no socket: key rules and file names (hypothesis), secret decryption against
the devplane's own encryption, the cache domain on real files, the report sync queue, and the rate limiter."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from engine_helpers import converge
from hypothesis import given, settings
from hypothesis import strategies as st

from plexd.base.backoff import Backoff
from plexd.base.ratelimit import RateLimiter
from plexd.controlplane.client_errors import ControlPlaneError, TransientError
from plexd.controlplane.uplink import UplinkOutbox
from plexd.nodeapi import cache, crypto
from plexd.nodeapi.keys import MAX_KEY_BYTES, file_name, report_key_problem
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.sync import ReportSync
from plexd.state.desired import DesiredState
from plexd.state.model import DataEntry, SecretRef

# -- keys ---------------------------------------------------------------------------------------------------------


@settings(max_examples=300)
@given(st.text(max_size=300))
def test_file_names_never_escape_their_directory(key):
    name = file_name(key)
    assert "/" not in name and "\\" not in name and "\0" not in name
    assert name not in (".", "..") and not name.startswith(".") and name.endswith(".json")
    assert len(name.encode()) <= 255
    base = Path("/var/lib/plexd/state/data")
    assert (base / name).resolve().parent == base


@given(st.text(max_size=100), st.text(max_size=100))
def test_distinct_keys_get_distinct_files(a, b):
    if a != b:
        assert file_name(a) != file_name(b)


@settings(max_examples=300)
@given(st.text(max_size=300))
def test_report_key_rule(key):
    problem = report_key_problem(key)
    bad = (not key or key in (".", "..") or "/" in key or "\\" in key
           or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key))
    try:
        bad = bad or len(key.encode()) > MAX_KEY_BYTES
    except UnicodeEncodeError:
        bad = True
    assert bool(problem) == bad, (key, problem)


def test_plain_keys_keep_readable_file_names():
    assert file_name("app-health") == "app-health.json"
    assert file_name("../x").startswith("~") and file_name(".hidden").startswith("~")


# -- secrets (§8.5) -----------------------------------------------------------------------------------------------

def seal(key: bytes, plaintext: str) -> tuple[str, str]:
    nonce = os.urandom(12)
    sealed = AESGCM(key).encrypt(nonce, plaintext.encode(), None)
    return base64.b64encode(sealed).decode(), base64.b64encode(nonce).decode()


def test_decrypt_with_the_raw_32_byte_node_secret_and_the_base64_shim():
    raw_secret = "A" * 32  # what the devplane issues: 32 ASCII characters, used as the key bytes
    ct, nonce = seal(raw_secret.encode(), "pässword")
    assert crypto.decrypt(ct, nonce, raw_secret) == "pässword"
    key = os.urandom(32)
    b64_secret = base64.b64encode(key).decode()  # 44 characters: decoded to the key
    ct, nonce = seal(key, "v")
    assert crypto.decrypt(ct, nonce, b64_secret) == "v"


@pytest.mark.parametrize("damage", ["tag", "nonce_len", "not_b64", "wrong_key", "short_secret"])
def test_every_decryption_failure_is_one_generic_error(damage):
    secret = "B" * 32
    ct, nonce = seal(secret.encode(), "x")
    if damage == "tag":
        raw = bytearray(base64.b64decode(ct))
        raw[-1] ^= 1
        ct = base64.b64encode(bytes(raw)).decode()
    elif damage == "nonce_len":
        nonce = base64.b64encode(b"123").decode()
    elif damage == "not_b64":
        ct = "!!!"
    elif damage == "wrong_key":
        secret = "C" * 32
    else:
        secret = "short"
    with pytest.raises(crypto.SecretDecryptError, match=r"^secret decryption failed$"):
        crypto.decrypt(ct, nonce, secret)


# -- the cache domain ----------------------------------------------------------------------------------------------

def model(metadata=None, data=(), refs=()) -> DesiredState:
    d = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.100.0.2")
    return d.with_node_state(metadata, data).with_secret_refs(refs)


async def test_cache_files_are_written_then_drift_is_restored_and_reported(tmp_path):
    domain = cache.NodeStateCache(tmp_path)
    entry = DataEntry("db/../../escape", "application/json", {"host": "db"}, 2, "2025-01-15T10:30:00Z")
    desired = model({"env": "prod"}, [entry], [SecretRef("tls", 1)])
    first = await converge(domain, desired, full=True)
    assert {c.correction_type for c in first.changes} == {"cache_file_added"} and len(first.changes) == 3
    state = tmp_path / "state"
    assert json.loads((state / "metadata.json").read_text()) == {"env": "prod"}
    assert (state / "metadata.json").read_text() == '{\n  "env": "prod"\n}'  # Go's MarshalIndent layout
    assert json.loads((state / "secrets.json").read_text()) == [{"key": "tls", "version": 1}]
    [data_file] = os.listdir(state / "data")  # the key with '/' and '..' stays inside data/
    assert json.loads((state / "data" / data_file).read_text())["key"] == "db/../../escape"
    assert {oct(p.stat().st_mode & 0o777) for p in state.rglob("*")} == {"0o700", "0o600"}
    assert (await converge(domain, desired, full=True)).changes == ()

    (state / "metadata.json").write_text('{"env": "hacked"}')
    (state / "secrets.json").unlink()
    (state / "data" / "stray.json").write_text("{}")
    os.chmod(state / "data" / data_file, 0o644)
    fixed = await converge(domain, desired, full=True)
    assert sorted(c.correction().to_wire()["type"] + " " + c.path for c in fixed.changes) == [
        f"cache_file_added {cache.STATE_DIR}/secrets.json",
        "cache_file_removed state/data/stray.json",
        f"cache_file_updated state/data/{data_file}",
        "cache_file_updated state/metadata.json",
    ]
    assert json.loads((state / "metadata.json").read_text()) == {"env": "prod"}
    assert (state / "data" / data_file).stat().st_mode & 0o777 == 0o600
    assert not (state / "data" / "stray.json").exists()


async def test_event_path_writes_only_what_changed_and_skips_peer_events(tmp_path):
    domain = cache.NodeStateCache(tmp_path)
    desired = model({"a": "1"})
    await converge(domain, desired, full=True)
    peer_event = DesiredState.with_peers(desired, [])  # a peer edit keeps the node-state objects as they are
    assert (await converge(domain, peer_event, full=False)).changes == ()
    changed = desired.with_node_state({"a": "2"}, [])
    result = await converge(domain, changed, full=False)
    assert [c.path for c in result.changes] == ["state/metadata.json"]
    dry = await converge(domain, changed.with_node_state({"a": "3"}, []), full=True, dry_run=True)
    assert len(dry.changes) == 1 and json.loads((tmp_path / "state/metadata.json").read_text()) == {"a": "2"}


def nested(levels: int, width: int) -> list:
    """A payload whose indented form is ~40 times its compact one."""
    payload: list = [1] * width
    for _ in range(levels):
        payload = [payload]
    return payload


async def test_a_data_entry_larger_than_the_load_bound_converges_once(tmp_path):
    """Its indented file is over MAX_CACHE_FILE: the full converge still finds it right (read by its size, not a
    fixed bound) instead of rewriting it and reporting drift on every reconcile."""
    domain = cache.NodeStateCache(tmp_path)
    desired = model(data=[DataEntry("big", "application/json", nested(60, 150_000), 1, "")])
    first = await converge(domain, desired, full=True)
    assert [c.correction_type for c in first.changes].count("cache_file_added") == 3
    assert (tmp_path / "state/data/big.json").stat().st_size > cache.MAX_CACHE_FILE
    assert (await converge(domain, desired, full=True)).changes == ()


async def test_a_deeply_nested_report_survives_a_restart(tmp_path):
    """A 450 KB nested payload is an 18 MB file when indented, over the bound it is read back with: report files
    are compact, so the entry is found again."""
    payload = nested(60, 150_000)
    entry = await ReportStore(tmp_path).put("deep", "application/json", payload, None)
    path = tmp_path / "state/report/deep.json"
    assert path.stat().st_size < 1 << 20
    again = ReportStore(tmp_path)
    assert again.load() == 1 and again.get("deep") == entry


async def test_an_unwritable_cache_is_an_error_not_a_crash(tmp_path):
    (tmp_path / "state").write_text("a file where the directory should be")
    result = await converge(cache.NodeStateCache(tmp_path), model({"a": "1"}), full=True)
    assert result.errors and "node cache" in result.errors[0]


def test_cache_load_reads_what_the_go_agent_left(tmp_path):
    state = tmp_path / "state"
    (state / "data").mkdir(parents=True)
    (state / "metadata.json").write_text('{"env": "prod"}')
    (state / "secrets.json").write_text('[{"key": "k", "version": 4}]')
    (state / "data" / "db.json").write_text(json.dumps({"key": "db", "content_type": "application/json",
                                                        "payload": {"x": 1}, "version": 2, "updated_at": ""}))
    (state / "data" / "broken.json").write_text("{")
    metadata, data, refs = cache.load(tmp_path)
    assert metadata == {"env": "prod"} and [d.key for d in data] == ["db"] and refs == [SecretRef("k", 4)]


# -- report sync ----------------------------------------------------------------------------------------------------

class Upstream:
    """The send side of ReportSync, recording batches; `fail` is raised while set. (The real POST /report against
    the devplane is in tests/e2e/test_node_api_lab.py; this drives the queue's rules one by one.)"""

    def __init__(self) -> None:
        self.batches: list[tuple[list, list]] = []
        self.fail: Exception | None = None

    async def __call__(self, entries, deleted):
        if self.fail is not None:
            raise self.fail
        self.batches.append(([e["key"] for e in entries], list(deleted)))


async def _no_default(kind, body):
    raise AssertionError("the reports lane has its own sender")


def report_sync(store: ReportStore, up: Upstream, tmp_path) -> ReportSync:
    return ReportSync(store, up, UplinkOutbox(tmp_path / "uplink.db", _no_default), debounce=0.0,
                      backoff=Backoff(base=0.01, cap=0.02, jitter=0))


async def run_until(sync: ReportSync, pred) -> None:
    task = asyncio.create_task(sync.uplink.run())
    try:
        for _ in range(500):
            await asyncio.sleep(0.002)
            if pred():
                return
        raise AssertionError("condition not reached")
    finally:
        task.cancel()


async def test_changes_coalesce_per_key_and_survive_a_restart(tmp_path):
    up = Upstream()
    store = ReportStore(tmp_path)
    sync = report_sync(store, up, tmp_path)
    store.subscribe(sync.changed)
    for i in range(5):
        await store.put("a", "text/plain", f"v{i}", None)
    await store.put("b", "text/plain", "x", None)
    await store.delete("b")
    assert sync.pending == 2
    sync.uplink.close()
    # a restart before anything was sent: the queue is read back from uplink.db
    store2 = ReportStore(tmp_path)
    store2.load()
    sync2 = report_sync(store2, up, tmp_path)
    assert sync2.load(tmp_path) == 2
    await run_until(sync2, lambda: sync2.pending == 0)
    assert up.batches == [(["a"], ["b"])]  # five writes to a: one entry; b written then deleted: one deletion


async def test_an_older_versions_queue_file_is_taken_over(tmp_path):
    up = Upstream()
    store = ReportStore(tmp_path)
    await store.put("a", "text/plain", "1", None)
    (tmp_path / "state" / "report-queue.json").write_text(json.dumps({"version": 1, "pending": ["a", "gone"]}))
    sync = report_sync(store, up, tmp_path)
    assert sync.load(tmp_path) == 2 and not (tmp_path / "state" / "report-queue.json").exists()
    await run_until(sync, lambda: sync.pending == 0)
    assert up.batches == [(["a"], ["gone"])]


async def test_a_failed_send_is_retried_and_a_409_drops_the_batch(tmp_path, caplog):
    up = Upstream()
    store = ReportStore(tmp_path)
    sync = report_sync(store, up, tmp_path)
    store.subscribe(sync.changed)
    await store.put("a", "text/plain", "1", None)
    up.fail = TransientError("report sync", 503, "down")
    await run_until(sync, lambda: "503" in sync.status()["last_error"])
    assert sync.pending == 1
    up.fail = None
    await run_until(sync, lambda: sync.pending == 0)
    assert up.batches == [(["a"], [])] and sync.status()["last_error"] == ""

    await store.put("c", "text/plain", "1", None)
    up.fail = ControlPlaneError("report sync", 409, "version conflict")
    await run_until(sync, lambda: sync.pending == 0)
    assert sync.status()["dropped"] == 1
    assert "reports batch of 1 (keys: c) report dropped: the control plane refused it for good" in caplog.text


# -- rate limit ------------------------------------------------------------------------------------------------------

def test_token_bucket_refills_per_client():
    now = [0.0]
    limiter = RateLimiter(rate=10, burst=2, clock=lambda: now[0])
    assert [limiter.allow("a") for _ in range(3)] == [0.0, 0.0, pytest.approx(0.1)]
    assert limiter.allow("b") == 0.0  # its own bucket
    now[0] += 0.1
    assert limiter.allow("a") == 0.0
    assert RateLimiter(rate=0, burst=1).allow("x") == 0.0  # off


def test_the_client_table_stays_bounded_and_cheap_under_many_addresses():
    # Unauthenticated TCP callers from many addresses: the table was rebuilt whole for every new address while
    # none had refilled (20,000 addresses: 38 s of the event loop). Now O(1): the one seen longest ago goes.
    import time

    from plexd.base.ratelimit import MAX_CLIENTS

    now = [0.0]
    limiter = RateLimiter(rate=0.2, burst=10, clock=lambda: now[0])  # 50 s to refill: nobody refills here
    started = time.process_time()
    for i in range(5 * MAX_CLIENTS):
        now[0] += 0.0001
        assert limiter.allow(("tcp", f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")) == 0.0
    assert len(limiter._buckets) == MAX_CLIENTS
    assert time.process_time() - started < 5  # was minutes: a bound that only a quadratic cost can break
    # the recent clients keep their buckets (a flooding one stays limited); the oldest were forgotten
    last = ("tcp", f"10.0.{((5 * MAX_CLIENTS - 1) >> 8) & 255}.{(5 * MAX_CLIENTS - 1) & 255}")
    assert last in limiter._buckets and ("tcp", "10.0.0.0") not in limiter._buckets


def test_a_refilled_bucket_is_forgotten_before_a_busy_one():
    from plexd.base import ratelimit

    now = [0.0]
    limiter = RateLimiter(rate=1, burst=1, clock=lambda: now[0])
    old_max, ratelimit.MAX_CLIENTS = ratelimit.MAX_CLIENTS, 2
    try:
        limiter.allow("quiet")
        now[0] = 5.0
        limiter.allow("busy")
        assert limiter.allow("busy") > 0  # empty
        now[0] = 5.5
        limiter.allow("new")  # room made: "quiet" has refilled and goes; "busy" stays limited
        assert "quiet" not in limiter._buckets and limiter.allow("busy") > 0
    finally:
        ratelimit.MAX_CLIENTS = old_max


def test_blocked_looks_at_a_bucket_without_taking_from_it():
    from plexd.base.ratelimit import RateLimiter

    now = [0.0]
    limiter = RateLimiter(rate=0.5, burst=2, clock=lambda: now[0])
    assert not limiter.blocked("a")  # never seen
    assert limiter.allow("a") == 0 and limiter.allow("a") == 0
    assert limiter.blocked("a") and limiter.blocked("a")  # looking takes nothing
    now[0] = 2.0  # one token back
    assert not limiter.blocked("a") and limiter.allow("a") == 0 and limiter.blocked("a")
    assert not RateLimiter(0, 1).blocked("a")  # the limit off: never blocked


def test_a_change_the_outbox_cannot_take_now_is_queued_with_the_next(tmp_path, caplog):
    store = ReportStore(tmp_path)
    sync = report_sync(store, Upstream(), tmp_path)
    sync.uplink.db.execute("CREATE TRIGGER refuse BEFORE INSERT ON outbox BEGIN SELECT RAISE(FAIL, 'disk full'); END")
    sync.changed("a")  # no exception into the node-API handler that wrote the entry
    assert "not queued for the control plane (disk full)" in caplog.text and sync.pending == 1
    sync.uplink.db.execute("DROP TRIGGER refuse")
    sync.changed("b")
    assert sorted(e.key for e in sync.uplink.pending("reports")) == ["a", "b"] and sync.pending == 2


async def test_a_change_is_queued_again_once_the_store_holds_it(tmp_path):
    """Queued before the write (a crash between the two must not lose it) and again after: a send that came due
    while the file was being written read the key as it was (a new key as deleted, a delete as still there),
    and its acknowledgement took the only row with it."""
    seen: list[tuple[str, object]] = []
    store = ReportStore(tmp_path)
    store.subscribe(lambda key: seen.append((key, store.get(key).version if store.get(key) else None)))
    await store.put("k", "text/plain", "v1", None)
    assert seen[-1] == ("k", 1)  # the last word is the entry as stored
    await store.put("k", "text/plain", "v2", None)
    assert seen[-1] == ("k", 2)
    await store.delete("k")
    assert seen[-1] == ("k", None)
