"""The route write's own network parser (plexd.machine.rtnl, `inet_pton` for speed) reads exactly what
`ipaddress.ip_network(strict=False)` reads, and refuses what it refuses with a ValueError naming the value."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plexd.machine.rtnl import _parsed_network, route_write


def _expected(text: str) -> tuple[int, int, bytes] | None:
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None
    return (socket.AF_INET if net.version == 4 else socket.AF_INET6), net.prefixlen, net.network_address.packed


_V4 = st.ip_addresses(v=4).map(str)
_V6 = st.ip_addresses(v=6).map(str)
_NETWORKS = st.one_of(
    st.tuples(_V4, st.integers(0, 32)).map(lambda t: f"{t[0]}/{t[1]}"),
    st.tuples(_V6, st.integers(0, 128)).map(lambda t: f"{t[0]}/{t[1]}"),
    _V4, _V6)


@given(_NETWORKS)
def test_every_network_reads_as_ipaddress_reads_it(text):
    assert _parsed_network(text) == _expected(text)


@given(st.one_of(st.text(max_size=45), st.tuples(_V4, st.text(max_size=5)).map("/".join)))
def test_anything_else_is_refused_as_ipaddress_refuses_it(text):
    expected = _expected(text)
    if expected is not None:  # the text happened to be a network: then both read it alike
        assert _parsed_network(text) == expected
        return
    with pytest.raises(ValueError, match="is not an IP network"):
        _parsed_network(text)


@pytest.mark.parametrize("bad", ["10.0.0.1/33", "10.0.0.1/-1", "10.0.0.1/ 8", "fd00::1/129", "10.0.0/24", "mesh"])
def test_a_route_to_no_network_names_the_value(bad):
    with pytest.raises(ValueError, match="is not an IP network") as e:
        route_write(True, bad, 3, 51820)
    assert repr(bad) in str(e.value)
