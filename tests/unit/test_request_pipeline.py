"""The request pipeline that HTTP and gRPC share (cluster/pipeline.py), without a cluster: what it
refuses before the workers, what a stream does with its first delta, an Abort, an early close, and
what it counts. The workers are the handle stand-in of handle_support.py; the protocols on a live
cluster are tests/integration (test_fuzz_http_grpc.py, test_grpc_identity_cancel.py, ...)."""

import asyncio

import pytest

from kvmesh.cluster.auth import ApiKeys
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.messages import ModelInfo
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.cluster.pipeline import GenerationRequest, Prompt, RequestPipeline
from kvmesh.protocol import TokenDelta
from kvmesh.sampling_params import SamplingParams
from kvmesh.serve_config import parse_config
from handle_support import Handle

MAX_MODEL_LEN = 64


def pipeline(handle=None, limits: dict | None = None, keys=()) -> RequestPipeline:
    config = parse_config({"model": "random:tiny-llama", "limits": limits or {}})
    fe = Frontend(config, worker_handle=handle)
    fe._info = ModelInfo("tiny-llama", max_model_len=MAX_MODEL_LEN, block_size=16, hash_salt=b"")
    return RequestPipeline(fe, RequestLimits(config.limits), ApiKeys(keys))


def request(token_ids=(1, 2, 3), max_tokens=None, **kw) -> GenerationRequest:
    return GenerationRequest(
        Prompt("prompt_token_ids", token_ids=list(token_ids)),
        lambda budget: SamplingParams(max_tokens=max_tokens or min(16, budget)),
        max_tokens=max_tokens, **kw)


def delta(ids, reason=None, error=None):
    return TokenDelta("r", ids, "x" * len(ids), finish_reason=reason, error=error)


def requests_counted(p: RequestPipeline, status: int) -> float:
    return p.frontend.metrics.requests.labels(model=p.frontend.model_name, status=str(status))._value.get()


def test_a_caller_without_a_valid_key_is_refused_with_401():
    p = pipeline(keys=["sk-right"])
    p.authorize("api", "Bearer sk-right")
    p.authorize("health", None)  # open unless server.auth_health
    with pytest.raises(ApiError) as e:
        p.authorize("api", "Bearer sk-wrong")
    assert e.value.status == 401 and e.value.code == "invalid_api_key"


def test_admission_refuses_by_name_what_does_not_fit():
    p = pipeline(limits={"max_prompt_tokens": 10, "max_output_tokens": 20})
    cases = {"model": request(model="another-model"),
             "prompt_token_ids": request(token_ids=range(1, 12)),  # over max_prompt_tokens
             "max_tokens": request(max_tokens=21)}                 # over max_output_tokens
    for param, req in cases.items():
        with pytest.raises(ApiError) as e:
            asyncio.run(p.admit(req))
        assert e.value.param == param and e.value.status in (400, 404), e.value.message


def test_the_output_budget_is_the_context_left_and_a_request_past_it_is_refused():
    p = pipeline()
    admitted = asyncio.run(p.admit(request(token_ids=range(1, 61))))
    assert admitted.routed.sampling_params.max_tokens == 4  # 64 - 60: the default fits the budget
    with pytest.raises(ApiError) as e:
        asyncio.run(p.admit(request(token_ids=range(1, 61), max_tokens=5)))
    assert e.value.param == "max_tokens" and "only 4 tokens of context are left" in e.value.message


def run_stream(p, abort=None, take=None):
    """Admit a request, stream it; take at most `take` deltas, then close the stream."""
    async def main():
        admitted = await p.admit(request())
        stream = await p.stream(admitted, abort)
        out = []
        async with stream:
            async for d in stream:
                out.append(d)
                if abort is not None and len(out) == 1:
                    abort.set()
                if take is not None and len(out) == take:
                    break
        return out
    return asyncio.run(main())


def test_a_refusal_before_any_token_is_raised_before_the_response_starts():
    handle = Handle([delta([], "error", "invalid_request: the prompt is too long")])
    with pytest.raises(ApiError) as e:
        run_stream(pipeline(handle))
    assert (e.value.status, e.value.param) == (400, "prompt_token_ids")
    assert e.value.message == "the prompt is too long"


