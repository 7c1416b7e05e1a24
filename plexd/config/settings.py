"""plexd configuration: defaults, then the YAML file, then ``PLEXD_*`` environment variables, then flags.

File: ``--config PATH``, else ``$PLEXD_CONFIG``, else ``/etc/plexd/config.yaml`` (a missing default file just
means "all defaults"; a missing file you named is an error). Keys are the snake_case keys of the Go agent's
README (docs/decisions.md, Config)::

    api: https://cp.example.com           # or the long form:
    api:
      url: https://cp.example.com
      tls: {ca_file: /etc/plexd/ca.pem, insecure_skip_verify: false}
      allow_insecure: false               # needed for http:// or insecure_skip_verify (labs only)
    mode: node                            # node | bridge
    log_level: info                       # debug | info | warning | error
    data_dir: /var/lib/plexd
    mesh: {interface: plexd0, listen_port: 51820, mtu: 1420, userspace_implementation: wireguard-go,
           backend: auto,                 # auto | kernel | userspace
           allow_exit_routes: false,      # let a peer carry default routes (exit node)
           allow_routes: [],              # prefixes the route guard lets through (site-to-site over a LAN)
           max_route_percent: 0.1,        # of each address family peers may route, however split
           route_table: 5182, route_rule_priority: 5182,    # mesh routes' own table, and its rule
           path_probe_interval: 60s}        # a relayed peer tries its direct path again (fallback_endpoint)
    token: {value: "", file: /etc/plexd/bootstrap-token, env: PLEXD_BOOTSTRAP_TOKEN, use_metadata: false,
            metadata_url: "http://169.254.169.254"}
    registration: {hostname: "", metadata: {}, max_wait: 5m}
    reconcile: {interval: 60s,            # the live machine diffed against the desired state
                pull_interval: 10m}       # the longest a connected event stream stands in for the state pull
    heartbeat: {interval: 30s}
    sse: {backoff_base: 1s, backoff_max: 60s, jitter: 0.25, idle_timeout: 90s, polling_after: 5m,
          reconnect_spread: 5s}
    shutdown: {deregister: true, drain: 30s}
    nat_traversal: {enabled: true, stun_servers: [], refresh_interval: 60s}
    actions: {enabled: true, max_concurrent: 5, timeout: 10m, output_cap: 1048576, kill_grace: 2s,
              local_auth: {require_root: true, group: plexd}}
    hooks: {dir: /etc/plexd/hooks.d, reverify: 5m}
    node_api: {socket_path: /var/run/plexd/api.sock, socket_group: plexd, admin_group: plexd-admin,
               secrets_group: plexd-secrets, http_enabled: false, http_listen: "127.0.0.1:9100",
               http_token_file: "", http_max_connections: 16, http_header_timeout: 5s,
               rate_limit: 100, rate_burst: 200, request_timeout: 10s,
               report_max_entries: 1000, report_max_bytes: 16777216, report_max_entry_bytes: 1048576}
    policy: {enabled: true}
    bridge: {relay: {listen: "0.0.0.0:51821",          # mode bridge: the UDP relay (plexd.bridge)
                     fastpath_address: ""},            # the relay's IPv4 address: forward stable flows in nftables
             site_to_site: {allow_default_route: false},  # a tunnel whose remote subnet is 0.0.0.0/0 or ::/0
             ingress: {listen_address: "0.0.0.0", allowed_sources: [],   # empty: any source may connect
                       idle_timeout: 1h, max_per_source: 64}}   # a source's share of a full port
    access: {enabled: true,                   # SSH/TCP/Kubernetes sessions the control plane grants (plexd.access)
             kubernetes: {url: "", token_file: "", ca_file: ""}}   # empty url: the in-cluster environment, if any
    metrics: {enabled: false, listen: "127.0.0.1:9586",   # Prometheus text format at GET /metrics
              token_file: "", max_connections: 8}       # token_file: bearer auth, needed off loopback
    upgrade: {dir: /opt/plexd/releases, health_deadline: 60s, max_size: 67108864,   # service.upgrade
              release_keys: [], allow_downgrade: false,   # Ed25519 release keys (base64); see README
              release_url: ""}   # platform contract: where releases are published (.../v{version}/plexd-linux-{arch})
    telemetry:                            # reported upstream through an on-disk queue (plexd.telemetry)
      queue_dir: ""                       # where an older version kept telemetry.db (taken over into uplink.db)
      metrics: {enabled: true, collect_interval: 60s, report_interval: 5m, batch_size: 4000,
                queue_max_bytes: 33554432, latency_timeout: 2s, latency_peers: 64}
      logs: {enabled: true, source: auto, files: [], units: [plexd.service, "plexd-wireguard-*.scope"],
             priority: warning, journal_dir: "",
             collect_interval: 10s, report_interval: 30s, batch_size: 200, queue_max_bytes: 67108864}
      audit: {enabled: true, file: /var/log/audit/audit.log, local_actions: true, collect_interval: 5s,
              report_interval: 15s, batch_size: 500, queue_max_bytes: 67108864}

Durations use Go syntax (``30s``, ``1m30s``, ``150ms``) and are stored as float seconds.

Environment: every key has a variable named ``PLEXD_`` + the dotted path with ``.`` → ``_``, upper-cased
(``mesh.listen_port`` → ``PLEXD_MESH_LISTEN_PORT``); ``PLEXD_API`` is short for ``PLEXD_API_URL``. Booleans
accept true/false/1/0/yes/no/on/off, lists are comma-separated, ``registration.metadata`` is ``k=v,k2=v2``.
Unknown ``PLEXD_*`` variables are ignored (hooks and tokens use that prefix too).

Flags: ``--api``, ``--mode``, ``--log-level``, ``--data-dir`` (passed to `load` as ``flags``).

The result is a frozen `Config` tree. Every leaf remembers where its value came from (`Config.source_of`), which
``plexd config show`` prints. Errors are `ConfigError` with one line naming the key, the value and the source.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from plexd.base.errors import ConfigError

DEFAULT_CONFIG_PATH = "/etc/plexd/config.yaml"


MAX_PING_TARGETS = 65_535  # ICMP echo sequence numbers are 16 bits: one per peer probed in a round

def _f(default: Any, kind: str = "", **rules: Any) -> Any:
    """A leaf field: `kind` is how values are parsed (str, int, bool, float, duration, list, map, url), `rules`
    are checks (choices, min, max)."""
    # A secret leaf (secret=True) is left out of the repr: a Config printed or logged never shows it.
    return field(default=default, repr=not rules.get("secret"), metadata={"kind": kind or type(default).__name__,
                                                                          **rules})


@dataclass(frozen=True)
class TlsConfig:
    """TLS to the control plane."""

    ca_file: str = _f("")
    insecure_skip_verify: bool = _f(False)


@dataclass(frozen=True)
class ApiConfig:
    """Where the control plane is."""

    url: str = _f("", "url")
    tls: TlsConfig = field(default_factory=TlsConfig)
    # Plain http:// or tls.insecure_skip_verify: anyone on the path could read the node secret and forge the
    # state. Refused unless this is set (labs, the devplane demo); a warning at every start when it is used.
    allow_insecure: bool = _f(False)
    # Which control-plane contract to speak (docs/platform-dialect.md): "spec" (docs/protocol.md, the Go agent at
    # 4386c4b), "platform" (the platform's current contract), or "auto": found at registration and remembered in
    # the identity.
    dialect: str = _f("auto", choices=("auto", "spec", "platform"))


@dataclass(frozen=True)
class MeshConfig:
    """The WireGuard mesh interface."""

    interface: str = _f("plexd0", "ifname")
    listen_port: int = _f(51820, min=1, max=65535)
    mtu: int = _f(1420, min=576, max=65535)
    userspace_implementation: str = _f("wireguard-go")
    backend: str = _f("auto", choices=("auto", "kernel", "userspace"))
    # A peer may carry default routes (0/0, or pieces adding up to it) only when this is set (exit nodes).
    allow_exit_routes: bool = _f(False)
    # The route guard (plexd.state.route_limits): prefixes a peer may route although they cover a resolver, a gateway,
    # this node's LAN, link-local or metadata addresses, or count against max_route_percent.
    allow_routes: tuple[str, ...] = _f((), "list", cidrs=True, may_be_empty=True)
    max_route_percent: float = _f(0.1, min=0.000001, max=100.0)  # of each address family, however split
    route_table: int = _f(5182, min=1, max=2**32 - 1, not_in=(253, 254, 255))  # the mesh routes' own table
    route_rule_priority: int = _f(5182, min=1, max=32765)  # its rule, before main (32766)
    # Peers with a bridge's fallback endpoint: how often a relayed peer tries the direct path again (plexd.services
    # .paths; both sides try in the same wall-clock window, so two NATs that filter by endpoint can punch through).
    path_probe_interval: float = _f(60.0, "duration", min=40, max=3600)


@dataclass(frozen=True)
class TokenConfig:
    """Where the bootstrap token comes from (§5.1)."""

    value: str = _f("", secret=True)
    file: str = _f("/etc/plexd/bootstrap-token")
    env: str = _f("PLEXD_BOOTSTRAP_TOKEN")
    use_metadata: bool = _f(False)
    metadata_url: str = _f("http://169.254.169.254", "url")


@dataclass(frozen=True)
class RegistrationConfig:
    """What the node registers as."""

    hostname: str = _f("")
    metadata: dict[str, str] = field(default_factory=dict, metadata={"kind": "map"})
    max_wait: float = _f(300.0, "duration", min=1)
    # The platform contract only: the project the node joins (a UUID; empty: read from the bootstrap token) and the
    # platform resource it registers as (empty: the hostname).
    project_id: str = _f("")
    resource_handle: str = _f("")


@dataclass(frozen=True)
class ReconcileConfig:
    """Periodic full-state reconcile."""

    interval: float = _f(60.0, "duration", min=1)
    pull_interval: float = _f(600.0, "duration", min=1)


@dataclass(frozen=True)
class HeartbeatConfig:
    """Heartbeats to the control plane."""

    interval: float = _f(30.0, "duration", min=1)


@dataclass(frozen=True)
class SseConfig:
    """Event stream reconnects and polling fallback."""

    backoff_base: float = _f(1.0, "duration", min=0.001)
    backoff_max: float = _f(60.0, "duration", min=0.001)
    jitter: float = _f(0.25, min=0.0, max=0.99)
    idle_timeout: float = _f(90.0, "duration", min=1)
    polling_after: float = _f(300.0, "duration", min=0)
    # The first reconnect after a stream closes waits a random 0..reconnect_spread: a control plane restart closes
    # every node's stream at the same instant, and the fleet must not come back in the same second.
    reconnect_spread: float = _f(5.0, "duration", min=0)


@dataclass(frozen=True)
class ShutdownConfig:
    """What SIGTERM does."""

    deregister: bool = _f(True)
    # at most 30 s: the whole stop (drain, deregistration, teardown) ends within 35 s
    drain: float = _f(30.0, "duration", min=0, max=30.0)


@dataclass(frozen=True)
class NatTraversalConfig:
    """STUN discovery of the public endpoint."""

    enabled: bool = _f(True)
    # Only these servers are ever asked (HOST or HOST:PORT, port 3478 by default); none configured: no discovery.
    stun_servers: tuple[str, ...] = _f((), "list", stun_servers=True)
    refresh_interval: float = _f(60.0, "duration", min=10)
    stun_timeout: float = _f(5.0, "duration", min=0.1, max=60)  # per server and attempt (§10: 5 s)


@dataclass(frozen=True)
class LocalAuthConfig:
    """Who may run actions locally (`plexd actions run --local`), checked on the socket's SO_PEERCRED."""

    require_root: bool = _f(True)
    group: str = _f("plexd")  # besides root, when require_root is false


