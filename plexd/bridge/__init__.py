"""Bridge mode (issue 34): the relay data path for nodes that cannot reach each other directly.

Standalone groundwork: `relay_sessions` (the desired relay sessions from the control plane), `wgheader` (what a NAT
cannot rewrite in a WireGuard packet), `flows` (index -> session side), `relay` (the userspace UDP relay) and
`fastpath` (the nftables plan that forwards stable flows in the kernel). Not yet a converge domain.
"""