def test_an_engine_refusal_of_a_request_field_names_that_field():
    """The engine's own refusal (n over max_num_seqs), as the worker sends it, is a 400 naming n."""
    from kvmesh import LLM
    from kvmesh.cluster.engine_core import rejected
    from kvmesh.protocol import EngineRequest

    llm = LLM("random:tiny-llama", device="cpu", max_num_seqs=2)
    req = EngineRequest("r", [1, 2, 3], SamplingParams(n=3, max_tokens=2))
    with pytest.raises(ValueError) as refusal:
        llm.engine.validate_request(req)
    handle = Handle([rejected(req, refusal.value)])
    with pytest.raises(ApiError) as e:
        run_stream(pipeline(handle))
    assert (e.value.status, e.value.param) == (400, "n") and "max_num_seqs" in e.value.message


def test_a_whole_request_the_engine_refused_after_tokens_is_a_400_naming_the_field_not_a_503():
    """A grammar that leads where no token fits, after some tokens (worker/engine.py's message):
    the request is at fault, so a retry would fail the same way; a stream ends with an error
    chunk instead (tests/integration/test_structured_serving.py)."""
    message = "invalid_request: structured_outputs: the grammar allows no token after 1 tokens"
    p = pipeline(Handle([delta([5]), delta([], "error", message)]))

    async def main():
        return await p.whole(await p.admit(request()))
    with pytest.raises(ApiError) as e:
        asyncio.run(main())
    assert (e.value.status, e.value.param, e.value.retry_after_s) == (400, "structured_outputs", None)
    assert e.value.message == "structured_outputs: the grammar allows no token after 1 tokens"


def test_a_worker_that_fails_before_the_first_token_is_a_503_worker_failed_to_retry():
    handle = Handle([delta([], "error", "the worker failed: ValueError")])
    with pytest.raises(ApiError) as e:
        run_stream(pipeline(handle))
    assert (e.value.status, e.value.code, e.value.retry_after_s) == (503, "worker_failed", 1)


def test_an_unknown_model_is_a_404_model_not_found():
    with pytest.raises(ApiError) as e:
        asyncio.run(pipeline().admit(request(model="another-model")))
    assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")


def test_a_finished_stream_is_counted_once_after_its_last_delta():
    p = pipeline(Handle([delta([5]), delta([6, 7], "length")]))
    out = run_stream(p)
    assert [d.token_ids for d in out] == [[5], [6, 7]] and out[-1].finish_reason == "length"
    assert requests_counted(p, 200) == 1
    assert p.frontend.metrics.generation_tokens.labels(model=p.frontend.model_name)._value.get() == 3


def test_abort_cancels_the_worker_call_and_ends_the_stream_with_an_abort_delta():
    handle = Handle([delta([5]), asyncio.Event(), delta([6], "length")])  # the worker runs on
    p = pipeline(handle)
    out = run_stream(p, abort=asyncio.Event())
    assert [d.finish_reason for d in out] == [None, "abort"]
    assert handle.responses[0].cancelled
    assert requests_counted(p, 200) == 0  # aborted: no answer was completed


def test_closing_a_stream_early_cancels_the_worker_call():
    handle = Handle([delta([5]), delta([6]), delta([7], "length")])
    p = pipeline(handle)
    assert len(run_stream(p, take=1)) == 1
    assert handle.responses[0].cancelled and requests_counted(p, 200) == 0


class Stall(asyncio.Event):
    """A worker still generating; `reached` is set once the request waits on it."""

    def __init__(self):
        super().__init__()
        self.reached = asyncio.Event()

    async def wait(self):
        self.reached.set()
        return await super().wait()


def aborts_counted(p: RequestPipeline) -> float:
    return p.frontend.metrics.vllm.success.labels(
        model_name=p.frontend.model_name, finished_reason="abort")._value.get()


def test_a_non_streaming_request_whose_client_goes_is_counted_as_aborted():
    async def main():
        stall = Stall()
        p = pipeline(Handle([TokenDelta("r", [5], "x", token_times=[1.0]),
                             TokenDelta("r", [6], "x", token_times=[1.25]), stall]))
        whole = asyncio.ensure_future(p.whole(await p.admit(request())))
        await stall.reached.wait()
        whole.cancel()  # what Serve does to the handler when the HTTP client disconnects
        with pytest.raises(asyncio.CancelledError):
            await whole
        return p
    p = asyncio.run(main())
    assert aborts_counted(p) == 1 and requests_counted(p, 200) == 0
    assert p.frontend.metrics.aborted.labels(model=p.frontend.model_name)._value.get() == 1
    itl = p.frontend.metrics.vllm.itl.labels(model_name=p.frontend.model_name)
    assert itl._sum.get() == 0.25  # the one gap between its two tokens


