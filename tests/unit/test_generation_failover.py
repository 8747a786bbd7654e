"""generation.run_request's (and Frontend.model_info's) answer to each kind of worker failure,
against a stand-in for Serve's deployment handle (`handle.options(stream=True).generate.remote(routed)`
-> an async iterator of TokenDeltas; `handle.model_info.remote()`); the real handle and worker are
exercised by tests/integration/test_reliability_faults.py."""

import asyncio

import pytest
import ray

from kvmesh.cluster.engine_loop import EngineUnavailable
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.generation import MAX_ATTEMPTS, run_request
from kvmesh.cluster.messages import ModelInfo, RoutedRequest
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.protocol import TokenDelta
from kvmesh.sampling_params import SamplingParams
from kvmesh.serve_config import parse_config
from handle_support import Handle


def routed():
    return RoutedRequest("r", [1, 2, 3], SamplingParams(max_tokens=2))


def run(handle, request):
    async def main():
        return [d async for d in run_request(handle, request)]
    return asyncio.run(main())


def tokens(ids, reason=None):
    return TokenDelta("r", ids, "x" * len(ids), finish_reason=reason)


def test_a_request_whose_engine_died_before_its_first_token_is_run_again_elsewhere():
    handle = Handle([EngineUnavailable("w1", "engine process died")], [tokens([5]), tokens([6], "length")])
    request = routed()
    out = run(handle, request)
    assert [d.token_ids for d in out] == [[5], [6]] and out[-1].finish_reason == "length"
    assert request.attempt == 1 and handle.avoided == [[], ["w1"]]  # the retry ranks w1 last


def test_a_stream_whose_engine_died_after_tokens_ends_with_an_error_delta():
    handle = Handle([tokens([5]), EngineUnavailable("w1", "engine process died")])
    out = run(handle, routed())
    assert out[0].token_ids == [5] and out[-1].finish_reason == "error" and "died" in out[-1].error
    assert handle.attempts == []  # not re-run: the client has seen a token


def test_any_other_worker_exception_ends_the_request_as_an_error_delta_not_an_exception():
    handle = Handle([ValueError("a bug in the worker")], [tokens([5], "length")])
    out = run(handle, routed())
    assert len(out) == 1 and out[0].finish_reason == "error" and "ValueError" in out[0].error
    assert len(handle.attempts) == 1  # not re-run: the worker's code failed, not its process


def test_every_retry_is_counted_also_of_a_request_that_ends_in_an_error():
    died = [EngineUnavailable(f"w{i}", "engine process died") for i in range(MAX_ATTEMPTS)]
    retries = []
    request = routed()

    async def main():
        return [d async for d in run_request(Handle(*[[e] for e in died]), request,
                                             on_retry=lambda: retries.append(request.attempt))]
    out = asyncio.run(main())
    assert out[-1].finish_reason == "error" and "after 3 attempts" in out[-1].error
    assert retries == list(range(1, MAX_ATTEMPTS))


class ModelInfoHandle:
    """`handle.model_info.remote()`: raises each of `failures` in turn, then answers."""

    def __init__(self, *failures):
        self.failures = list(failures)
        self.calls = 0

    @property
    def model_info(self):
        return self

    async def remote(self):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return ModelInfo("tiny-llama", max_model_len=512, block_size=16, hash_salt=b"")


def frontend(handle) -> Frontend:
    return Frontend(parse_config({"model": "random:tiny-llama"}), worker_handle=handle)


def test_the_first_model_info_call_is_asked_again_when_its_worker_died():
    handle = ModelInfoHandle(ray.exceptions.ActorDiedError())
    info = asyncio.run(frontend(handle).model_info())
    assert info.max_model_len == 512 and handle.calls == 2


def test_model_info_with_every_worker_dead_is_a_503_not_a_bare_exception():
    handle = ModelInfoHandle(*[ray.exceptions.ActorDiedError() for _ in range(MAX_ATTEMPTS)])
    with pytest.raises(ApiError) as e:
        asyncio.run(frontend(handle).model_info())
    assert e.value.status == 503 and "ActorDiedError" in e.value.message
    assert handle.calls == MAX_ATTEMPTS
