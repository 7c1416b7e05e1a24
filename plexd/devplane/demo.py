"""Interim demo (until the namespace lab replaces it): start a devplane, create a bootstrap token, and show
the admin view a new user would look at next."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time


def run(args: argparse.Namespace) -> int:
    from plexd.devplane.admin_cli import table
    from plexd.devplane.harness import Devplane

    if getattr(args, "down", False):
        print("nothing to remove: the interim demo keeps no state outside its own process")
        return 0
    with tempfile.TemporaryDirectory(prefix="plexd-demo-") as tmp, Devplane(tmp) as dp:
        admin = dp.admin
        token = admin.create_token()
        token_file = f"{tmp}/devplane.db.admin-token"
        print(f"devplane running at {dp.url} (database {dp.db_path})")
        print(f"bootstrap token: {token}")
        print()
        print("nodes:")
        nodes = admin.nodes()
        print(table([[n["id"], n["hostname"], n["mesh_ip"], n["status"]] for n in nodes],
                    ["NODE", "HOSTNAME", "MESH IP", "STATUS"]))
        print()
        print("policies:")
        print(subprocess.run([sys.executable, "-m", "plexd.devplane.cli", "admin", "--url", dp.url, "--token-file",
                              token_file, "policies", "show"], capture_output=True, text=True).stdout.rstrip())
        print()
        print("next steps:")
        print(f"  plexd join --api {dp.url}   # with the token above, on a machine that should join the mesh")
        print(f"  plexd-devplane admin --url {dp.url} --token-file {token_file} nodes")
        if args.keep:
            print("\nrunning until Ctrl-C ...", flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                while dp.running:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    return 0
