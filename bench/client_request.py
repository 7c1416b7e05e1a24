"""Control-plane client: the CPU one request costs the daemon (a 1,000-point metrics batch, a heartbeat).

The real `ControlPlaneClient` (plexd.controlplane.http_client, gzip, Go-style JSON) sends to a loopback HTTP/1.1
server in another process that reads each request and answers a small JSON body (a heartbeat's answer), so the
figure is the client's side alone: what an idle node pays per telemetry batch and heartbeat (issue 32's idle CPU).
Plain HTTP: a TLS connection adds its encryption on top. CPU is this process's user+system time
(`time.process_time`) over `--requests` requests of each kind, after a warm-up.

    .venv/bin/python -m bench client_request [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from datetime import UTC, datetime

from plexd.base.gojson import EncodedJSON
from plexd.controlplane.client import ControlPlaneClient, HeartbeatRequest

# A server that answers every request as soon as it has read it (Content-Length bodies: what the client sends).
SERVER = """
import asyncio, sys
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\\r\\n\\r\\n")
            length = 0
            for line in head.split(b"\\r\\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: 39\\r\\n\\r\\n"
                         b'{"reconcile":false,"rotate_keys":false}')
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""

POINT = ('{"timestamp":"2026-11-26T13:00:00Z","group":"tunnel","peer_id":"n_%d","data":{"peer_id":"n_%d",'
         '"last_handshake_time":"0001-01-01T00:00:00Z","rx_bytes":0,"tx_bytes":%d,"handshake_succeeded":false,'
         '"handshake_stale":true}}')


async def cpu_per_request(send, requests: int) -> float:
    for _ in range(5):  # warm-up: the connection, and whatever the first request imports
        await send()
    start = time.process_time()
    for _ in range(requests):
        await send()
    return (time.process_time() - start) / requests


async def run(requests: int) -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        # One body, as the daemon's outbox hands it over (it joins a few stored rows, not 1,000 texts, per batch).
        body = EncodedJSON.array([POINT % (i, i, 148 * i) for i in range(1000)])
        heartbeat = HeartbeatRequest(node_id="n_bench", timestamp=datetime.now(UTC), status="healthy",
                                     uptime="1h0m0s", binary_checksum="ab" * 32)
        async with ControlPlaneClient(f"http://127.0.0.1:{port}", token="s" * 32) as client:
            batch = await cpu_per_request(lambda: client.send_metrics("n_bench", body), requests)
            beat = await cpu_per_request(lambda: client.heartbeat("n_bench", heartbeat), requests)
        print(f"control-plane client, {requests} requests each, plain HTTP to a loopback server in another process")
        print(f"  metrics batch of 1,000 points ({len(body.text) // 1024} KiB, sent gzipped): "
              f"{batch * 1000:.2f} ms CPU per request")
        print(f"  heartbeat:                                          {beat * 1000:.2f} ms CPU per request")
    finally:
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    asyncio.run(run(args.requests))


if __name__ == "__main__":
    main()
