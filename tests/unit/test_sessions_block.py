"""The desired `sessions` block: null touches nothing, [] tears everything down, each bad entry is refused alone
with a reason naming the field, and the older events are deltas on the same sessions."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexd.base.errors import WireFormatError
from plexd.state.sessions_block import (
    MAX_SESSIONS,
    SshTarget,
    TcpTarget,
    live,
    parse_sessions,
    revoked_session_id,
    setup_event_session,
)

EXPIRES = "2099-11-24T12:30:00Z"  # far ahead: an expired entry holds no slot


def ssh(sid="ses_1", **target):
    return {"session_id": sid, "jti": sid, "kind": "ssh", "expires_at": EXPIRES,
            "target": {"ssh": {"user": "deploy", **target}}, "idle_timeout_seconds": 900}


def test_null_and_absent_mean_not_populated_and_an_empty_list_means_none():
    assert parse_sessions(None) is None
    empty = parse_sessions([])
    assert empty is not None and empty.by_id == {} and empty.rejected == ()


def test_the_three_kinds_parse_into_their_targets():
    got = parse_sessions([
        ssh(allowed_commands=["systemctl status nginx"]),
        {"session_id": "ses_2", "kind": "tcp", "expires_at": EXPIRES,
         "target": {"tcp": {"host": "127.0.0.1", "port": 5432}}},
        {"session_id": "ses_3", "kind": "k8s", "expires_at": EXPIRES,
         "target": {"k8s": {"user": "alice@example.com", "impersonate_groups": ["dev"]}}},
    ])
    assert got.rejected == ()
    assert got.by_id["ses_1"].target == SshTarget("deploy", ("systemctl status nginx",))
    assert got.by_id["ses_1"].idle_timeout == 900
    assert got.by_id["ses_2"].target == TcpTarget("127.0.0.1", 5432)
    assert got.by_id["ses_3"].target.impersonate_groups == ("dev",)
    assert got.by_id["ses_1"].expires_at == 4099206600.0


@pytest.mark.parametrize("entry, field", [
    (ssh(user="../root"), "target.ssh.user"),
    (ssh(user="a/b"), "target.ssh.user"),
    (ssh(user="ro\0ot"), "target.ssh.user"),
    (ssh(allowed_commands="id"), "allowed_commands"),  # malformed list: fail closed, never "any command"
    (ssh(allowed_commands=[1]), "allowed_commands"),
    ({**ssh(), "kind": "vnc"}, "kind"),
    ({**ssh(), "target": {"ssh": {"user": "deploy"}, "tcp": {"host": "x", "port": 1}}}, "target"),
    ({**ssh(), "jti": "ses_other"}, "jti"),
    ({**ssh(), "expires_at": "tomorrow"}, "expires_at"),
    ({**ssh(), "idle_timeout_seconds": -1}, "idle_timeout_seconds"),
    ({"session_id": "t", "kind": "tcp", "expires_at": EXPIRES, "target": {"tcp": {"host": "a b", "port": 1}}},
     "host"),
    ({"session_id": "t", "kind": "tcp", "expires_at": EXPIRES, "target": {"tcp": {"host": "h", "port": 70000}}},
     "port"),
])
def test_a_bad_entry_is_refused_alone_naming_the_field(entry, field):
    got = parse_sessions([entry, ssh("ses_ok")])
    assert list(got.by_id) == ["ses_ok"]
    assert len(got.rejected) == 1 and field in got.rejected[0][1]


def test_duplicates_and_the_eleventh_session_are_refused_and_the_rest_kept():
    got = parse_sessions([ssh("dup"), ssh("dup"), *(ssh(f"s{i}", user=f"u{i}") for i in range(MAX_SESSIONS))])
    assert len(got.by_id) == MAX_SESSIONS
    reasons = [r for _, r in got.rejected]
    assert reasons[0] == "duplicate session id" and "more than 10 sessions" in reasons[1]


def test_a_block_that_is_not_a_list_is_a_wire_format_error():
    with pytest.raises(WireFormatError, match="sessions"):
        parse_sessions({"ses_1": ssh()})


def test_older_events_are_deltas_on_the_same_sessions():
    block = parse_sessions([ssh("ses_1")])
    added = block.with_session(setup_event_session(
        {"session_id": "legacy", "target_host": "10.0.0.5", "target_port": 22, "authorized_key": "ssh-ed25519 A",
         "expires_at": EXPIRES}))
    assert added.by_id["legacy"].target == TcpTarget("10.0.0.5", 22)
    gone = added.without(revoked_session_id({"session_id": "ses_1", "revoked_at": EXPIRES}))
    assert list(gone.by_id) == ["legacy"]


def test_live_leaves_out_expired_sessions_and_round_trips_through_the_wire_shape():
    block = parse_sessions([ssh("ses_1"), {**ssh("old"), "expires_at": "2020-01-01T00:00:00Z"}])
    assert [s.session_id for s in live(block, 1795500000.0)] == ["ses_1"]
    assert parse_sessions(block.to_wire()).by_id == block.by_id


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5),
                    max_leaves=30))
def test_any_json_value_parses_or_is_refused_by_name(value):
    try:
        parse_sessions(value)
    except WireFormatError:
        pass


def test_the_mirror_keeps_the_sessions_so_a_restart_serves_the_same_ones():
    from plexd.state.desired import DesiredState
    from plexd.state.model import State

    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.1.0.1")
    desired = base.with_state(State.from_wire({"sessions": [ssh("ses_1"), ssh("ses_2")]})).without_session("ses_2")
    restored = DesiredState.from_json(desired.to_json())
    assert set(restored.sessions.by_id) == {"ses_1"}  # the revoked one stays gone
    assert restored.sessions.by_id["ses_1"] == desired.sessions.by_id["ses_1"]
    assert DesiredState.from_json(base.to_json()).sessions is None  # never populated stays "not populated"


def test_socket_marks_are_distinct_stable_and_found_from_the_ids_alone():
    from plexd.state.sessions_block import MARK_BASE, socket_marks

    ids = [f"ses_{i}" for i in range(2000)]  # far past any block: 16 bits of hash must collide here
    marks = socket_marks(ids)
    assert len(set(marks.values())) == len(ids)
    assert all(m & 0xFFFF0000 == MARK_BASE for m in marks.values())
    assert socket_marks(reversed(ids)) == marks  # the order they are listed in does not matter
    alone = socket_marks(["ses_1"])["ses_1"]
    assert alone == MARK_BASE | int.from_bytes(hashlib.sha256(b"ses_1").digest()[:2], "big")


def test_one_user_cannot_take_every_session_of_the_node():
    from plexd.state.sessions_block import MAX_PER_USER

    block = [ssh(f"ses_{i}") for i in range(MAX_PER_USER + 1)] + [ssh("ses_other", user="ops")]
    parsed = parse_sessions(block)
    assert len(parsed.by_id) == MAX_PER_USER + 1 and "ses_other" in parsed.by_id
    assert parsed.rejected == ((f"ses_{MAX_PER_USER}", f"more than {MAX_PER_USER} sessions for user deploy"),)


def test_entries_past_their_expiry_hold_no_slot_of_the_node_or_the_user():
    # The control plane may list expired entries until it prunes them: they are never served, so a new session
    # must not be refused for them.
    from plexd.state.sessions_block import MAX_PER_USER, MAX_SESSIONS, Session, TcpTarget

    expired = [{**ssh(f"ses_old{i}"), "expires_at": "2001-01-01T00:00:00Z"} for i in range(MAX_SESSIONS)]
    parsed = parse_sessions([*expired, *(ssh(f"ses_{i}") for i in range(MAX_PER_USER))])
    assert parsed.rejected == ()
    assert len(parsed.by_id) == MAX_SESSIONS + MAX_PER_USER
    full = parse_sessions([*expired, *(ssh(f"ses_{i}", user=f"u{i}") for i in range(MAX_SESSIONS))])
    assert full.rejected == ()
    added = full.with_session(Session("ses_new", "tcp", TcpTarget("127.0.0.1", 5432), 4102444800.0))
    assert "ses_new" not in added.by_id and "more than" in added.rejected[-1][1]  # ten unexpired: the cap holds
    room = parse_sessions(expired).with_session(Session("ses_new", "tcp", TcpTarget("127.0.0.1", 5432), 4102444800.0))
    assert "ses_new" in room.by_id and room.rejected == ()


def test_expired_entries_are_bounded_too():
    # They hold no slot, but each would still get the firewall's session gate: a control plane that never prunes
    # must not grow the ruleset without end.
    from plexd.state.sessions_block import MAX_SESSIONS

    expired = [{**ssh(f"ses_old{i}"), "expires_at": "2001-01-01T00:00:00Z"} for i in range(MAX_SESSIONS * 3)]
    parsed = parse_sessions([*expired, ssh("ses_live")])
    assert len(parsed.by_id) == MAX_SESSIONS + 1 and "ses_live" in parsed.by_id
    assert len(parsed.rejected) == MAX_SESSIONS * 2 and all("expired" in why for _, why in parsed.rejected)


def test_the_event_path_keeps_no_expired_entry_either():
    from plexd.state.sessions_block import Session, TcpTarget

    block = parse_sessions([ssh("ses_live")])
    for i in range(50):  # ssh_session_setup events for sessions already past their expiry
        block = block.with_session(Session(f"ses_old{i}", "tcp", TcpTarget("127.0.0.1", 22), 978307200.0))
    assert list(block.by_id) == ["ses_live"]


def k8s(user="alice@example.com", groups=("dev",)):
    return {"session_id": "ses_k", "kind": "k8s", "expires_at": EXPIRES,
            "target": {"k8s": {"user": user, "impersonate_groups": list(groups)}}}


@pytest.mark.parametrize("user, groups, reason", [
    # the control plane's values go into the API server's request head as they are: a CR LF would add a header
    ("alice\r\nImpersonate-Group: system:masters", (),
     "impersonation user 'alice\\r\\nImpersonate-Group: system:masters' has a control character"),
    ("alice", ("dev", "x\r\ny"), "impersonation group 'x\\r\\ny' has a control character"),
    ("alice", ("x\ny",), "impersonation group 'x\\ny' has a control character"),
    ("alice\x00", (), "impersonation user 'alice\\x00' has a control character"),
    ("alice", ("dev\x85",), "has a control character"),  # C1 (NEL)
    ("alice", ("dev\u2028",), "has a character that is not printable"),
    (" alice", (), "impersonation user ' alice' starts or ends with white space"),
    ("alice", ("dev\t",), "has a control character"),
])
def test_a_k8s_entry_whose_impersonation_cannot_go_into_a_header_as_it_is_is_refused_naming_it(user, groups, reason):
    got = parse_sessions([k8s(user, groups), ssh("ses_ok")])
    assert list(got.by_id) == ["ses_ok"]
    assert len(got.rejected) == 1 and reason in got.rejected[0][1], got.rejected


def test_a_k8s_user_outside_latin1_is_a_valid_identity():
    # Kubernetes names are UTF-8 (client-go sends them as such): refused only for what would break the head.
    got = parse_sessions([k8s("爱丽丝@example.com", ("équipe",))])
    assert got.rejected == () and got.by_id["ses_k"].target.user == "爱丽丝@example.com"
