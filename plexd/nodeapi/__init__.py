"""The local node API (docs/protocol.md §8): what the control plane knows about this node, for its workloads.

    keys        the rules for keys in paths and file names (no key escapes data_dir/state)
    crypto      secret decryption (AES-256-GCM with the node secret key, §8.5)
    cache       data_dir/state/{metadata,secrets}.json and data/: a converge domain like the firewall
    reports     report entries written by workloads (versions, If-Match), kept in data_dir/state/report/
    sync        the on-disk queue that carries report changes to POST /report until acknowledged
    ratelimit   a token bucket per client, so a runaway script cannot starve the daemon
    routes      the §8.2 endpoints on the daemon's socket (and the optional TCP listener)
"""
