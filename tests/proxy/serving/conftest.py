"""The in-process tenant tests' fixtures: a provider stand-in (tests/fakes.py's FakeProvider, a fake:
no remote provider can be reached from here) and an exit stack for what a test serves."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator, Iterator

import pytest

from fakes import FakeProvider
from metered import PROVIDER_KEY


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    fake = FakeProvider(PROVIDER_KEY).start()
    yield fake
    fake.stop()


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as s:
        yield s
