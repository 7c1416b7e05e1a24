"""The signing key file as a domain of the engine, on real files: restored when deleted, edited or re-moded by hand,
from the key the verifier trusts (never from the desired model, whose keys an unsigned state pull may have set)."""

from __future__ import annotations

import base64
import os

import nacl.signing

from plexd.converge.engine import Engine
from plexd.state.desired import DesiredState
from plexd.state.model import SigningKeys
from plexd.trust.signing_key_domain import SigningKeyFile


def key() -> str:
    return base64.b64encode(bytes(nacl.signing.SigningKey.generate().verify_key)).decode()


def model() -> DesiredState:
    return DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.100.0.1")


async def test_the_file_is_put_back_and_each_repair_is_a_drift_line(tmp_path):
    trusted = [key()]
    domain = SigningKeyFile(tmp_path, lambda: trusted[0])
    engine = Engine([domain])
    path = tmp_path / "signing_public_key"

    first = await engine.converge(model())
    assert [c.correction_type for c in first.changes] == ["signing_key_file_restored"]
    assert "missing" in first.changes[0].detail and trusted[0] not in first.changes[0].detail  # a fingerprint only
    assert path.read_text() == trusted[0] and (os.stat(path).st_mode & 0o777) == 0o600
    assert (await engine.converge(model())).changes == ()

    path.write_text(key())  # another key, by hand
    fixed = await engine.converge(model())
    assert "held " in fixed.changes[0].detail and path.read_text() == trusted[0]
    os.chmod(path, 0o644)
    fixed = await engine.converge(model())
    assert "mode 0644 != 0600" in fixed.changes[0].detail and (os.stat(path).st_mode & 0o777) == 0o600
    path.write_bytes(b"x" * 10_000)  # not a key, and big: not read whole
    assert (await engine.converge(model())).changes and path.read_text() == trusted[0]


async def test_the_desired_models_keys_are_never_written_and_nothing_trusted_writes_nothing(tmp_path):
    trusted: list[str | None] = [None]
    engine = Engine([SigningKeyFile(tmp_path, lambda: trusted[0])])
    from_state = model().with_signing_keys(SigningKeys(current=key()))  # as an unsigned state pull would say
    assert (await engine.converge(from_state)).changes == () and not (tmp_path / "signing_public_key").exists()
    trusted[0] = key()
    await engine.converge(from_state)
    assert (tmp_path / "signing_public_key").read_text() == trusted[0] != from_state.signing_keys.current


async def test_an_event_path_apply_writes_only_a_key_it_has_not_seen(tmp_path):
    trusted = [key()]
    domain = SigningKeyFile(tmp_path, lambda: trusted[0])
    engine = Engine([domain])
    await engine.converge(model())
    assert (await engine.apply_delta(model())).changes == ()  # a peer event: nothing to do, nothing read
    trusted[0] = key()  # rotated (the event handler writes the file itself; here it did not)
    r = await engine.apply_delta(model())
    assert [c.correction_type for c in r.changes] == ["signing_key_file_restored"]
    assert (tmp_path / "signing_public_key").read_text() == trusted[0]
    assert engine.status()["signing_key"]["current"] not in (trusted[0], "")
