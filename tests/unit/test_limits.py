"""Per-request limits (cluster/limits.py): body size, prompt tokens, output tokens."""

import asyncio

import pytest

from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.serve_config import parse_config


def limits(**kw):
    return RequestLimits(parse_config({"limits": kw}).limits)


class _Request:
    """The two things RequestLimits.read_body uses of a Starlette request."""

    def __init__(self, chunks, content_length=None):
        self.headers = {} if content_length is None else {"content-length": str(content_length)}
        self._chunks = chunks
        self.chunks_read = 0

    async def stream(self):
        for c in self._chunks:
            self.chunks_read += 1
            yield c


def test_a_body_within_the_limit_is_read_whole():
    req = _Request([b"a" * 1000, b"b" * 24])
    assert asyncio.run(limits(max_body_bytes=1024).read_body(req)) == b"a" * 1000 + b"b" * 24


def test_a_declared_oversize_body_is_refused_before_reading():
    req = _Request([b"x" * 10], content_length=5000)
    with pytest.raises(ApiError) as e:
        asyncio.run(limits(max_body_bytes=1024).read_body(req))
    assert e.value.status == 413 and "limits.max_body_bytes" in e.value.message
    assert req.chunks_read == 0


def test_an_undeclared_oversize_body_is_refused_as_soon_as_it_passes_the_limit():
    req = _Request([b"x" * 600] * 100)
    with pytest.raises(ApiError) as e:
        asyncio.run(limits(max_body_bytes=1024).read_body(req))
    assert e.value.status == 413 and req.chunks_read == 2


def test_prompt_limit_names_the_field():
    limits(max_prompt_tokens=10).check_prompt(10, "prompt")
    with pytest.raises(ApiError) as e:
        limits(max_prompt_tokens=10).check_prompt(11, "messages")
    assert e.value.status == 400 and e.value.param == "messages"
    assert e.value.code == "context_length_exceeded"
    limits().check_prompt(10**6, "prompt")  # no limit: the model's own applies later


def test_output_budget_caps_the_default_and_refuses_more_than_the_cap():
    capped = limits(max_output_tokens=64)
    assert capped.output_budget(None, 1000, "max_tokens") == 64
    assert capped.output_budget(None, 10, "max_tokens") == 10
    assert capped.output_budget(64, 1000, "max_tokens") == 64
    with pytest.raises(ApiError) as e:
        capped.output_budget(65, 1000, "max_completion_tokens")
    assert e.value.param == "max_completion_tokens" and "limits.max_output_tokens" in e.value.message
    assert limits().output_budget(5000, 1000, "max_tokens") == 1000  # no cap: the context decides
