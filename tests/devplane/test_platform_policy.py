"""Spec policy rules as the platform's CIDR rules (plexd.devplane.platform_policy), one rule at a time."""

from __future__ import annotations

import pytest

from plexd.devplane.platform_policy import policy_block, translate_rule

NODES = {"n_a": "10.100.0.1", "n_b": "10.100.0.2"}


def tr(**rule):
    return translate_rule(rule, NODES.get)


def test_node_ids_become_their_mesh_address_and_star_the_family():
    assert tr(src="n_a", dst="*", port=22, protocol="tcp", action="allow") == [
        {"action": "allow", "protocol": "tcp", "source_cidr": "10.100.0.1/32", "destination_cidr": "0.0.0.0/0",
         "ports": {"from": 22, "to": 22}}]
    assert tr(src="*", dst="fd00::/64", protocol="icmp", action="deny") == [
        {"action": "deny", "protocol": "icmp", "source_cidr": "::/0", "destination_cidr": "fd00::/64"}]


def test_any_protocol_with_a_port_is_tcp_and_udp():
    rules = tr(src="*", dst="n_b", port=53, protocol="")
    assert [r["protocol"] for r in rules] == ["tcp", "udp"]
    assert all(r["ports"] == {"from": 53, "to": 53} and r["action"] == "allow" for r in rules)


def test_a_cidr_is_normalised():
    assert tr(src="10.100.0.7/24", dst="*")[0]["source_cidr"] == "10.100.0.0/24"


@pytest.mark.parametrize("rule", [
    {"src": "n_gone", "dst": "*"},  # a node that is not registered matches nothing
    {"src": "*", "dst": "*", "protocol": "icmp", "port": 5},
    {"src": "*", "dst": "*", "protocol": "sctp"},
    {"src": "*", "dst": "*", "action": "log"},
    {"src": "*", "dst": "*", "port": 70000},
    {"src": "10.0.0.0/8", "dst": "fd00::/8"},
    {"src": "", "dst": "*"},
    "not a rule",
])
def test_rules_that_match_nothing_are_left_out(rule):
    assert translate_rule(rule, NODES.get) == []


def test_no_policy_is_null_and_the_fingerprint_follows_the_rules():
    assert policy_block([], NODES.get) is None
    one = policy_block([{"id": "p", "rules": [{"src": "*", "dst": "*"}]}], NODES.get)
    same = policy_block([{"id": "q", "rules": [{"src": "*", "dst": "*", "port": 0, "protocol": ""}]}], NODES.get)
    other = policy_block([{"id": "p", "rules": [{"src": "n_a", "dst": "*"}]}], NODES.get)
    assert one == same and one["fingerprint"] != other["fingerprint"]
    assert one["revision_id"] != other["revision_id"]
    assert policy_block([{"id": "p", "rules": []}], NODES.get)["rules"] == []
