"""The router tests run their servers inside the test's asyncio loop (anyio plugin)."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
