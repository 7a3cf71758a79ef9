"""The real SmolLM2 behind a served app, one per test module, and an openai client for it."""

from __future__ import annotations

import pytest

from tests.server.test_server import real_server


@pytest.fixture(scope="module")
def served(smollm2_dir):
    """(engine, base URL)."""
    with real_server(smollm2_dir) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served):
    import openai

    _, url = served
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
