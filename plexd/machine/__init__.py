"""The machine's own interfaces, shared by the feature packages: WireGuard devices (kernel and wireguard-go), links,
addresses, routes and rules over rtnetlink, and nftables. They know nothing of the desired model's features."""