@dataclass(frozen=True)
class ActionsConfig:
    """Hook and built-in action execution."""

    enabled: bool = _f(True)
    max_concurrent: int = _f(5, min=1, max=1000)
    timeout: float = _f(600.0, "duration", min=10, max=600)  # default and cap of a request's timeout
    output_cap: int = _f(1 << 20, min=1024, max=16 << 20)  # bytes kept per stream (stdout, stderr)
    kill_grace: float = _f(2.0, "duration", min=0, max=60)  # SIGTERM to the process group, then SIGKILL
    local_auth: LocalAuthConfig = field(default_factory=LocalAuthConfig)


@dataclass(frozen=True)
class HooksConfig:
    """Hook discovery."""

    # An absolute path: "" or a relative one would be the daemon's working directory ("/" under systemd), every
    # root-owned executable there an action.
    dir: str = _f("/etc/plexd/hooks.d", "path", absolute=True)
    # A full re-scan this often besides the file watcher's (inotify can miss changes, e.g. on network mounts).
    reverify: float = _f(300.0, "duration", min=30)


@dataclass(frozen=True)
class NodeApiConfig:
    """The local node API."""

    socket_path: str = _f("/var/run/plexd/api.sock")
    socket_group: str = _f("plexd")  # the socket is 0660 root:<this group>; 0600 when the group does not exist
    admin_group: str = _f("plexd-admin")  # besides root, who may use the daemon's control routes (status, reconcile)
    secrets_group: str = _f("plexd-secrets")  # besides root, who may read secrets through the socket
    http_enabled: bool = _f(False)
    http_listen: str = _f("127.0.0.1:9100", host_port=True)
    http_token_file: str = _f("")
    # TCP's own connection budget, apart from the socket's 64: strangers on the network never take the socket's
    http_max_connections: int = _f(16, min=1, max=1024)
    http_header_timeout: float = _f(5.0, "duration", min=0.5, max=60)  # a TCP request's head (and token) within this
    # requests per second per client (uid, or TCP address), refilled up to rate_burst; 0 turns the limit off
    rate_limit: float = _f(100.0, "float", min=0)
    rate_burst: int = _f(200, min=1, max=1_000_000)
    request_timeout: float = _f(10.0, "duration", min=0.5, max=300)  # a request must arrive whole within this
    # The report store's caps (plexd.nodeapi.reports): past them a PUT is 507 (store full) or 413 (entry too large)
    report_max_entries: int = _f(1000, min=1, max=1_000_000)
    report_max_bytes: int = _f(16 << 20, min=1 << 12, max=1 << 34)
    report_max_entry_bytes: int = _f(1 << 20, min=1 << 10, max=1 << 20)


