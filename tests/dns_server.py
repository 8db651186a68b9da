"""A DNS server for tests: answers A records from a dict the test changes, on a loopback
UDP port (`[discovery] nameservers` points the gateway at it). Built on dnspython's own
message parsing, the library the gateway resolves with.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class RecordsServer(asyncio.DatagramProtocol):
    """`records`: name (without the final dot) -> its A addresses; a name not there gets
    NXDOMAIN. `queries` counts the questions asked."""

    def __init__(self, ttl_s: int = 1) -> None:
        self.records: dict[str, list[str]] = {}
        self.ttl_s = ttl_s
        self.queries = 0
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        self.queries += 1
        response = dns.message.make_response(query)
        question = query.question[0]
        addresses = self.records.get(question.name.to_text().rstrip("."))
        if addresses is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and addresses:
            response.answer.append(
                dns.rrset.from_text_list(question.name, self.ttl_s, "IN", "A", addresses)
            )
        assert self._transport is not None
        self._transport.sendto(response.to_wire(), addr)


@asynccontextmanager
async def records_server(ttl_s: int = 1) -> AsyncIterator[RecordsServer]:
    server = RecordsServer(ttl_s)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: server, local_addr=("127.0.0.1", 0))
    server.port = transport.get_extra_info("sockname")[1]
    try:
        yield server
    finally:
        transport.close()
