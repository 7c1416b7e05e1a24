"""Every file plexd keeps under data_dir (default /var/lib/plexd), named in one place.

    identity.json              0600  node id, mesh IP, signing key (the Go agent's format, docs/protocol.md §5.4)
    private_key                0600  WireGuard private key, base64
    private_key.next           0600  a rotation's new key until the control plane took it (plexd.node.key_rotation)
    private_key.registering    0600  a fresh registration's key and the SHA-256 of its token, from before the token
                                     is spent until the answer is saved (an hour at most: plexd.identity.registrar)
    node_secret_key            0600  the node secret (the bearer and the secrets' key are derived from it, or
                                     are it in compatibility mode: plexd.identity.node_secret)
    node_secret_kdf            0600  how they are derived ("hkdf-sha256"); absent: compatibility mode
    signing_public_key         0600  the control plane's current event-signing key (the file wins over identity)
    events.db                  0600  the event stream's replay cursor, the nonces of accepted events and the
                                     mirror of the desired model (no private key) for an offline start (SQLite,
                                     WAL, committed together; see plexd.controlplane.ledger)
    actions.db                 0600  older versions' action journal: taken over into uplink.db and removed
    telemetry.db               0600  older versions' telemetry queue (here or in telemetry.queue_dir): taken over
                                     into uplink.db and removed
    uplink.db                  0600  what the control plane has not taken yet (drift and session reports, action
                                     acks and results, report changes, telemetry), kept across restarts until taken
                                     or refused for good; the action journal (exactly-once), committed with its
                                     messages; where each telemetry source was read up to, committed with its
                                     entries (SQLite, WAL; plexd.controlplane.uplink, plexd.actions.journal,
                                     plexd.telemetry.queue)
    actions/local-audit.log    0600  who ran which action locally (plexd.actions.audit)
    deregistered               0600  when the node last deregistered; its next start rejoins with the node secret
                                     first and removes it (plexd.node.departure)
    upgrade.json               0600  an upgrade between its install and its outcome, across the restart
                                     (plexd.upgrade.marker)

The directory is 0700 and every write is atomic (`plexd.base.atomicfile`).
"""

from __future__ import annotations

IDENTITY = "identity.json"
PRIVATE_KEY = "private_key"
NEXT_PRIVATE_KEY = "private_key.next"
REGISTERING_KEY = "private_key.registering"  # the key of a registration whose answer is not saved yet
NODE_SECRET = "node_secret_key"
NODE_SECRET_KDF = "node_secret_kdf"
SIGNING_KEY = "signing_public_key"
EVENT_LEDGER = "events.db"
ACTIONS_DB = "actions.db"
LOCAL_AUDIT = "actions/local-audit.log"
TELEMETRY_DB = "telemetry.db"
UPLINK_DB = "uplink.db"
DEPARTED = "deregistered"
UPGRADE = "upgrade.json"
NONCES = "nonces.json"  # before events.db: imported once, then removed
LAST_EVENT_ID = "last_event_id"  # likewise
DESIRED_MIRROR = "state/desired.json"  # before events.db: imported once, then removed
