"""Bridge mode: the relay data path for nodes that cannot reach each other directly, user access, site-to-site and
ingress. The control plane's bridge blocks are parsed in the model (`plexd.state.bridge_blocks`,
`plexd.state.relay_block`); here are `wgheader` (what a NAT cannot rewrite in a WireGuard packet), `flows` (index ->
session side), `relay` (the userspace UDP relay), `fastpath` (the nftables plan that forwards stable flows in the
kernel) and the bridge's converge domains.
"""
