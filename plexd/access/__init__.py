"""Mediated access to the node (plexd-access-protocol.md §1): session tokens, and the SSH, TCP and Kubernetes
sessions that the desired `sessions` block grants."""
