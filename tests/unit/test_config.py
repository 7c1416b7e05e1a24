"""Configuration: defaults, YAML, PLEXD_* environment, flags, sources, and the precise errors."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plexd.base.errors import ConfigError
from plexd.base.gojson import format_duration
from plexd.cli import main
from plexd.config import settings as cfg


def load(tmp_path, text=None, env=None, flags=None):
    path = None
    if text is not None:
        path = tmp_path / "config.yaml"
        path.write_text(text)
    return cfg.load(str(path) if path else None, env=env or {}, flags=flags)


def test_defaults_follow_the_seed_and_decisions():
    c = cfg.load(env={"PLEXD_CONFIG": ""})
    assert c.mode == "node" and c.log_level == "info" and c.data_dir == "/var/lib/plexd"
    assert (c.mesh.interface, c.mesh.listen_port, c.mesh.mtu) == ("plexd0", 51820, 1420)
    assert (c.mesh.userspace_implementation, c.mesh.backend) == ("wireguard-go", "auto")
    assert c.token.file == "/etc/plexd/bootstrap-token" and c.token.env == "PLEXD_BOOTSTRAP_TOKEN"
    assert c.registration.max_wait == 300
    assert c.heartbeat.interval == 30 and c.reconcile.interval == 60
    assert (c.sse.backoff_base, c.sse.backoff_max, c.sse.jitter) == (1, 60, 0.25)
    assert (c.sse.idle_timeout, c.sse.polling_after) == (90, 300)
    assert c.shutdown.deregister is True and c.shutdown.drain == 30
    assert c.actions.max_concurrent == 5 and c.actions.timeout == 600
    assert c.hooks.dir == "/etc/plexd/hooks.d"
    assert c.node_api.socket_path == "/var/run/plexd/api.sock"
    assert c.policy.enabled is True and c.nat_traversal.stun_servers == ()
    assert all(source == "default" for _, _, source in c.items())


def test_default_file_missing_is_fine_but_a_named_one_is_not(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist"):
        cfg.load(str(tmp_path / "nope.yaml"), env={})
    with pytest.raises(ConfigError, match=r"nope2.yaml does not exist"):
        cfg.load(env={"PLEXD_CONFIG": str(tmp_path / "nope2.yaml")})


def test_yaml_file_values_and_sources(tmp_path):
    c = load(tmp_path, """
api:
  url: https://cp.example.com/
  tls: {ca_file: /etc/plexd/ca.pem, insecure_skip_verify: true}
  allow_insecure: true
mode: bridge
mesh: {interface: wg7, listen_port: 51999}
registration:
  hostname: web-01
  metadata: {rack: r1, slot: 4}
  max_wait: 1m30s