class Barrier(asyncio.Event):
    """Every worker call waits here until `calls` calls have been made: a request of several
    prompts finishes only if all its prompts were sent to the workers before any finished."""

    def __init__(self, handle: Handle, calls: int):
        super().__init__()
        self.handle, self.calls = handle, calls

    async def wait(self):
        if len(self.handle.responses) >= self.calls:
            self.set()
        return await super().wait()


def run_several(handle: Handle, scripts_after_barrier: list[list], num_prompts: int):
    barrier = Barrier(handle, num_prompts)
    handle.attempts = [[barrier, *script] if i < num_prompts else script
                       for i, script in enumerate(scripts_after_barrier)]

    async def main():
        p = pipeline(handle)
        admitted = [await p.admit(request(token_ids=[i + 1, 2, 3])) for i in range(num_prompts)]
        return p, await asyncio.wait_for(p.whole_of_several(admitted), timeout=10)  # sequential: the first waits forever
    return asyncio.run(main())


def test_several_prompts_run_at_once_and_answer_in_prompt_order():
    handle = Handle()
    scripts = [[delta([10 + i]), delta([20 + i], "length")] for i in range(3)]
    p, results = run_several(handle, scripts, 3)
    assert [r.token_ids for r in results] == [[10, 20], [11, 21], [12, 22]]
    assert [r.prompt_token_ids[0] for r in handle.routed] == [1, 2, 3]
    assert requests_counted(p, 200) == 3


def test_a_prompt_whose_worker_dies_is_run_again_as_a_single_request_is():
    from kvmesh.cluster.engine_loop import EngineUnavailable

    handle = Handle()
    scripts = [[delta([10]), delta([20], "length")],
               [delta([11]), EngineUnavailable("w1", "engine process died")],  # after a token
               [delta([12]), delta([22], "length")],
               [delta([31]), delta([41], "length")]]  # prompt 1's second attempt
    p, results = run_several(handle, scripts, 3)
    assert [r.token_ids for r in results] == [[10, 20], [31, 41], [12, 22]]
    assert handle.avoided[-1] == ["w1"]  # the retry ranks the dead worker last


def test_a_finished_stream_observes_each_gap_between_its_tokens():
    p = pipeline(Handle([TokenDelta("r", [5], "x", token_times=[1.0]),
                         TokenDelta("r", [6, 7], "xy", finish_reason="length",
                                    token_times=[1.5, 1.75])]))  # two steps merged on the way
    run_stream(p)
    itl = p.frontend.metrics.vllm.itl.labels(model_name=p.frontend.model_name)
    from kvmesh.cluster.metrics import VLLM_ITL_BUCKETS

    counts = dict(zip(VLLM_ITL_BUCKETS, (bucket.get() for bucket in itl._buckets)))
    assert itl._sum.get() == 0.75 and counts[0.3] == 1 and counts[0.5] == 1  # not 0.375 twice


def test_several_prompts_streams_start_at_once_in_prompt_order():
    handle = Handle()
    barrier = Barrier(handle, 3)
    handle.attempts = [[barrier, delta([10 + i]), delta([20 + i], "length")] for i in range(3)]

    async def main():
        p = pipeline(handle)
        admitted = [await p.admit(request(token_ids=[i + 1, 2, 3])) for i in range(3)]
        # one after another, the first stream's first delta would wait for the other two calls
        streams = await asyncio.wait_for(p.streams_of_several(admitted), timeout=10)
        out = []
        for stream in streams:
            async with stream:
                out.append([d.token_ids for d in [d async for d in stream]])
        return out
    assert asyncio.run(main()) == [[[10], [20]], [[11], [21]], [[12], [22]]]


def test_a_refused_prompt_closes_the_streams_started_beside_it():
    handle = Handle()
    barrier = Barrier(handle, 2)
    handle.attempts = [[barrier, delta([10]), asyncio.Event()],
                       [barrier, delta([], "error", "invalid_request: no")]]

    async def main():
        p = pipeline(handle)
        admitted = [await p.admit(request(token_ids=[i + 1, 2])) for i in range(2)]
        with pytest.raises(ApiError) as e:
            await asyncio.wait_for(p.streams_of_several(admitted), timeout=10)
        return e.value
    error = asyncio.run(main())
    assert error.status == 400 and handle.responses[0].cancelled
