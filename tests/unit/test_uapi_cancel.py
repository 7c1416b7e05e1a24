"""A cancellation that arrives just as the UAPI connect completes must not be swallowed.

Python 3.11's ``asyncio.wait_for`` returns the inner result in that case and the caller carries on (the daemon's
shutdown cancel was lost and `plexd up` hung). The race is made deterministic here: the connect's result and the
cancel are scheduled in the same loop iteration, result first.
"""

from __future__ import annotations

import asyncio

import pytest

from plexd.machine.wireguard.uapi import UapiClient


async def test_cancel_racing_the_connect_is_not_swallowed(tmp_path, monkeypatch):
    async def serve(reader, writer):
        await reader.readuntil(b"\n\n")
        writer.write(b"errno=0\n\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(tmp_path / "pxc0.sock"))
    loop = asyncio.get_running_loop()
    real_connect = loop.sock_connect
    task: asyncio.Task | None = None

    async def racing_connect(sock, address):
        await real_connect(sock, address)
        done = loop.create_future()
        loop.call_soon(done.set_result, None)
        loop.call_soon(task.cancel)  # lands in the same iteration as the connect's completion
        return await done

    monkeypatch.setattr(loop, "sock_connect", racing_connect)
    try:
        client = UapiClient("pxc0", socket_dir=str(tmp_path))
        task = asyncio.ensure_future(client.set_raw(["listen_port=51820"]))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
    finally:
        server.close()
        await server.wait_closed()
