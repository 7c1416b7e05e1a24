"""plexd: joins a Linux machine to a WireGuard mesh run by a control plane."""

__version__ = "0.1.0"
