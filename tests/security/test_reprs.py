"""Secrets shown by a repr (in a log line, a traceback, a debugger, a test failure): every dataclass in plexd is
walked, and a field whose name says it holds a private key, a node secret, a token, a PSK or a password (or the
`value` of a class named for one, or a config leaf marked secret) must be left out of the generated repr, or the
class must write its own. Then instances holding a sentinel are printed."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re

import plexd

SECRET_NAME = re.compile(r"private|secret|token|psk|preshared|password|passphrase|bearer|credential", re.I)

# Fields whose names match but that hold no secret value, each with the reason.
NOT_SECRET = {
    "plexd.config.settings.NodeApiConfig.secrets_group": "a group name",
    "plexd.config.settings.NodeApiConfig.http_token_file": "a path; the token is read from it, never kept here",
    "plexd.config.settings.MetricsConfig.token_file": "a path; the scrape token is read from it, never kept here",
    "plexd.config.settings.KubernetesConfig.token_file":
        "a path; the node's API-server token is read from it at each use",
    "plexd.config.settings.Config.token": "TokenConfig, whose own secret leaf (value) is walked and left out",
    "plexd.state.desired.DesiredState.secret_refs": "names and versions of secrets, never their values",
    "plexd.state.model.State.secret_refs": "names and versions of secrets, never their values",
    "plexd.devplane.serve.ServeOptions.admin_token_file": "a path",
    "plexd.nodeapi.routes.NodeApi.fetch_secret": "a function (its repr is the function's name)",
    "plexd.nodeapi.routes.NodeApi.node_secret": "a function (its repr is the function's name)",
    "plexd.nodeapi.routes.NodeApi.secrets_group": "a group name",
    "plexd.nodeapi.routes.NodeApi.node_secret_kdf": "a function; the name of a key derivation",
    "plexd.controlplane.client.RegisterRequest.node_secret_kdf": "the name of a key derivation (hkdf-sha256)",
    "plexd.state.model.RegisterResponse.node_secret_kdf": "the name of a key derivation (hkdf-sha256)",
}
SENTINEL = "SENTINEL-SECRET-0xC0FFEE"


def plexd_dataclasses() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(plexd.__path__, "plexd."):
        if info.name.endswith("__main__"):
            continue  # running it is the CLI
        module = importlib.import_module(info.name)
        found += [obj for obj in vars(module).values() if isinstance(obj, type) and dataclasses.is_dataclass(obj)
                  and obj.__module__ == module.__name__]
    return found


def writes_its_own_repr(cls: type) -> bool:
    own = cls.__dict__.get("__repr__")
    return own is not None and not hasattr(own, "__wrapped__")  # dataclass's generated repr is wrapped


def test_no_dataclass_field_named_for_a_secret_is_in_a_generated_repr():
    classes = plexd_dataclasses()
    assert len(classes) > 100  # the walk found the package (it has a few hundred)
    shown, checked = [], []
    for cls in classes:
        for f in dataclasses.fields(cls):
            name = f"{cls.__module__}.{cls.__qualname__}.{f.name}"
            secret = (SECRET_NAME.search(f.name) or f.metadata.get("secret")
                      or (f.name == "value" and SECRET_NAME.search(cls.__name__)))  # BootstrapToken.value
            if not secret or name in NOT_SECRET:
                continue
            checked.append(name)
            if f.repr and cls.__repr__ is not object.__repr__ and not writes_its_own_repr(cls):
                shown.append(name)
    assert not shown, f"secret fields shown by a repr (field(repr=False) or a __repr__ of the class): {shown}"
    # the walk saw the ones this issue is about
    for expected in ("plexd.identity.identity_store.Identity.private_key",
                     "plexd.identity.identity_store.Identity.node_secret_key",
                     "plexd.config.settings.TokenConfig.value", "plexd.state.model.RegisterResponse.node_secret_key",
                     "plexd.state.model.Peer.psk", "plexd.controlplane.client.RegisterRequest.token",
                     "plexd.devplane.store.Node.secret", "plexd.identity.registrar.BootstrapToken.value"):
        assert expected in checked, expected
    stale = set(NOT_SECRET) - {f"{c.__module__}.{c.__qualname__}.{f.name}" for c in classes
                               for f in dataclasses.fields(c)}
    assert not stale, f"NOT_SECRET names fields that no longer exist: {stale}"


def test_config_secret_leaves_are_out_of_the_repr():
    from plexd.config import settings as config

    leaves = [f.name for f in dataclasses.fields(config.TokenConfig) if f.metadata.get("secret")]
    assert leaves == ["value"]
    cfg = config.load(None, env={"PLEXD_TOKEN_VALUE": SENTINEL})
    assert cfg.token.value == SENTINEL and SENTINEL not in repr(cfg) and SENTINEL not in str(cfg)


def test_instances_holding_secrets_never_print_them():
    from plexd.controlplane.client import RegisterRequest
    from plexd.devplane.store import Node
    from plexd.identity.identity_store import Identity
    from plexd.identity.registrar import BootstrapToken
    from plexd.nodeapi.local_api import Request, Response
    from plexd.state.model import Peer, RegisterResponse

    key = SENTINEL.encode().ljust(32, b"!")
    values = [
        Identity("n_1", "10.100.0.1", "c2lnbmluZw==", SENTINEL, key),
        BootstrapToken(SENTINEL, "config", "token.value"),
        RegisterRequest(SENTINEL, "cHVi", "host"),
        RegisterResponse("n_1", "10.100.0.1", "c2lnbmluZw==", SENTINEL),
        Peer("n_2", "cHVi", "10.100.0.2", psk=SENTINEL),
        Node("n_1", "host", "cHVi", "10.100.0.1", SENTINEL, "2025-01-01T00:00:00Z",
             secrets={"db": {"value": SENTINEL, "version": 1}}),
        Request("GET", "/v1/state", {}, {"authorization": f"Bearer {SENTINEL}"}, SENTINEL.encode(), None, "tcp"),
        Response(200, {"key": "db", "value": SENTINEL, "version": 1}),
    ]
    for value in values:
        text = repr(value)
        assert SENTINEL not in text and repr(key) not in text, text