reconcile: {interval: 1500ms}
nat_traversal: {stun_servers: ["stun.example.com:3478"]}
hooks:
""")
    assert c.api.url == "https://cp.example.com/" and c.api.tls.insecure_skip_verify is True
    assert c.api.tls.ca_file == "/etc/plexd/ca.pem"
    assert c.mode == "bridge" and c.mesh.interface == "wg7" and c.mesh.listen_port == 51999
    assert c.registration.metadata == {"rack": "r1", "slot": "4"}
    assert c.registration.max_wait == 90 and c.reconcile.interval == pytest.approx(1.5)
    assert c.nat_traversal.stun_servers == ("stun.example.com:3478",)
    assert c.hooks.dir == "/etc/plexd/hooks.d"  # an empty group keeps its defaults
    src = f"file {tmp_path / 'config.yaml'}"
    assert c.source_of("mesh.interface") == src and c.source_of("mesh.mtu") == "default"
    assert c.config_file == str(tmp_path / "config.yaml")


def test_reconcile_interval_has_a_one_second_minimum(tmp_path):
    with pytest.raises(ConfigError, match=r"reconcile.interval: '150ms' from file .* too small \(minimum 1s\)"):
        load(tmp_path, "reconcile: {interval: 150ms}")


@pytest.mark.parametrize("text, env, why", [
    ('hooks: {dir: ""}', {}, r"hooks\.dir: .* must not be empty"),  # was the working directory: "/" under systemd
    ("hooks: {dir: hooks.d}", {}, r"hooks\.dir: .* must be an absolute path"),
    (None, {"PLEXD_HOOKS_DIR": ""}, r"hooks\.dir: .*env PLEXD_HOOKS_DIR.* must not be empty"),
    ("sse: {jitter: .nan}", {}, r"sse\.jitter: .* is not a number"),  # nan passed every min/max check
    (None, {"PLEXD_NODE_API_RATE_LIMIT": "inf"}, r"node_api\.rate_limit: .* is not a number"),
])
def test_a_hooks_dir_that_is_not_an_absolute_path_and_a_number_that_is_not_finite_are_refused(tmp_path, text,
                                                                                               env, why):
    with pytest.raises(ConfigError, match=why):
        load(tmp_path, text, env=env)


def test_api_short_form(tmp_path):
    c = load(tmp_path, "api: https://cp.example.com\n")
    assert c.api.url == "https://cp.example.com" and c.api.tls.insecure_skip_verify is False


def test_env_overrides_file_and_flags_override_env(tmp_path):
    text = "api: https://file:1\nmesh: {listen_port: 1000}\nlog_level: warning\n"
    env = {"PLEXD_API": "https://env:2", "PLEXD_MESH_LISTEN_PORT": "2000", "PLEXD_SHUTDOWN_DEREGISTER": "no",
           "PLEXD_NAT_TRAVERSAL_STUN_SERVERS": "a:1, b:2", "PLEXD_REGISTRATION_METADATA": "x=1,y=2",
           "PLEXD_HEARTBEAT_INTERVAL": "1m30s", "PLEXD_BOOTSTRAP_TOKEN": "ignored: not a config key"}
    c = load(tmp_path, text, env=env, flags={"api": "https://flag:3", "log_level": None, "data_dir": "/tmp/d"})
    assert c.api.url == "https://flag:3" and c.source_of("api.url") == "flag --api"
    assert c.mesh.listen_port == 2000 and c.source_of("mesh.listen_port") == "env PLEXD_MESH_LISTEN_PORT"
    assert c.log_level == "warning" and c.source_of("log_level").startswith("file ")
    assert c.data_dir == "/tmp/d" and c.source_of("data_dir") == "flag --data-dir"
    assert c.shutdown.deregister is False
    assert c.nat_traversal.stun_servers == ("a:1", "b:2")
    assert c.registration.metadata == {"x": "1", "y": "2"}
    assert c.heartbeat.interval == 90


def test_plexd_api_url_beats_plexd_api():
    c = cfg.load(env={"PLEXD_API": "https://short:1", "PLEXD_API_URL": "https://long:2", "PLEXD_CONFIG": ""})
    assert c.api.url == "https://long:2" and c.source_of("api.url") == "env PLEXD_API_URL"


def test_every_key_has_an_env_name():
    names = {key: name for name, key in cfg.ENV_NAMES.items() if name != "PLEXD_API"}
    assert set(names) == {key for key, _, _ in cfg.Config().items()}
    assert names["mesh.interface"] == "PLEXD_MESH_INTERFACE"
    assert names["reconcile.interval"] == "PLEXD_RECONCILE_INTERVAL"
    assert names["node_api.http_token_file"] == "PLEXD_NODE_API_HTTP_TOKEN_FILE"


@pytest.mark.parametrize("text,expected", [
    ("mesh:\n  interfce: wg0\n", "unknown config key 'mesh.interfce'; did you mean 'mesh.interface'?"),
    ("hearbeat: {interval: 5s}\n", "unknown config key 'hearbeat'; did you mean 'heartbeat'?"),
    ("reconcile: {intervall: 5s}\n", "unknown config key 'reconcile.intervall'; did you mean 'reconcile.interval'?"),
    ("api: {url: http://x:1, tls: {cafile: x}}\n", "unknown config key 'api.tls.cafile'; did you mean "
                                                   "'api.tls.ca_file'?"),
    ("zzzzzz: 1\n", "unknown config key 'zzzzzz'"),
])
def test_unknown_key_is_named_with_the_closest_suggestion(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert expected in str(info.value) and str(tmp_path / "config.yaml") in str(info.value)


@pytest.mark.parametrize("text,expected", [
    ("mesh: {listen_port: abc}", "mesh.listen_port: 'abc' from file"),
    ("mesh: {listen_port: 70000}", "mesh.listen_port: 70000 from file"),
    ("mesh: {mtu: true}", "mesh.mtu: True from file"),
    ("mode: router", "mode: 'router' from file"),
    ("shutdown: {deregister: maybe}", "shutdown.deregister: 'maybe' from file"),
    ("heartbeat: {interval: 5 minutes}", "heartbeat.interval: '5 minutes' from file"),
    ("heartbeat: {interval: 30}", "heartbeat.interval: 30 from file"),
    ("nat_traversal: {stun_servers: stun.example.com}", "nat_traversal.stun_servers: 'stun.example.com'"),
    ("registration: {metadata: [a, b]}", "registration.metadata: ['a', 'b']"),
    ("mesh: 5", "mesh must be a mapping"),
    ("api: {url: ftp://x}", "api.url: 'ftp://x' from file"),
    ("mesh: {interface: a-very-long-interface-name}", "mesh.interface"),
])
def test_wrong_type_or_value_names_key_and_value(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert expected in str(info.value)


def test_bad_duration_from_env_names_variable():
    with pytest.raises(ConfigError) as info:
        cfg.load(env={"PLEXD_RECONCILE_INTERVAL": "soon", "PLEXD_CONFIG": ""})
    assert str(info.value).startswith("reconcile.interval: 'soon' from env PLEXD_RECONCILE_INTERVAL is not a valid "
                                      "duration")


def test_wrong_type_from_flag():
    with pytest.raises(ConfigError, match=r"api.url: 'cp.example.com' from flag --api is not a usable http"):
        cfg.load(env={"PLEXD_CONFIG": ""}, flags={"api": "cp.example.com"})


@pytest.mark.parametrize("url,problem", [
    ("http://exa mple.com", "contains spaces"), ("http://[::1", "Invalid IPv6 URL"),
    ("http://host:99999", "Port out of range"), ("http://:80", "no host name"), ("ftp://x", "scheme"),
])
def test_unusable_api_urls(url, problem):
    with pytest.raises(ConfigError) as info:
        cfg.load(env={"PLEXD_CONFIG": ""}, flags={"api": url})
    assert problem in str(info.value) and repr(url) in str(info.value)


def test_secret_value_never_printed_in_errors_or_show(tmp_path):
    c = load(tmp_path, "token: {value: plx_enroll_supersecret}")
    shown = cfg.display_value("token.value", c.token.value)
    assert "supersecret" not in shown and shown.startswith("<hidden fp:")
    # The token written where the token group goes (an easy slip): refused without echoing it.
    with pytest.raises(ConfigError, match="token must be a mapping") as info:
        load(tmp_path, "token: plx_enroll_supersecret")
    assert "supersecret" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load(tmp_path, "token: {value: [plx_enroll_supersecret]}")
    assert "supersecret" not in str(info.value)


def test_backoff_base_above_max_is_refused():
    with pytest.raises(ConfigError, match=r"sse\.backoff_base"):
        cfg.load(env={"PLEXD_SSE_BACKOFF_BASE": "2m", "PLEXD_CONFIG": ""})


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"config.yaml: line 3 column 7 is not valid YAML: mapping values"):
        load(tmp_path, "mesh:\n  interface: x\n   bad: indent\n")


def test_unreadable_config_file(tmp_path):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(ConfigError, match=r"cannot read config file .*dir.yaml: Is a directory \(errno 21\)"):
        cfg.load(str(d), env={})


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["ms", "s", "m", "h"]))
def test_go_durations_round_trip_through_env(n, unit):
    text = f"{n}{unit}"
    seconds = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit] * n
    if seconds < 1:
        return
    c = cfg.load(env={"PLEXD_HEARTBEAT_INTERVAL": text, "PLEXD_CONFIG": ""})
    assert c.heartbeat.interval == pytest.approx(seconds)
    assert cfg.display_value("heartbeat.interval", c.heartbeat.interval) == format_duration(seconds)


def test_config_show_human_and_json(tmp_path, capsys, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("mesh: {interface: wg9}\ntoken: {value: sekrit-token}\n")
    monkeypatch.setenv("PLEXD_HEARTBEAT_INTERVAL", "45s")
    assert main(["--config", str(path), "config", "show", "--api", "https://cp:1"]) == 0
    out = capsys.readouterr().out
    assert f"# config file: {path}" in out
    assert "mesh.interface" in out and "wg9" in out and f"(file {path})" in out
    assert "45s  (env PLEXD_HEARTBEAT_INTERVAL)" in out
    assert "https://cp:1  (flag --api)" in out
    assert "sekrit" not in out
    assert main(["--config", str(path), "config", "show", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mesh.interface"] == {"value": "wg9", "source": f"file {path}"}
    assert doc["heartbeat.interval"] == {"value": "45s", "source": "env PLEXD_HEARTBEAT_INTERVAL"}
    assert doc["mesh.listen_port"] == {"value": 51820, "source": "default"}
    assert "sekrit" not in json.dumps(doc)


def test_cli_config_error_is_one_line_exit_1(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("mesh: {listen_port: nope}\n")
    assert main(["--config", str(path), "status"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plexd: mesh.listen_port: 'nope'") and "Traceback" not in err


def test_env_is_read_from_process_by_default(monkeypatch):
    monkeypatch.setenv("PLEXD_MODE", "bridge")
    monkeypatch.setenv("PLEXD_CONFIG", os.devnull)
    assert cfg.load().mode == "bridge"


def test_policy_mesh_range_must_be_cidrs(tmp_path):
    assert load(tmp_path, "policy: {mesh_range: [10.200.0.0/16, 'fd00::/64']}").policy.mesh_range == (
        "10.200.0.0/16", "fd00::/64")
    with pytest.raises(ConfigError, match=r"policy.mesh_range: .* from file .*: '10.300.0.0/16' is not a CIDR"):
        load(tmp_path, "policy: {mesh_range: [10.300.0.0/16]}")
    with pytest.raises(ConfigError, match=r"policy.mesh_range: .* must name at least one CIDR"):
        load(tmp_path, "policy: {mesh_range: []}")


@pytest.mark.parametrize("listen", ["0.0.0.0:9586", "10.100.0.1:9586", "[::]:9586", "node.example:9586"])
def test_metrics_beyond_loopback_needs_a_token_file(tmp_path, listen):
    with pytest.raises(ConfigError, match=r"metrics\.listen .* is not a loopback address: set metrics\.token_file"):
        load(tmp_path, f"metrics: {{enabled: true, listen: '{listen}'}}\n")
    c = load(tmp_path, f"metrics: {{enabled: true, listen: '{listen}', token_file: /etc/plexd/metrics.token}}\n")
    assert c.metrics.token_file == "/etc/plexd/metrics.token"
    for local in ("127.0.0.1:9586", "[::1]:9586", "localhost:9586"):
        assert load(tmp_path, f"metrics: {{enabled: true, listen: '{local}'}}\n").metrics.listen == local


def test_log_forwarding_ships_only_plexd_and_warnings_unless_asked():
    c = cfg.load(env={"PLEXD_CONFIG": ""})
    assert c.telemetry.logs.units == ("plexd.service", "plexd-wireguard-*.scope")
    assert c.telemetry.logs.priority == "warning"
    assert c.metrics.listen.startswith("127.0.0.1:") and c.metrics.token_file == ""


@pytest.mark.parametrize("value,why", [
    ("['not base64!']", r"upgrade.release_keys: .* entry 0 'not base64!' is not base64"),
    ("['AAAA']", r"upgrade.release_keys: .* entry 0 'AAAA' is 3 bytes; an Ed25519 public key is 32"),
    ("'one-string'", r"upgrade.release_keys: 'one-string' from file .* is not a list of strings"),
])
def test_release_keys_are_checked_naming_the_bad_entry(tmp_path, value, why):
    with pytest.raises(ConfigError, match=why):
        load(tmp_path, f"upgrade: {{release_keys: {value}}}\n")


def test_release_keys_and_allow_downgrade_load(tmp_path):
    import base64

    key = base64.b64encode(bytes(32)).decode()
    loaded = load(tmp_path, f"upgrade: {{release_keys: ['{key}'], allow_downgrade: true}}\n")
    assert loaded.upgrade.release_keys == (key,) and loaded.upgrade.allow_downgrade is True
    assert load(tmp_path).upgrade.release_keys == () and load(tmp_path).upgrade.allow_downgrade is False


def test_the_route_guard_settings_are_checked(tmp_path):
    c = load(tmp_path, "mesh: {allow_routes: [192.168.7.0/24, 'fd00:7::/64'], max_route_percent: 2.5}",
             env={"PLEXD_MESH_ROUTE_TABLE": "700"})
    assert c.mesh.allow_routes == ("192.168.7.0/24", "fd00:7::/64") and c.mesh.max_route_percent == 2.5
    assert c.mesh.route_table == 700 and c.mesh.route_rule_priority == 5182
    assert load(tmp_path).mesh.allow_routes == ()
    with pytest.raises(ConfigError, match=r"mesh.allow_routes: .*'192.168.300.0/24' is not a CIDR"):
        load(tmp_path, "mesh: {allow_routes: [192.168.300.0/24]}")
    with pytest.raises(ConfigError, match=r"mesh.route_table: 254 from file .* is reserved"):
        load(tmp_path, "mesh: {route_table: 254}")
    with pytest.raises(ConfigError, match=r"mesh.max_route_percent: 0 from file .* too small"):
        load(tmp_path, "mesh: {max_route_percent: 0}")
    with pytest.raises(ConfigError, match=r"mesh.route_rule_priority: 32766 from file .* too large"):
        load(tmp_path, "mesh: {route_rule_priority: 32766}")


def test_an_insecure_control_plane_needs_allow_insecure(tmp_path):
    with pytest.raises(ConfigError, match=r"api.url http://cp:8080 \(file .*\) is plain http://.*"
                                          r"set api.allow_insecure: true"):
        load(tmp_path, "api: http://cp:8080\n")
    with pytest.raises(ConfigError, match=r"api.url http://cp:8080 \(env PLEXD_API\) is plain http://"):
        load(tmp_path, env={"PLEXD_API": "http://cp:8080"})
    with pytest.raises(ConfigError, match=r"api.tls.insecure_skip_verify .* set api.allow_insecure: true"):
        load(tmp_path, "api: {url: https://cp, tls: {insecure_skip_verify: true}}\n")
    c = load(tmp_path, "api: {url: http://cp:8080, allow_insecure: true}\n")
    assert c.api.allow_insecure and cfg.insecure_control_plane(c) == "plain http:// to http://cp:8080"
    c = load(tmp_path, env={"PLEXD_API": "https://cp", "PLEXD_API_TLS_INSECURE_SKIP_VERIFY": "true",
                            "PLEXD_API_ALLOW_INSECURE": "yes"})
    assert "without certificate verification" in cfg.insecure_control_plane(c)
    assert cfg.insecure_control_plane(load(tmp_path, "api: https://cp\n")) == ""
