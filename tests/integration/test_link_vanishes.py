"""A mesh interface that vanishes while it is being read (its wireguard-go died between the lookup and the read,
which a CI run of the hostile-input lab caught) is observed as absent, not an exception with a traceback."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from plexd.machine.links import Links, LinkState
from plexd.machine.rtnl import Link

pytestmark = pytest.mark.root


class VanishingLinks(Links):
    def _read(self, link: Link, sock: socket.socket) -> LinkState:
        subprocess.run(["ip", "-n", self.netns, "link", "del", self.interface], check=True)  # the real kernel
        return super()._read(link, sock)


async def test_an_interface_deleted_between_lookup_and_read_is_absent():
    netns = f"pxt-linkrace-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        subprocess.run(["ip", "-n", netns, "link", "add", "race0", "type", "veth", "peer", "name", "race1"], check=True)
        assert (await Links("race0", netns=netns).observe()) is not None
        assert (await VanishingLinks("race0", netns=netns).observe()) is None
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)
