"""DNS names as backends (`upstream/discovery.py`), against a DNS server the test runs."""

from __future__ import annotations

from typing import Any

import dns.exception
import pytest

from gateway.config import (
    BackendSettings,
    DiscoverySettings,
    LaneSettings,
    Settings,
    validate,
)
from gateway.upstream.discovery import DnsDiscovery, backend_url, make_resolver, nameserver, resolve
from gateway.upstream.membership import entry_of, lane_members
from tests.dns_server import records_server


class Events:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    warning = info


def test_nameservers_and_urls_are_spelled_as_operators_write_them() -> None:
    assert (nameserver("10.0.0.10").address, nameserver("10.0.0.10").port) == ("10.0.0.10", 53)
    assert nameserver("127.0.0.1:5353").port == 5353
    assert (nameserver("[::1]:5353").address, nameserver("[::1]:5353").port) == ("::1", 5353)
    assert backend_url("10.1.2.3", 80) == "http://10.1.2.3:80"
    assert backend_url("fd00::1", 8000) == "http://[fd00::1]:8000"


def test_a_lane_naming_a_dns_entry_uses_its_addresses() -> None:
    settings = validate(
        Settings(
            backends=[BackendSettings(dns="tgi.models:80", name="tgi")],
            lanes=[LaneSettings(name="interactive"), LaneSettings(name="bulk", backends=["tgi"])],
        )
    )
    assert entry_of("tgi@10.0.0.1") == "tgi"
    members = lane_members(settings.lanes, ["tgi@10.0.0.1", "tgi@10.0.0.2"])
    assert members == {"interactive": None, "bulk": ["tgi@10.0.0.1", "tgi@10.0.0.2"]}


async def test_each_address_becomes_a_backend_with_the_entrys_settings() -> None:
    async with records_server(ttl_s=3) as server:
        server.records["tgi.models.test"] = ["127.0.0.3", "127.0.0.2"]
        settings = validate(
            Settings(
                backends=[
                    BackendSettings(url="http://127.0.0.9:8000", name="fixed"),
                    BackendSettings(dns="tgi.models.test:8080", max_concurrency=3, weight=2.0),
                ],
                discovery=DiscoverySettings(nameservers=[f"127.0.0.1:{server.port}"]),
            )
        )
        events = Events()

        async def nothing() -> None:
            return None

        discovery = DnsDiscovery(events, nothing)
        discovery.configure(settings)
        assert await discovery.refresh()
        assert discovery.known["tgi.models.test:8080"].ttl_s == 3
        found = discovery.backends(settings)
        assert [(b.name, b.url) for b in found] == [
            ("fixed", "http://127.0.0.9:8000"),
            ("tgi.models.test@127.0.0.2", "http://127.0.0.2:8080"),
            ("tgi.models.test@127.0.0.3", "http://127.0.0.3:8080"),
        ]
        assert {(b.max_concurrency, b.weight, b.dns) for b in found[1:]} == {(3, 2.0, "")}
        assert not await discovery.refresh()  # the same answer: nothing changed

        del server.records["tgi.models.test"]  # NXDOMAIN: the last known addresses stay
        assert not await discovery.refresh()
        assert len(discovery.backends(settings)) == 3
        assert events.lines[-1][0] == "dns_resolution_failed"

        server.records["tgi.models.test"] = []  # the name, with no server (scaled to zero)
        assert await discovery.refresh()
        assert [b.name for b in discovery.backends(settings)] == ["fixed"]


async def test_no_answer_in_time_is_a_failed_resolution() -> None:
    resolver = make_resolver(DiscoverySettings(nameservers=["127.0.0.1:9"]))
    with pytest.raises(dns.exception.DNSException):
        await resolve(resolver, "nothing.test", timeout_s=0.3)
