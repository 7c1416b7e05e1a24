"""The node secret's derivations use HKDF-SHA256 written with the standard library (plexd.identity.node_secret):
it gives RFC 5869's own test vectors, and what `cryptography`'s HKDF gives for any input."""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given
from hypothesis import strategies as st

from plexd.identity.node_secret import bearer, hkdf_sha256


def test_rfc_5869_test_cases_1_and_3():
    ikm = bytes([0x0B] * 22)
    assert hkdf_sha256(ikm, bytes(range(0xF0, 0xFA)), salt=bytes(range(13)), length=42).hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")
    assert hkdf_sha256(ikm, b"", length=42).hex() == (
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8")


@given(st.binary(max_size=80), st.binary(max_size=40), st.integers(min_value=1, max_value=100))
def test_the_same_bytes_as_cryptography(ikm, info, length):
    theirs = HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(ikm)
    assert hkdf_sha256(ikm, info, length=length) == theirs


def test_the_bearer_is_derived_from_the_node_secret():
    derived = bearer("nsk-example", "hkdf-sha256")
    assert derived != "nsk-example" and derived == bearer("nsk-example", "hkdf-sha256")
    assert bearer("nsk-example", "") == "nsk-example"  # compatibility mode: the secret itself
