"""Fixtures the integration modules share; each module starts its own `cluster` fixture."""

import pytest


@pytest.fixture(scope="module")
def openai_client(cluster):
    """The official openai client of the module's `cluster`, without retries (a test sees the
    first answer)."""
    import openai

    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0)
