"""One leaked string must not open both doors: with a control plane that takes the derivation (the devplane does),
the bearer a node sends and the key its secrets are sealed with are derived separately from the node secret
(HKDF), so the bearer (seen by proxies and access logs) decrypts nothing and the node secret is never sent. A
control plane that does not answer the offer (the Go one) gets today's behaviour. Real `plexd join`, real devplane,
real HTTP."""

from __future__ import annotations

import base64
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from nacl.public import PrivateKey

from plexd.devplane.harness import Devplane
from plexd.identity.identity_store import IdentityStore, node_secret

PLEXD = str(Path(sys.executable).with_name("plexd"))


@pytest.fixture
def dp(tmp_path):
    with Devplane(tmp_path / "devplane") as plane:
        yield plane


def test_a_node_that_joined_sends_a_derived_bearer_and_its_secrets_need_the_derived_key(tmp_path, dp):
    (tmp_path / "token").write_text(dp.admin.create_token())
    config = tmp_path / "config.yaml"
    config.write_text(f"api: {{url: {dp.url}, allow_insecure: true}}\n"
                      f"data_dir: {tmp_path / 'data'}\ntoken: {{file: {tmp_path / 'token'}}}\n"
                      f"registration: {{hostname: px-kdf, max_wait: 5s}}\n")
    r = subprocess.run([PLEXD, "join"], env={"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(config)},
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    ident = IdentityStore(tmp_path / "data").load().identity
    kdf_file = tmp_path / "data" / "node_secret_kdf"
    assert ident.node_secret_kdf == "hkdf-sha256" and kdf_file.read_text() == "hkdf-sha256"
    assert stat.S_IMODE(kdf_file.stat().st_mode) == 0o600
    assert ident.bearer != ident.node_secret_key and ident.node_secret_key not in ident.bearer

    state = f"{dp.url}/v1/nodes/{ident.node_id}/state"
    # the node secret itself opens nothing: only the derived bearer does
    assert httpx.get(state, headers={"Authorization": f"Bearer {ident.node_secret_key}"}).status_code == 401
    assert httpx.get(state, headers={"Authorization": f"Bearer {ident.bearer}"}).status_code == 200

    dp.admin.set_secret(ident.node_id, "db-password", "hunter2")
    sealed = httpx.get(f"{dp.url}/v1/nodes/{ident.node_id}/secrets/db-password",
                       headers={"Authorization": f"Bearer {ident.bearer}"}).json()
    nonce, ciphertext = base64.b64decode(sealed["nonce"]), base64.b64decode(sealed["ciphertext"])
    # neither the bearer (what a proxy saw) nor the node secret as a raw key decrypts it ...
    for leaked in (ident.bearer.encode()[:32], ident.node_secret_key.encode()):
        with pytest.raises(InvalidTag):
            AESGCM(leaked).decrypt(nonce, ciphertext, None)
    # ... the derived key does, and it is what the node's API decrypts with
    key = node_secret.secrets_key(ident.node_secret_key, ident.node_secret_kdf)
    assert AESGCM(key).decrypt(nonce, ciphertext, None) == b"hunter2"
    from plexd.nodeapi import crypto

    assert crypto.decrypt(sealed["ciphertext"], sealed["nonce"], ident.node_secret_key, ident.node_secret_kdf) \
        == "hunter2"


def test_a_node_that_does_not_offer_it_keeps_the_go_behaviour(dp):
    """What a Go agent sends: no offer, no field in the answer, the node secret is bearer and AES key (§5.5)."""
    token = dp.admin.create_token()
    pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
    r = httpx.post(f"{dp.url}/v1/register", json={"token": token, "public_key": pub, "hostname": "go-agent"},
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201 and node_secret.FIELD not in r.json()
    node_id, secret = r.json()["node_id"], r.json()["node_secret_key"]
    dp.admin.set_secret(node_id, "k", "v")
    sealed = httpx.get(f"{dp.url}/v1/nodes/{node_id}/secrets/k", headers={"Authorization": f"Bearer {secret}"})
    assert sealed.status_code == 200
    body = sealed.json()
    assert AESGCM(secret.encode()).decrypt(base64.b64decode(body["nonce"]), base64.b64decode(body["ciphertext"]),
                                           None) == b"v"


def test_an_unknown_derivation_in_the_answer_is_refused_and_compatibility_mode_is_said_once(caplog, monkeypatch):
    with pytest.raises(ValueError, match="node_secret_kdf 'aes-ctr-v9' is not one this plexd knows"):
        node_secret.check("aes-ctr-v9", "the register response")
    assert node_secret.check(None, "x") == "" and node_secret.check("hkdf-sha256", "x") == "hkdf-sha256"
    monkeypatch.setattr(node_secret, "_compat_logged", False)
    with caplog.at_level(logging.INFO, logger="plexd.identity.node_secret"):
        for _ in range(3):
            node_secret.note_mode("")
        node_secret.note_mode("hkdf-sha256")
    said = [r.getMessage() for r in caplog.records if r.name == "plexd.identity.node_secret"]
    assert len(said) == 1 and "compatibility mode" in said[0], said


def test_the_two_derived_keys_are_distinct_and_fixed():
    """Pinned values: a control plane implementing the derivation elsewhere must get the same bytes (README)."""
    secret = "0123456789abcdef0123456789abcdef"
    assert node_secret.bearer(secret, "") == secret
    bearer = node_secret.bearer(secret, "hkdf-sha256")
    key = node_secret.secrets_key(secret, "hkdf-sha256")
    assert len(key) == 32 and base64.urlsafe_b64decode(bearer + "=") != key
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    def hkdf(info: bytes) -> bytes:
        return HKDF(hashes.SHA256(), 32, None, info).derive(secret.encode())

    assert key == hkdf(b"plexd node secret v1: AES-256-GCM key for node secrets")
    assert base64.urlsafe_b64decode(bearer + "=") == hkdf(b"plexd node secret v1: bearer token")