@dataclass(frozen=True)
class MetricsConfig:
    """The local Prometheus endpoint (plexd.node.metrics): plexd's own health, off by default."""

    enabled: bool = _f(False)
    listen: str = _f("127.0.0.1:9586", host_port=True)  # beyond loopback only with token_file
    token_file: str = _f("", "path")  # a scrape must send "Authorization: Bearer <the file's content>"
    max_connections: int = _f(8, min=1, max=1024)  # past this, a connection is answered 503 and closed


@dataclass(frozen=True)
class TelemetryMetricsConfig:
    """Metrics for the control plane (POST /metrics): system, per-peer tunnel and latency (plexd.telemetry)."""

    enabled: bool = _f(True)
    # A point per peer per collection: at 1,000 peers, every 15 s and reported every minute (the Go agent's
    # timings) made 240 POSTs an hour, twice what the rest of an idle node sends. A minute's resolution, reported
    # every 5 minutes, is 24 POSTs an hour at 1,000 peers (a POST holds ~3,500 points) and 12 below ~600.
    collect_interval: float = _f(60.0, "duration", min=0.1)
    report_interval: float = _f(300.0, "duration", min=0.1)
    # The Go agent sends 100 per POST and keeps 200: one collection with 100 peers (201 points) overflows it.
    # A POST stops at 4,000 points or 1 MiB (plexd.telemetry.queue), whichever comes first.
    batch_size: int = _f(4000, min=1, max=10_000)
    queue_max_bytes: int = _f(32 << 20, min=1 << 12, max=1 << 34)  # the oldest entries go first past this
    latency_timeout: float = _f(2.0, "duration", min=0.05, max=30)
    # Peers whose latency one collection measures, in turn: at 1,000 peers, probing every one every 15 s was most
    # of an idle daemon's CPU (and 4,000 points a minute upstream); 64 a turn measures each every ~16 minutes.
    latency_peers: int = _f(64, min=0, max=MAX_PING_TARGETS)  # one ICMP sequence number each


