"""What the daemon loads decides its resident memory. The control-plane client is httpx with httpx-sse (the project's
specified libraries), without httpx's command-line tool (click, pygments, rich: ~2 MiB, which `import httpx` would
bring whenever they are installed); on a node that is not a bridge, the bridge's domains stay out. Each case runs in
a fresh interpreter: the test process has them all."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from plexd.config.settings import load
from plexd.node.domain_list import build_engine
import plexd.cli, plexd.node.assembly
config = load(None, env={"PLEXD_CONFIG": sys.argv[1]}, flags={"mode": sys.argv[2], "data_dir": sys.argv[3]})
names = [d.name for d in build_engine(config).domains]
print(json.dumps({"domains": names, "modules": sorted(sys.modules)}))
"""
KEPT_OUT = ("click", "pygments", "rich")  # httpx's command-line tool
BRIDGE_ONLY = ("plexd.bridge.wiring", "plexd.bridge.relay_domain", "plexd.bridge.relay", "plexd.bridge.interfaces",
               "plexd.bridge.ingress")


def probe(tmp_path, mode: str) -> dict:
    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    out = subprocess.run([sys.executable, "-c", PROBE, str(config), mode, str(tmp_path / "data")], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


def test_a_node_loads_httpx_and_httpx_sse_but_not_httpxs_command_line_nor_the_bridge(tmp_path):
    seen = probe(tmp_path, "node")
    loaded = set(seen["modules"])
    assert {"httpx", "httpx_sse"} <= loaded
    # httpx._main: the placeholder plexd/__init__.py sets (None) so that an httpx import skips its command line
    assert not {m for m in loaded if m.split(".")[0] in KEPT_OUT}
    assert not loaded & set(BRIDGE_ONLY)
    assert "wireguard" in seen["domains"] and "user_access" not in seen["domains"]


def test_a_bridge_loads_its_domains_and_lists_them(tmp_path):
    seen = probe(tmp_path, "bridge")
    assert "plexd.bridge.wiring" in seen["modules"]
    assert {"user_access", "site_to_site"} <= set(seen["domains"])
