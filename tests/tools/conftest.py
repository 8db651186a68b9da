"""The simulator tests' names for the shared fixtures of tests/conftest.py."""

from __future__ import annotations

import aiohttp
import pytest

from tests.conftest import StartSimulator


@pytest.fixture
def start_sim(start_simulator_at: StartSimulator) -> StartSimulator:
    return start_simulator_at


@pytest.fixture
def session(http: aiohttp.ClientSession) -> aiohttp.ClientSession:
    return http
