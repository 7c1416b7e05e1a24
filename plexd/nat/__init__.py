"""NAT traversal (docs/protocol.md §10): STUN discovery from the WireGuard listen port, classification, the
endpoint exchange with the control plane, and the refresh that keeps them current.

    stun.py       the 20-byte Binding request and a bounded parser of the answer
    servers.py    the configured servers (never any other) and their IPv4 addresses
    probe.py      asking one server from the listen port: a bound socket at start, a raw socket after
    discovery.py  one discovery over the servers, and the none/full_cone/symmetric/unknown classification
    nat_service.py  the supervised service: refresh, backoff, report, peers' endpoints into the converge engine
"""
