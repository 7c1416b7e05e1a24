"""What this node trusts, kept on disk: the control plane's signing key."""