@dataclass(frozen=True)
class TelemetryLogsConfig:
    """Log forwarding (POST /logs): the journal when journald runs, else the listed files."""

    enabled: bool = _f(True)
    source: str = _f("auto", choices=("auto", "journal", "files"))
    files: tuple[str, ...] = _f((), "list")
    # journal only. Default: plexd's own unit and its wireguard-go scopes, warning and worse; the journal holds
    # every service's secrets-in-passing and users' activity, so shipping more is the operator's explicit choice
    # (units: [] ships every unit).
    units: tuple[str, ...] = _f(("plexd.service", "plexd-wireguard-*.scope"), "list")
    priority: str = _f("warning", choices=("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug"))
    journal_dir: str = _f("")  # journalctl --directory: a journal other than the system's
    collect_interval: float = _f(10.0, "duration", min=0.1)
    report_interval: float = _f(30.0, "duration", min=0.1)
    batch_size: int = _f(200, min=1, max=10_000)
    queue_max_bytes: int = _f(64 << 20, min=1 << 12, max=1 << 34)


@dataclass(frozen=True)
class TelemetryAuditConfig:
    """Audit forwarding (POST /audit): auditd's log and the local actions audit log."""

    enabled: bool = _f(True)
    file: str = _f("/var/log/audit/audit.log")  # empty: auditd is not read
    local_actions: bool = _f(True)
    collect_interval: float = _f(5.0, "duration", min=0.1)
    report_interval: float = _f(15.0, "duration", min=0.1)
    batch_size: int = _f(500, min=1, max=10_000)
    queue_max_bytes: int = _f(64 << 20, min=1 << 12, max=1 << 34)


@dataclass(frozen=True)
class TelemetryConfig:
    """What is reported upstream, through lanes of the uplink outbox that carry it through outages
    (plexd.telemetry)."""

    # Where versions before the one uplink outbox kept telemetry.db (empty: data_dir): a file left there is taken
    # over into data_dir/uplink.db once and removed. Nothing is written there any more.
    queue_dir: str = _f("")
    metrics: TelemetryMetricsConfig = field(default_factory=TelemetryMetricsConfig)
    logs: TelemetryLogsConfig = field(default_factory=TelemetryLogsConfig)
    audit: TelemetryAuditConfig = field(default_factory=TelemetryAuditConfig)


@dataclass(frozen=True)
class UpgradeConfig:
    """Self-upgrade (plexd.upgrade): where release zipapps live, and how long a new one has to prove healthy."""

    dir: str = _f("/opt/plexd/releases", "path")
    health_deadline: float = _f(60.0, "duration", min=5, max=1800)
    max_size: int = _f(64 << 20, min=1 << 16, max=1 << 30)  # bytes; a larger artifact is refused while streaming
    # The Ed25519 public keys (base64, 32 bytes) a release must be signed by (plexd.upgrade.signing). Empty: this
    # node installs and launches no release at all, only the package installed in the venv.
    release_keys: tuple[str, ...] = _f((), "list", release_keys=True)
    # A downgrade also needs the action's allow_downgrade: the operator and the control plane must both agree.
    allow_downgrade: bool = _f(False)
    # The platform contract serves no releases to nodes: a platform node fetches one from this release page's
    # layout, {release_url}/v{version}/plexd-linux-{arch} and its .sig (plexd.controlplane.release_store). Empty:
    # a platform node refuses upgrades, naming this setting. The spec dialect's control plane serves its own.
    release_url: str = _f("", "url")


