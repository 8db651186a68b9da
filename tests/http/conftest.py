"""Fixtures for the tests that drive a live gateway from plain (sync) test functions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as http:
        yield http
