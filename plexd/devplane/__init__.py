"""plexd-devplane: the reference control plane (what headscale is to tailscaled), small and real.

    plexd-devplane serve --listen 127.0.0.1:8080 --db devplane.db     # prints "plexd-devplane listening on URL"
    plexd-devplane admin --url URL --token-file devplane.db.admin-token token create | nodes | policies set ...

Modules:
  serve.py       start-up checks (listen address, database, admin token), uvicorn run programmatically
  server.py      agent API of docs/protocol.md §1.2 and the SSE stream (§2); fault injection middleware
  admin.py       admin API under /admin/v1 (Bearer admin token)
  deployment.py  the model: registration, mesh IPs, policies and peer visibility (§9.2), liveness, and the
                 events each change causes
  events.py      signing (§3), the persistent event log, fan-out to open streams (one asyncio.Queue each)
  store.py       SQLite (WAL): nodes, tokens, events, received reports; survives restarts and SIGKILL
  wire.py        size-limited, gzip-aware body reading; Go-like type checks naming the bad field
  harness.py     `Devplane` (a real server process for tests and the demo) and its `AdminClient`
  admin_cli.py   `plexd-devplane admin ...`;  demo.py: `plexd-devplane demo`
  sse_stream.py  one node's open event stream (backlog, live events, keepalives), for either dialect
  platform_*.py  `serve --dialect platform` (docs/platform-dialect.md): the same Deployment told the platform's
                 way; routes (handlers), bodies and wire (checks, problem+json), state and policy (the 8-block
                 snapshot), executions, events (per-node signed envelopes), register, rotation, tokens

Behaviour worth knowing:
  - Event ids are `evt_<seq>` with one global sequence; `Last-Event-ID` replays everything after it (also after
    a restart). A stream opened without one first gets the events of the last `--replay-window` (5 min: what a
    signature window would still accept), so an event published just before a node connects is not lost.
  - Registration answers 201. Re-registration with the node's bearer, the same public key and an empty token
    returns the same node id and mesh IP. A deregistered or forgotten node's secret gets 401.
  - A node that offers ``"node_secret_kdf": "hkdf-sha256"`` when it registers gets the same field back: its bearer
    and the key of its secrets are derived from the node secret (plexd.identity.node_secret); a node that does
    not (the Go agent) uses the node secret for both, as §5.5 says.
  - Auth order on node endpoints: unknown/missing secret 401, secret of another node 403 (or 404 when the
    node in the path does not exist).
  - Nodes missing 3 heartbeat intervals are `unreachable` (kept as peers), 10 are `offline` (peers get
    `peer_removed`, and `peer_added` when they come back).
"""
