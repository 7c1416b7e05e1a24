"""Session tokens: each check of docs/protocol.md §A1.2 refuses what it must, in order, naming the reason
and never the token; and no input whatever makes the verifier raise anything but TokenRefused."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey

from plexd.access.token import MAX_TOKEN_BYTES, TokenRefused, sign_session_token, verify_session_token

NOW = 1_764_000_000.0
CP = SigningKey.generate()
DUPLICATE_EXP = b'{"exp":1,"exp":2}'
NAN_EXP = b'{"exp": NaN}'
SSH_TARGET = {"user": "deploy", "allowed_commands": ["id -un"]}


def claims(**over):
    base = {"jti": "ses_1", "kind": "ssh", "target": {"kind": "ssh", **SSH_TARGET}, "nbf": NOW - 5, "exp": NOW + 600}
    base.update(over)
    return base


def verify(token, *, keys=(CP.verify_key,), session_id="ses_1", kind="ssh", target=SSH_TARGET, now=NOW,
           user="deploy"):
    return verify_session_token(token, keys=keys, session_id=session_id, kind=kind, target=target, now=now,
                                user=user)


def seg(obj) -> str:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def refused(token, **kw) -> TokenRefused:
    with pytest.raises(TokenRefused) as info:
        verify(token, **kw)
    assert not token or token not in str(info.value)  # the reason is logged, never the token
    return info.value


def test_a_token_for_this_session_user_and_time_is_admitted():
    got = verify(sign_session_token(CP, claims()))
    assert (got.jti, got.kind, got.exp) == ("ses_1", "ssh", NOW + 600)


@pytest.mark.parametrize("over, kw, reason", [
    ({"exp": NOW - 1}, {}, "expired"),
    ({"exp": NOW}, {}, "expired"),  # strict: exp itself is already too late
    ({"exp": None}, {}, "expired"),
    ({"nbf": NOW + 31}, {}, "not_yet_valid"),  # beyond the 30 s skew
    ({}, {"session_id": "ses_other"}, "session"),  # a token of another (node's) session
    ({}, {"kind": "tcp", "target": {"host": "127.0.0.1", "port": 5432}}, "kind"),
    ({"target": {"kind": "tcp", "user": "deploy"}}, {}, "kind"),
    ({}, {"user": "root"}, "target"),  # another user
    ({"target": {"kind": "ssh", "user": "deploy", "allowed_commands": ["bash"]}}, {}, "target"),  # wider grant
    ({"target": {"kind": "ssh", "user": "deploy", "host": "10.0.0.1"}}, {}, "target"),  # a field not granted
])
def test_each_check_refuses_with_its_reason(over, kw, reason):
    c = {k: v for k, v in claims(**over).items() if v is not None}
    assert refused(sign_session_token(CP, c), **kw).reason == reason


def test_nbf_within_the_skew_is_admitted():
    verify(sign_session_token(CP, claims(nbf=NOW + 29)))


def test_an_unknown_key_is_refused_and_a_rotated_in_key_is_admitted():
    other = SigningKey.generate()
    token = sign_session_token(other, claims())
    assert refused(token).reason == "signature"
    verify(token, keys=(CP.verify_key, other.verify_key))


def test_alg_none_is_refused_before_any_signature_check():
    token = f"{seg({'alg': 'none'})}.{seg(claims())}.{seg(b'x' * 64)}"
    assert refused(token).reason == "algorithm"


def test_hs256_keyed_with_the_public_key_is_refused():
    head, body = seg({"alg": "HS256"}), seg(claims())
    mac = hmac.new(bytes(CP.verify_key), f"{head}.{body}".encode(), hashlib.sha256).digest()
    assert refused(f"{head}.{body}.{seg(mac)}").reason == "algorithm"


def test_the_signature_of_another_token_is_refused():
    mine = sign_session_token(CP, claims())
    theirs = sign_session_token(CP, claims(exp=NOW + 3600))
    spliced = ".".join(theirs.split(".")[:2] + mine.split(".")[2:])
    assert refused(spliced).reason == "signature"


@pytest.mark.parametrize("token", [
    "", "a.b", "a.b.c.d", "a..c", "a b.c.d", "é.b.c", "x" * (MAX_TOKEN_BYTES + 1),
    f"{seg([1])}.{seg(claims())}.{seg(b'x' * 64)}",  # header not an object
    f"{seg({'alg': 'EdDSA'})}.{seg(b'not json')}.{seg(b'x' * 64)}",
    f"{seg({'alg': 'EdDSA'})}.{seg(DUPLICATE_EXP)}.{seg(b'x' * 64)}",  # duplicate keys
    f"{seg({'alg': 'EdDSA'})}.{seg(claims(exp=2.0**60))}.{seg(b'x' * 64)}",
    f"{seg({'alg': 'EdDSA'})}.{seg(claims(exp=-(2.0**60)))}.{seg(b'x' * 64)}",
    f"{seg({'alg': 'EdDSA'})}.{seg(claims(exp=True))}.{seg(b'x' * 64)}",
    f"{seg({'alg': 'EdDSA'})}.{seg(NAN_EXP)}.{seg(b'x' * 64)}",
    f"{seg({'alg': 'EdDSA'})}.{seg(b'[' * 10000)}.{seg(b'x' * 64)}",
    f"{seg({'alg': 'EdDSA'})}.{seg(claims())}==.{seg(b'x' * 64)}",  # padding is not raw base64url
])
def test_malformed_tokens_are_refused_as_malformed(token):
    assert refused(token).reason == "malformed"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(st.text(alphabet="AZaz09-_", max_size=40), min_size=1,
                                                 max_size=5).map(".".join)))
def test_any_input_is_either_admitted_or_refused_never_another_error(text):
    try:
        verify(text)
    except TokenRefused:
        pass
