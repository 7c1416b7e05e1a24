#!/bin/bash
# Inside the systemd VM (scripts/systemd-vm.sh runs it): the systemd tier's checks, with plexd's venv's Python.
exec "$PLEXD_VENV/bin/python" -u "$PLEXD_REPO/tests/systemd/installed_node.py" "$@"