@dataclass(frozen=True)
class PolicyConfig:
    """Policy enforcement: peer visibility and the nftables table inet plexd."""

    enabled: bool = _f(True)
    log_denied: bool = _f(False)  # a rate-limited log line per dropped packet on the mesh interface
    # Where CIDRs in policy rules must lie (the control plane's mesh addresses; docs/protocol.md §5: 10.100/16).
    mesh_range: tuple[str, ...] = _f(("10.100.0.0/16",), "list", cidrs=True)


@dataclass(frozen=True)
class KubernetesConfig:
    """The API server Kubernetes sessions proxy to, with the node's own credentials."""

    url: str = _f("")  # https://HOST:PORT; empty: the in-cluster environment (KUBERNETES_SERVICE_HOST), if any
    token_file: str = _f("", "path")  # the node's bearer token for it
    ca_file: str = _f("", "path")  # the CA that signed its certificate


@dataclass(frozen=True)
class RelayConfig:
    """Bridge mode's relay: where it listens, and whether stable flows are forwarded in the kernel."""

    listen: str = _f("0.0.0.0:51821", host_port=True)
    fastpath_address: str = _f("")  # the IPv4 address relayed packets arrive on; empty: the userspace relay only


@dataclass(frozen=True)
class SiteToSiteConfig:
    """What only this machine's operator may open for site-to-site tunnels."""

    # Remote subnets that are a default route (0.0.0.0/0, ::/0) send all of this machine's traffic to a remote
    # site: refused unless allowed here.
    allow_default_route: bool = _f(False)


@dataclass(frozen=True)
class IngressConfig:
    """Where a bridge's ingress ports listen, and who may connect to them."""

    listen_address: str = _f("0.0.0.0")  # the bridge's public address; all IPv4 addresses by default
    allowed_sources: tuple[str, ...] = _f((), "list", cidrs=True)  # empty: anyone (ingress is public)
    # A connection with no byte either way this long is closed. Long: a pool's database connections, a quiet
    # WebSocket or event stream sit silent for many minutes.
    idle_timeout: float = _f(3600.0, "duration", min=10, max=7 * 86400)
    # Of a port's 256 connections, what one source (an address; an IPv6 /64) may hold once the port is full: a
    # newcomer from a source under it then closes the newest of the busiest source's, if that is over it. While
    # there is room a source may hold more (an office behind one NAT).
    max_per_source: int = _f(64, min=1, max=256)


@dataclass(frozen=True)
class BridgeConfig:
    """What a node in `mode: bridge` serves for the mesh (docs/protocol.md §A2)."""

    relay: RelayConfig = field(default_factory=RelayConfig)
    site_to_site: SiteToSiteConfig = field(default_factory=SiteToSiteConfig)
    ingress: IngressConfig = field(default_factory=IngressConfig)


@dataclass(frozen=True)
class AccessConfig:
    """The access proxy: the sessions of the state's `sessions` block (docs/protocol.md §A1)."""

    enabled: bool = _f(True)  # false: no session is served, whatever the control plane grants
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)


