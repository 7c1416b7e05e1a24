"""Registrar over real HTTP against a scripted server: retries, Retry-After, give-up, refusals, re-registration,
token-file deletion and the metadata token source. Time is a FakeClock, so nothing here sleeps for real."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import stat

import pytest
from agentcore_recorder import Recorder, Reply

from plexd.base.clock import FakeClock
from plexd.config.settings import load as load_config
from plexd.controlplane.client import ControlPlaneClient
from plexd.identity.identity_store import DataDirError, IdentityStore
from plexd.identity.registrar import BootstrapToken, Registrar, RegistrationError, TokenError

SIGNING = base64.b64encode(b"\x05" * 32).decode()


def ok_body(node_id="n_1", mesh_ip="10.100.0.2", secret="S" * 32, signing=SIGNING) -> str:
    return json.dumps({"node_id": node_id, "mesh_ip": mesh_ip, "signing_public_key": signing,
                       "node_secret_key": secret, "peers": []})


def make_config(tmp_path, api, **env):
    base = {"PLEXD_CONFIG": "", "PLEXD_API": api, "PLEXD_API_ALLOW_INSECURE": "true",
            "PLEXD_DATA_DIR": str(tmp_path / "data"),
            "PLEXD_TOKEN_FILE": str(tmp_path / "token"), "PLEXD_REGISTRATION_HOSTNAME": "node-a",
            "PLEXD_HOOKS_DIR": str(tmp_path / "hooks"), "PLEXD_NODE_API_SOCKET_PATH": str(tmp_path / "api.sock")}
    base.update(env)
    return load_config(env=base)


async def drive(clock: FakeClock, task: asyncio.Task, limit: int = 200):
    """Advance the fake clock each time the task sleeps, until it finishes."""
    for _ in range(limit):
        await asyncio.sleep(0)
        if task.done():
            return task.result()
        while clock.pending_sleepers == 0 and not task.done():
            await asyncio.sleep(0.005)
        if clock.pending_sleepers:
            clock.advance(clock.sleeps[-1])
    raise AssertionError("task did not finish")


@pytest.fixture
async def rec():
    async with Recorder() as server:
        yield server


@pytest.fixture
def clock():
    return FakeClock()


async def test_transient_failures_are_retried_with_backoff_then_succeed(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(503, '{"error":"busy"}'), Reply(502, ""), Reply(500, ""),
              Reply(201, ok_body()))
    config = make_config(tmp_path, rec.url)
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(config, client, clock=clock, env={}, rand=lambda: 0.5)
        task = asyncio.create_task(reg.register(BootstrapToken("tok-1", "env", "X")))
        identity = await drive(clock, task)
    assert identity.node_id == "n_1"
    assert clock.sleeps == [1.0, 2.0, 4.0]  # 1 s x2, jitter centred (rand=0.5)
    assert len(rec.requests) == 4
    assert all(r.headers["authorization"] == "Bearer tok-1" and r.json["token"] == "tok-1" for r in rec.requests)
    assert client.token == "S" * 32  # bearer switched to the node secret


async def test_jitter_stays_within_25_percent(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(503), Reply(503), Reply(200, ok_body()))
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(make_config(tmp_path, rec.url), client, clock=clock, env={}, rand=lambda: 0.0)
        await drive(clock, asyncio.create_task(reg.register(BootstrapToken("t", "env"))))
    assert clock.sleeps == [0.75, 1.5]


async def test_retry_after_is_honoured_spread_and_the_backoff_grows(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(429, "{}", {"Retry-After": "17"}), Reply(429, "{}"),
              Reply(503), Reply(200, ok_body()))
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(make_config(tmp_path, rec.url), client, clock=clock, env={}, rand=lambda: 0.5)
        await drive(clock, asyncio.create_task(reg.register(BootstrapToken("t", "env"))))
    assert clock.sleeps == [17.0 * 1.25, 2.0, 4.0]  # rand 0.5: no jitter, the hint spread x1.25


async def test_gives_up_after_max_wait_with_a_clear_message(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(503, '{"error":"maintenance"}'))
    config = make_config(tmp_path, rec.url, PLEXD_REGISTRATION_MAX_WAIT="1m")
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(config, client, clock=clock, env={}, rand=lambda: 0.5)
        task = asyncio.create_task(reg.register(BootstrapToken("t", "env")))
        with pytest.raises(RegistrationError) as info:
            await drive(clock, task)
    text = str(info.value)
    assert f"could not register with the control plane at {rec.url} within 1m0s" in text
    assert "HTTP 503: maintenance" in text and "registration.max_wait" in text
    assert sum(clock.sleeps) <= 60
    assert not (tmp_path / "data" / "identity.json").exists()


async def test_unreachable_control_plane_names_address(tmp_path, clock):
    config = make_config(tmp_path, "http://127.0.0.1:9", PLEXD_REGISTRATION_MAX_WAIT="3s")
    async with ControlPlaneClient(config.api.url) as client:
        reg = Registrar(config, client, clock=clock, env={}, rand=lambda: 0.5)
        with pytest.raises(RegistrationError) as info:
            await drive(clock, asyncio.create_task(reg.register(BootstrapToken("t", "env"))))
    text = str(info.value)
    assert "http://127.0.0.1:9" in text and "POST /v1/register" in text and "cannot connect" in text


@pytest.mark.parametrize("status,phrase", [
    (400, "malformed"), (401, "already used"), (403, "forbidden"), (404, "does not exist"),
    (409, "'node-a' is already registered"),
])
async def test_refusals_stop_at_once(tmp_path, rec, clock, status, phrase):
    rec.route("POST", "/v1/register", Reply(status, '{"error":"server reason"}'))
    (tmp_path / "token").write_text("tok")
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(make_config(tmp_path, rec.url), client, clock=clock, env={})
        with pytest.raises(RegistrationError) as info:
            await reg.ensure_registered()
    assert phrase in str(info.value) and "server reason" in str(info.value) and info.value.status == status
    assert len(rec.requests) == 1 and clock.sleeps == []
    assert (tmp_path / "token").read_text() == "tok"  # the token file is kept when registration failed
    assert not (tmp_path / "data" / "identity.json").exists()
    # refused for good: the key it was sent with is not kept for the next try (with this token or another)
    assert not (tmp_path / "data" / "private_key.registering").exists()


async def test_an_answer_lost_is_asked_for_again_with_the_same_key(tmp_path, rec, clock):
    # The first try times out after the control plane took it (its answer lost); plexd is started again (a new
    # Registrar) and asks with the same token: the same public key goes, so the control plane can repeat its answer.
    rec.route("POST", "/v1/register", Reply(503, "maintenance"))
    (tmp_path / "token").write_text("tok")
    config = make_config(tmp_path, rec.url, PLEXD_REGISTRATION_MAX_WAIT="2s")
    async with ControlPlaneClient(rec.url) as client:
        with pytest.raises(RegistrationError):
            await drive(clock, asyncio.create_task(Registrar(config, client, clock=clock, env={}).ensure_registered()))
        rec.route("POST", "/v1/register", Reply(201, ok_body()))
        identity, _ = await Registrar(config, client, clock=clock, env={}).ensure_registered()
    sent = {r.json["public_key"] for r in rec.requests}
    assert sent == {identity.public_key}  # one key for every try with this token
    assert not (tmp_path / "data" / "private_key.registering").exists()  # saved: forgotten


async def test_token_file_deleted_after_success_and_capabilities_sent(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body()))
    (tmp_path / "token").write_text("plx_enroll_abc\n")
    caps = {"binary": {"version": "0.1.0", "checksum": "ff"}, "builtin_actions": None, "hooks": None}
    config = make_config(tmp_path, rec.url, PLEXD_REGISTRATION_METADATA="rack=r1")
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(config, client, clock=clock, env={}, capabilities=lambda: caps)
        identity, fresh = await reg.ensure_registered()
    assert fresh and not (tmp_path / "token").exists()
    body = rec.requests[0].json
    # the Go agent's fields in its order, then the key derivation offered (plexd.identity.node_secret), which a Go
    # control plane ignores: this one does not answer it, so the node stays in compatibility mode
    assert list(body) == ["token", "public_key", "hostname", "metadata", "capabilities", "node_secret_kdf"]
    assert body["node_secret_kdf"] == "hkdf-sha256" and identity.node_secret_kdf == ""
    assert body["token"] == "plx_enroll_abc" and body["hostname"] == "node-a" and body["metadata"] == {"rack": "r1"}
    assert body["capabilities"] == caps and body["public_key"] == identity.public_key
    data = tmp_path / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert IdentityStore(data).load().identity == identity


async def test_env_token_is_not_touched(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body()))
    env = {"PLEXD_BOOTSTRAP_TOKEN": "env-tok"}
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(make_config(tmp_path, rec.url), client, clock=clock, env=env)
        _, fresh = await reg.ensure_registered()
    assert fresh and env == {"PLEXD_BOOTSTRAP_TOKEN": "env-tok"}


async def test_reuse_makes_no_request(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body()))
    config = make_config(tmp_path, rec.url)
    async with ControlPlaneClient(rec.url) as client:
        first, fresh1 = await Registrar(config, client, clock=clock, env={"PLEXD_BOOTSTRAP_TOKEN": "t"}) \
            .ensure_registered()
    async with ControlPlaneClient(rec.url) as client:
        second, fresh2 = await Registrar(config, client, clock=clock, env={}).ensure_registered()
        assert client.token == "S" * 32
    assert (fresh1, fresh2) == (True, False) and first == second and len(rec.requests) == 1


async def test_corrupt_identity_is_reported_and_replaced(tmp_path, rec, clock, caplog):
    rec.route("POST", "/v1/register", Reply(201, ok_body(node_id="n_1")), Reply(201, ok_body(node_id="n_2")))
    config = make_config(tmp_path, rec.url)
    env = {"PLEXD_BOOTSTRAP_TOKEN": "t"}
    async with ControlPlaneClient(rec.url) as client:
        await Registrar(config, client, clock=clock, env=env).ensure_registered()
        (tmp_path / "data" / "identity.json").write_text('{"node_id": "n_1", "mesh')  # half-written
        identity, fresh = await Registrar(config, client, clock=clock, env=env).ensure_registered()
    assert fresh and identity.node_id == "n_2"
    assert "unusable (identity.json: not valid JSON" in caplog.text


async def test_no_token_anywhere_says_where_to_put_one(tmp_path, rec, clock):
    async with ControlPlaneClient(rec.url) as client:
        with pytest.raises(TokenError) as info:
            await Registrar(make_config(tmp_path, rec.url), client, clock=clock, env={}).ensure_registered()
    assert str(tmp_path / "token") in str(info.value) and "PLEXD_BOOTSTRAP_TOKEN" in str(info.value)
    assert rec.requests == []


async def test_bad_signing_key_in_response_is_refused_before_saving(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body(signing="c2hvcnQ=")))
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(make_config(tmp_path, rec.url), client, clock=clock, env={})
        with pytest.raises(RegistrationError, match="unusable identity: signing_public_key"):
            await reg.register(BootstrapToken("t", "env"))
    assert not (tmp_path / "data" / "identity.json").exists()


async def test_unwritable_data_dir_is_detected_before_the_token_is_spent(tmp_path, rec, clock):
    (tmp_path / "blocker").write_text("")
    config = make_config(tmp_path, rec.url, PLEXD_DATA_DIR=str(tmp_path / "blocker" / "data"))
    async with ControlPlaneClient(rec.url) as client:
        with pytest.raises(DataDirError, match="is not writable"):
            await Registrar(config, client, clock=clock, env={}).register(BootstrapToken("t", "env"))
    assert rec.requests == []


# -- re-registration (docs/decisions.md, Re-registration) -----------------------------------------------------


async def test_recover_reregisters_with_node_secret_same_key_empty_token(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body(secret="A" * 32)), Reply(200, ok_body(secret="B" * 32)))
    config = make_config(tmp_path, rec.url)
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(config, client, clock=clock, env={"PLEXD_BOOTSTRAP_TOKEN": "t"})
        first, _ = await reg.ensure_registered()
        again = await reg.recover(first)
        assert client.token == "B" * 32
    second_request = rec.requests[1]
    assert second_request.headers["authorization"] == "Bearer " + "A" * 32
    assert second_request.json["token"] == "" and second_request.json["public_key"] == first.public_key
    assert again.node_id == first.node_id and again.private_key == first.private_key
    assert IdentityStore(tmp_path / "data").load().identity.node_secret_key == "B" * 32


async def test_recover_falls_back_to_a_fresh_registration_with_a_token(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body()), Reply(401, '{"error":"unknown node"}'),
              Reply(201, ok_body(node_id="n_9", secret="C" * 32)))
    env = {"PLEXD_BOOTSTRAP_TOKEN": "t1"}
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(make_config(tmp_path, rec.url), client, clock=clock, env=env)
        first, _ = await reg.ensure_registered()
        env["PLEXD_BOOTSTRAP_TOKEN"] = "t2"
        fresh = await reg.recover(first)
    assert fresh.node_id == "n_9" and rec.requests[2].json["token"] == "t2"
    assert rec.requests[2].headers["authorization"] == "Bearer t2"


async def test_recover_without_a_token_keeps_the_identity_and_says_why(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body()), Reply(401, '{"error":"unknown node"}'))
    env = {"PLEXD_BOOTSTRAP_TOKEN": "t1"}
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(make_config(tmp_path, rec.url), client, clock=clock, env=env)
        first, _ = await reg.ensure_registered()
        env.clear()
        with pytest.raises(RegistrationError) as info:
            await reg.recover(first)
    assert "no longer accepts this node's secret" in str(info.value) and "no bootstrap token" in str(info.value)
    assert IdentityStore(tmp_path / "data").load().identity == first  # never deleted on a 401


async def test_recover_adopts_a_newer_identity_on_disk(tmp_path, rec, clock):
    rec.route("POST", "/v1/register", Reply(201, ok_body(secret="A" * 32)), Reply(201, ok_body(secret="Z" * 32)))
    env = {"PLEXD_BOOTSTRAP_TOKEN": "t"}
    config = make_config(tmp_path, rec.url)
    async with ControlPlaneClient(rec.url) as client:
        reg = Registrar(config, client, clock=clock, env=env)
        stale, _ = await reg.ensure_registered()
        await reg.reregister(stale)  # e.g. `plexd join` in another process updated the files
        adopted = await reg.recover(stale)
    assert adopted.node_secret_key == "Z" * 32 and len(rec.requests) == 2


# -- metadata token source ------------------------------------------------------------------------------------------


async def test_metadata_service_token(tmp_path, clock):
    async with Recorder() as imds, Recorder() as cp:
        imds.route("PUT", "/latest/api/token", Reply(200, "session-1", {"Content-Type": "text/plain"}))
        imds.route("GET", "/plexd/bootstrap-token", Reply(200, "meta-token\n", {"Content-Type": "text/plain"}))
        cp.route("POST", "/v1/register", Reply(201, ok_body()))
        config = make_config(tmp_path, cp.url, PLEXD_TOKEN_USE_METADATA="true", PLEXD_TOKEN_METADATA_URL=imds.url)
        async with ControlPlaneClient(cp.url) as client:
            await Registrar(config, client, clock=clock, env={}).ensure_registered()
    put, get = imds.requests
    assert put.headers["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert get.headers["x-aws-ec2-metadata-token"] == "session-1"
    assert cp.requests[0].json["token"] == "meta-token"


async def test_metadata_service_disabled_by_default_and_failure_is_unavailable(tmp_path, clock):
    async with Recorder() as imds:
        imds.route("GET", "/plexd/bootstrap-token", Reply(404, "no"))
        config = make_config(tmp_path, "http://127.0.0.1:9", PLEXD_TOKEN_METADATA_URL=imds.url)
        async with ControlPlaneClient(config.api.url) as client:
            with pytest.raises(TokenError):
                await Registrar(config, client, clock=clock, env={}).ensure_registered()
        assert imds.requests == []  # not asked unless token.use_metadata
        config = make_config(tmp_path, "http://127.0.0.1:9", PLEXD_TOKEN_USE_METADATA="1",
                             PLEXD_TOKEN_METADATA_URL=imds.url)
        async with ControlPlaneClient(config.api.url) as client:
            with pytest.raises(TokenError, match="no bootstrap token"):
                await Registrar(config, client, clock=clock, env={}).ensure_registered()
        assert [r.path for r in imds.requests] == ["/latest/api/token", "/plexd/bootstrap-token"]


async def test_a_metadata_answer_past_the_token_file_limit_is_unavailable(tmp_path, clock, caplog):
    caplog.set_level(logging.INFO, logger="plexd.identity.registrar")
    async with Recorder() as imds:
        imds.route("GET", "/plexd/bootstrap-token", Reply(200, "t" * (64 * 1024 + 1), {"Content-Type": "text/plain"}))
        config = make_config(tmp_path, "http://127.0.0.1:9", PLEXD_TOKEN_USE_METADATA="1",
                             PLEXD_TOKEN_METADATA_URL=imds.url)
        async with ControlPlaneClient(config.api.url) as client:
            with pytest.raises(TokenError, match="no bootstrap token"):
                await Registrar(config, client, clock=clock, env={}).ensure_registered()
    assert any("unavailable: response larger than 65536 bytes" in r.getMessage() for r in caplog.records)


async def test_a_stop_while_the_register_request_is_in_flight_waits_for_the_answer_and_saves_it(tmp_path):
    """SIGTERM during `POST /v1/register` cancelled it: the control plane spent the one-time token when it answered,
    the answer was thrown away, and the node was left with a spent token and no identity."""
    from plexd.node.agent import Agent

    answered = asyncio.Event()

    async def slow_register(req):
        await asyncio.sleep(1.0)
        answered.set()
        return Reply(200, ok_body())

    async with Recorder(slow_register) as server:
        (tmp_path / "token").write_text("plx_enroll_" + "a" * 32)
        config = make_config(tmp_path, server.url)
        stop = asyncio.Event()
        agent = Agent(config, stop_event=stop)
        async with agent:
            run = asyncio.create_task(agent.run(lambda a: pytest.fail("assembled after a stop")))
            while not server.requests:
                await asyncio.sleep(0.01)
            stop.set()  # the request is on the wire
            assert await asyncio.wait_for(run, 10) == 0
    assert answered.is_set()
    identity = IdentityStore(tmp_path / "data").load().identity
    assert identity is not None and identity.node_id == "n_1"


async def test_a_second_deregistration_while_one_is_in_progress_is_refused(tmp_path):
    # The second caller's failed POST reset the first one's `leaving`: the stop then kept the interface and table
    # the first caller had been told were torn down.
    from plexd.base.errors import PlexdError
    from plexd.identity.identity_store import Identity
    from plexd.node.agent import Agent

    agent = Agent(make_config(tmp_path, "http://127.0.0.1:9"))
    agent.identity = Identity("n_1", "10.100.0.2", SIGNING, "S" * 32, b"\x01" * 32)
    posted = asyncio.Event()

    async def slow_post(timeout, *, purge):
        posted.set()
        await asyncio.sleep(0.3)
        return ""

    agent._post_deregister = slow_post
    agent.stopped.set()  # no stop sequence to wait for here
    async with agent:
        first = asyncio.create_task(agent.leave(purge=False, force=False))
        await posted.wait()
        with pytest.raises(PlexdError, match="a deregistration is already in progress"):
            await agent.leave(purge=False, force=False)
        assert (await first).deregistered and agent.leaving.deregistered


async def test_a_stop_during_a_register_request_that_then_fails_sends_no_retry(tmp_path):
    """The wait after a stop lasts only while the request is on the wire: a 503 ends it, and the registrar's retry
    (which the stop would cut off on the wire, spending the token for nothing) is never sent."""
    from plexd.node.agent import Agent

    async def busy_then_ok(req):
        await asyncio.sleep(0.5)
        return Reply(503, "{}") if len(server.requests) == 1 else Reply(200, ok_body())

    async with Recorder(busy_then_ok) as server:
        (tmp_path / "token").write_text("plx_enroll_" + "b" * 32)
        stop = asyncio.Event()
        agent = Agent(make_config(tmp_path, server.url), stop_event=stop)
        async with agent:
            run = asyncio.create_task(agent.run(lambda a: pytest.fail("assembled after a stop")))
            while not server.requests:
                await asyncio.sleep(0.01)
            stop.set()
            assert await asyncio.wait_for(run, 10) == 0
        await asyncio.sleep(1.5)  # past the registrar's first backoff: a retry would have come by now
        assert len(server.requests) == 1
    assert IdentityStore(tmp_path / "data").load().identity is None
