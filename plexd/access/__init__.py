"""Mediated access to the node (docs/protocol.md §A1): session tokens, and the SSH, TCP and Kubernetes
sessions that the desired `sessions` block grants."""
