"""generation.run_request's answer to each kind of worker failure, against a stand-in for Serve's
deployment handle (`handle.options(stream=True).generate.remote(routed)` -> an async iterator of
TokenDeltas); the real handle and worker are exercised by tests/integration/test_reliability_faults.py."""

import asyncio

from kvmesh.cluster.engine_loop import EngineUnavailable
from kvmesh.cluster.generation import run_request
from kvmesh.cluster.messages import RoutedRequest
from kvmesh.protocol import TokenDelta
from kvmesh.sampling_params import SamplingParams


class Handle:
    """Runs each attempt's script in turn: a list of TokenDeltas and, optionally, an exception."""

    def __init__(self, *attempts):
        self.attempts = list(attempts)
        self.avoided = []  # routed.avoid_workers as each attempt saw it

    def options(self, stream):
        return self

    @property
    def generate(self):
        return self

    def remote(self, routed):
        self.avoided.append(list(routed.avoid_workers))
        return _Response(self.attempts.pop(0))


class _Response:
    def __init__(self, script):
        self.script = script

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self):
        pass


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