@dataclass(frozen=True)
class Config:
    """The effective configuration; `sources` says where each leaf came from."""

    api: ApiConfig = field(default_factory=ApiConfig)
    mode: str = _f("node", choices=("node", "bridge"))
    log_level: str = _f("info", choices=("debug", "info", "warning", "warn", "error"))
    data_dir: str = _f("/var/lib/plexd", "path")
    mesh: MeshConfig = field(default_factory=MeshConfig)
    token: TokenConfig = field(default_factory=TokenConfig)
    registration: RegistrationConfig = field(default_factory=RegistrationConfig)
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    sse: SseConfig = field(default_factory=SseConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    nat_traversal: NatTraversalConfig = field(default_factory=NatTraversalConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    node_api: NodeApiConfig = field(default_factory=NodeApiConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    upgrade: UpgradeConfig = field(default_factory=UpgradeConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    # Where each leaf came from ("default", "file /etc/plexd/config.yaml", "env PLEXD_API", "flag --api").
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    config_file: str | None = field(default=None, compare=False)

    def source_of(self, key: str) -> str:
        return self.sources.get(key, "default")

    def get(self, key: str) -> Any:
        node: Any = self
        for part in key.split("."):
            node = getattr(node, part)
        return node

    def require_api(self) -> str:
        """The control-plane URL, or a ConfigError saying how to set it."""
        if not self.api.url:
            raise ConfigError("no control plane configured: set api in the config file, PLEXD_API, or --api URL")
        return self.api.url

    def items(self) -> list[tuple[str, Any, str]]:
        """Every leaf as (dotted key, value, source), in schema order."""
        return [(key, self.get(key), self.source_of(key)) for key in _LEAVES]

    def shown(self) -> dict[str, dict[str, Any]]:
        """Every leaf as `plexd config show --json` prints it: {key: {value, source}}, secrets hidden."""
        return {key: {"value": list(v) if isinstance(v := display_value(key, value), tuple) else v,
                      "source": source} for key, value, source in self.items()}

    def given_flags(self) -> dict[str, Any]:
        """The command-line flags this config was loaded with (to load it again the same way)."""
        return {flag: self.get(key) for flag, key in FLAG_KEYS.items() if self.source_of(key).startswith("flag")}


# ---------------------------------------------------------------------------------------------------------------
# Schema walking

_META_FIELDS = ("sources", "config_file")


def _groups(cls: type, prefix: str = "") -> dict[str, type]:
    """Every nested config section by dotted path ("api", "api.tls", ...): the fields whose default is a
    dataclass instance, so a new section in the schema is known here without a second list to keep in step."""
    out: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        sub = f.default_factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out[prefix + f.name] = sub
            out.update(_groups(sub, f"{prefix}{f.name}."))
    return out


def _leaves(cls: type, prefix: str = "") -> dict[str, dataclasses.Field[Any]]:
    out: dict[str, dataclasses.Field[Any]] = {}
    for f in dataclasses.fields(cls):
        if f.name in _META_FIELDS:
            continue
        path = f"{prefix}{f.name}"
        sub = _GROUPS.get(path)
        if sub is not None:
            out.update(_leaves(sub, path + "."))
        else:
            out[path] = f
    return out


_GROUPS = _groups(Config)
_LEAVES = _leaves(Config)
ENV_NAMES: dict[str, str] = {"PLEXD_" + key.replace(".", "_").upper(): key for key in _LEAVES}
ENV_NAMES["PLEXD_API"] = "api.url"
FLAG_KEYS = {"api": "api.url", "mode": "mode", "log_level": "log_level", "data_dir": "data_dir"}


def is_secret(key: str) -> bool:
    return bool(_LEAVES[key].metadata.get("secret"))


def _suggest(key: str, candidates: list[str]) -> str:
    import difflib  # only on the error path: keeps CLI start-up lean

    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:
        # A misspelt last part of a dotted key ("mesh.interfce") is closest to a sibling's last part.
        tail = key.rsplit(".", 1)[-1]
        tails = {c.rsplit(".", 1)[-1]: c for c in candidates}
        hit = difflib.get_close_matches(tail, list(tails), n=1, cutoff=0.6)
        close = [tails[hit[0]]] if hit else []
    return f"; did you mean '{close[0]}'?" if close else ""


def _flatten_file(doc: Any, where: str) -> dict[str, Any]:
    """YAML document → {dotted leaf key: raw value}. Refuses unknown keys and non-mappings where groups go."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        group = prefix.rstrip(".") or "the top level"
        if not isinstance(node, dict):
            # `token: plx_enroll_...` is an easy slip: never echo a value where a secret may have been written.
            shown = "" if group == "token" else f" {node!r}"
            raise ConfigError(f"{where}: {group} must be a mapping of keys, got {_kind(node)}{shown}")
        for raw_key, value in node.items():
            key = f"{prefix}{raw_key}"
            if prefix == "" and raw_key == "api" and isinstance(value, str):
                out["api.url"] = value  # the short form `api: https://...`
                continue
            if key in _GROUPS:
                if value is not None:
                    walk(value, key + ".")
            elif key in _LEAVES:
                if value is not None:  # `key:` with nothing after it keeps the default
                    out[key] = value
            else:
                siblings = [k for k in (*_LEAVES, *_GROUPS) if k.startswith(prefix) and k != prefix.rstrip(".")]
                raise ConfigError(f"{where}: unknown config key '{key}'{_suggest(key, siblings)}")

    if doc is None:
        return out
    walk(doc, "")
    return out


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(key: str, raw: Any, origin: str) -> Any:
    """Turn a raw value (typed YAML, or a string from env/flags) into the field's type, or raise naming it all."""
    f = _LEAVES[key]
    kind = f.metadata["kind"]
    from_text = isinstance(raw, str) and not origin.startswith("file")
    shown = "<hidden>" if f.metadata.get("secret") else repr(raw)

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{key}: {shown} from {origin} is not {expected}")

    if kind == "bool":
        if isinstance(raw, bool):
            value: Any = raw
        elif from_text and raw.strip().lower() in _TRUE | _FALSE:
            value = raw.strip().lower() in _TRUE
        else:
            raise bad("a boolean (true or false)")
    elif kind == "int":
        if isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif from_text and raw.strip().lstrip("-").isdigit():
            value = int(raw.strip())
        else:
            raise bad("a whole number")
    elif kind == "float":
        try:
            if isinstance(raw, bool) or not isinstance(raw, int | float | str) or (isinstance(raw, str)
                                                                                 and not from_text):
                raise ValueError
            value = float(raw)
            if not math.isfinite(value):  # nan passes every min/max comparison; inf overflows what uses it
                raise ValueError
        except ValueError:
            raise bad("a number") from None
    elif kind == "duration":
        from plexd.base.gojson import parse_duration

        if not isinstance(raw, str):
            raise ConfigError(f"{key}: {raw!r} from {origin} is not a duration; write it with a unit, "
                              f"e.g. '{raw}s' (Go syntax: 30s, 1m30s, 150ms)")
        try:
            value = parse_duration(raw.strip())
        except ValueError:
            raise ConfigError(f"{key}: {raw!r} from {origin} is not a valid duration "
                              "(Go syntax: 30s, 1m30s, 150ms)") from None
    elif kind == "list":
        if from_text:
            value = tuple(part.strip() for part in raw.split(",") if part.strip())
        elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
            value = tuple(raw)
        else:
            raise bad("a list of strings")
    elif kind == "map":
        if from_text:
            value = {}
            for part in filter(None, (p.strip() for p in raw.split(","))):
                k, sep, v = part.partition("=")
                if not sep or not k.strip():
                    raise bad("a list of key=value pairs separated by commas")
                value[k.strip()] = v.strip()
        elif isinstance(raw, dict) and all(isinstance(v, str | int | float) and not isinstance(v, bool)
                                           for v in raw.values()):
            value = {str(k): str(v) for k, v in raw.items()}
        else:
            raise bad("a mapping of string keys to string values")
    else:  # str, url, path, ifname
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise bad("a string")
        value = str(raw).strip() if kind in ("url", "path", "ifname") else str(raw)
    _check(key, value, shown, origin, f)
    return value


def _check(key: str, value: Any, shown: str, origin: str, f: dataclasses.Field[Any]) -> None:
    rules = f.metadata
    kind = rules["kind"]
    where = f"{key}: {shown} from {origin}"
    choices = rules.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where} is not one of {', '.join(c for c in choices if c != 'warn')}")
    if "min" in rules and value < rules["min"]:
        unit = "s" if kind == "duration" else ""
        raise ConfigError(f"{where} is too small (minimum {rules['min']}{unit})")
    if "max" in rules and value > rules["max"]:
        raise ConfigError(f"{where} is too large (maximum {rules['max']})")
    if value in rules.get("not_in", ()):
        raise ConfigError(f"{where} is reserved (not one of {', '.join(map(str, rules['not_in']))})")
    if kind == "url" and value:
        problem = _url_problem(value)
        if problem:
            raise ConfigError(f"{where} is not a usable http:// or https:// URL ({problem})")
    if kind == "ifname" and not (0 < len(value) <= 15 and "/" not in value and not any(c.isspace() for c in value)):
        raise ConfigError(f"{where} is not a valid interface name (1-15 characters, no '/' or spaces)")
    if kind == "path" and not value:
        raise ConfigError(f"{where} must not be empty")
    if rules.get("absolute") and not value.startswith("/"):
        raise ConfigError(f"{where} must be an absolute path")
    if rules.get("cidrs"):
        import ipaddress

        if not value and not rules.get("may_be_empty"):
            raise ConfigError(f"{where} must name at least one CIDR")
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ConfigError(f"{where}: {cidr!r} is not a CIDR (e.g. 10.100.0.0/16)") from None
    if rules.get("host_port"):
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{where} is not HOST:PORT (e.g. 127.0.0.1:9100)")
    if rules.get("release_keys"):
        from plexd.base.wgkeys import key_problem

        for i, text in enumerate(value):
            problem = key_problem(text)
            if problem:
                raise ConfigError(f"{where}: entry {i} {text[:60]!r} {problem}")
    if rules.get("stun_servers"):
        from plexd.config.stun_server import parse_server

        for text in value:
            try:
                parse_server(text)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None


def _url_problem(value: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        port = parts.port  # raises ValueError for a bad port
    except ValueError as exc:
        return str(exc)
    if parts.scheme.lower() not in ("http", "https"):
        return "the scheme must be http or https"
    if not parts.hostname:
        return "no host name"
    if any(c.isspace() for c in value):
        return "contains spaces"
    if port == 0:
        return "port 0"
    return ""


def _read_file(path: str, explicit: bool) -> tuple[dict[str, Any], str | None]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file {path} does not exist") from None
        return {}, None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        errno_txt = f" (errno {exc.errno})" if isinstance(exc, OSError) and exc.errno else ""
        raise ConfigError(f"cannot read config file {path}: {reason}{errno_txt}") from None
    import yaml  # lazily: only when there is a file to parse

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path}:{at} is not valid YAML: {problem}") from None
    return _flatten_file(doc, path), path


def config_path(path: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The config file a command uses: ``--config``, else ``$PLEXD_CONFIG``, else the default (which may not
    exist)."""
    env = os.environ if env is None else env
    return path or env.get("PLEXD_CONFIG") or DEFAULT_CONFIG_PATH


def load(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Build the effective configuration. `path` is ``--config``; `flags` maps flag names (api, mode, log_level,
    data_dir) to values, None meaning "not given"."""
    env = os.environ if env is None else env
    explicit = path is not None or bool(env.get("PLEXD_CONFIG"))
    file_path = config_path(path, env)
    raw_file, used_file = _read_file(file_path, explicit)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, raw in raw_file.items():
        values[key] = _convert(key, raw, f"file {file_path}")
        sources[key] = f"file {file_path}"
    # PLEXD_API and PLEXD_API_URL both name api.url; the longer, more specific one wins.
    for name in sorted(ENV_NAMES, key=len):
        if name in env:
            key = ENV_NAMES[name]
            values[key] = _convert(key, env[name], f"env {name}")
            sources[key] = f"env {name}"
    for flag, value in (flags or {}).items():
        if value is None:
            continue
        key = FLAG_KEYS[flag]
        origin = f"flag --{flag.replace('_', '-')}"
        values[key] = _convert(key, value, origin)
        sources[key] = origin
    if values.get("sse.backoff_base", 1.0) > values.get("sse.backoff_max", 60.0):
        raise ConfigError(f"sse.backoff_base ({sources.get('sse.backoff_base', 'default')}) is larger than "
                          f"sse.backoff_max ({sources.get('sse.backoff_max', 'default')})")
    _check_metrics_exposure(values, sources)
    _check_insecure_api(values, sources)
    return _build(Config, "", values, sources, used_file)


def _check_insecure_api(values: dict[str, Any], sources: dict[str, str]) -> None:
    """A control plane reached over plain HTTP, or over TLS without verification, hands the node secret and the
    desired state to whoever sits on the path: only with api.allow_insecure (`insecure_control_plane` names what
    is insecure, for the warning at each start)."""
    if values.get("api.allow_insecure", False):
        return
    url = values.get("api.url", "")
    if url.lower().startswith("http://"):
        raise ConfigError(f"api.url {url} ({sources.get('api.url', 'default')}) is plain http://: the node secret "
                          "and the state would cross the network readable and forgeable; use https://, or set "
                          "api.allow_insecure: true (labs only)")
    if values.get("api.tls.insecure_skip_verify", False):
        raise ConfigError(f"api.tls.insecure_skip_verify ({sources.get('api.tls.insecure_skip_verify')}) turns off "
                          "the control plane's certificate check: set api.allow_insecure: true as well (labs only), "
                          "or give the CA with api.tls.ca_file")


def insecure_control_plane(config: Config) -> str:
    """What makes the control-plane connection insecure ("" when nothing does)."""
    if config.api.url.lower().startswith("http://"):
        return f"plain http:// to {config.api.url}"
    if config.api.tls.insecure_skip_verify:
        return "TLS without certificate verification (api.tls.insecure_skip_verify)"
    return ""


def _check_metrics_exposure(values: dict[str, Any], sources: dict[str, str]) -> None:
    """The metrics endpoint has no auth of its own unless metrics.token_file is set: off this machine's loopback
    it needs one (peer names, traffic and the node's health are nobody else's business)."""
    listen = values.get("metrics.listen", "127.0.0.1:9586")
    if not values.get("metrics.enabled", False) or values.get("metrics.token_file", ""):
        return
    host = listen.rpartition(":")[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ConfigError(f"metrics.listen {listen} ({sources.get('metrics.listen', 'default')}) is not a loopback "
                          "address: set metrics.token_file (bearer auth) to serve metrics beyond this machine")


def _build(cls: type, prefix: str, values: dict[str, Any], sources: dict[str, str], used_file: str | None) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in _META_FIELDS:
            continue
        path = f"{prefix}{f.name}"
        if path in _GROUPS:
            kwargs[f.name] = _build(_GROUPS[path], path + ".", values, sources, used_file)
        elif path in values:
            kwargs[f.name] = values[path]
    if cls is Config:
        kwargs["sources"] = dict(sources)
        kwargs["config_file"] = used_file
    return cls(**kwargs)


def display_value(key: str, value: Any) -> Any:
    """A value as `plexd config show` prints it: durations in Go syntax, secrets as a fingerprint."""
    if is_secret(key):
        if not value:
            return ""
        from plexd.base.log import fingerprint

        return f"<hidden {fingerprint(value)}>"
    if _LEAVES[key].metadata["kind"] == "duration":
        from plexd.base.gojson import format_duration

        return format_duration(value)
    return value
