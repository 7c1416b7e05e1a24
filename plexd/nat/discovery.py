"""One NAT discovery: ask the configured servers in order, classify the mapping (docs/protocol.md §10).

    none       the server saw the machine's own address and port: no NAT between them
    full_cone  two servers saw the same ip:port (the mapping does not depend on the destination)
    symmetric  two servers saw different ones (each destination gets its own mapping; peers cannot use it)
    unknown    only one server answered, and the mapping is not the local address

Better than §10's rule, which calls any preserved port `none`: a router that keeps the port (Linux masquerade
does) still translates the address, so `none` also needs the address to be the machine's own.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from plexd.nat.probe import Answer, Transport, ask
from plexd.nat.servers import StunServer, resolve
from plexd.nat.stun import Mapped, StunError

log = logging.getLogger(__name__)

NAT_TYPES = ("none", "full_cone", "symmetric", "unknown")


@dataclass(frozen=True)
class Discovery:
    """What one discovery found; `public` is None when no server answered (`failures` says why, per server)."""

    public: Mapped | None
    nat_type: str
    local: Mapped | None = None
    server: str = ""  # the server whose answer is `public`
    failures: tuple[tuple[str, str], ...] = ()  # (server, why) for each server that failed
    answers: tuple[tuple[str, Mapped], ...] = field(default=())  # (server, mapped) per answer

    @property
    def ok(self) -> bool:
        return self.public is not None


Asker = Callable[[Transport, str, int, float], Awaitable[Answer]]


async def discover(transport: Transport, servers: Sequence[StunServer], timeout: float, *,
                   asker: Asker = ask) -> Discovery:
    """Ask `servers` in order until one answers, then (unless the mapping is the local address) the next ones
    until a second answers from another address. Never raises for what a server does."""
    answers: list[tuple[StunServer, str, Answer]] = []
    failures: list[tuple[str, str]] = []
    for server in servers:
        try:
            ip = await resolve(server.host)
            if answers and (ip, server.port) == (answers[0][1], answers[0][0].port):
                continue  # the same server under another name: its answer says nothing new
            answer = await asker(transport, ip, server.port, timeout)
        except StunError as exc:
            failures.append((str(server), str(exc)))
            continue
        answers.append((server, ip, answer))
        if len(answers) == 1 and answer.mapped == answer.local:
            break
        if len(answers) == 2:
            break
    if not answers:
        return Discovery(None, "unknown", failures=tuple(failures))
    first_server, _, first = answers[0]
    if first.mapped == first.local:
        nat_type = "none"
    elif len(answers) < 2:
        nat_type = "unknown"
    else:
        nat_type = "full_cone" if answers[1][2].mapped == first.mapped else "symmetric"
    return Discovery(first.mapped, nat_type, first.local, str(first_server), tuple(failures),
                     tuple((str(s), a.mapped) for s, _, a in answers))
