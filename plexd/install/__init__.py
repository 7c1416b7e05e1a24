"""Putting plexd on a machine: the systemd unit (package data) and `plexd install` / `plexd uninstall`."""
