"""docs/SERVING.md "Use it" through "API fields", without Ray: behaviours the doc states that no
other unit test would catch if they stopped being true (the intro, "Run it" and "Tensor
parallelism": test_doc_claims_serving_cluster.py).

- the limits the API tables name: logprobs / top_logprobs / prompt_logprobs at most 20, n and
  best_of at most 32;
- the sampler's order: penalties after logit_bias, as vLLM;
- refusals that say what to use instead (`functions` -> `tools`);
- the HTTP routes of the ingress (cluster/ingress.py, driven without Serve: its handle to the
  workers is tests/unit/handle_support.py's stand-in): `user` is the session key, a model card
  under the path the model was given as, /tokenize's `add_special_tokens` default;
- gRPC's `best_of` (only equal to `n`) and request labels (at most 256 characters).
"""

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from starlette.requests import Request

from kvmesh.cluster.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                            parse_request, sampling_params)
from kvmesh.protocol import TokenDelta
from kvmesh.sampling_params import SamplingParams
from handle_support import Handle
from ingress_support import ingress_without_serve

MODEL = "random:tiny-llama"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def refusal(body: dict, cls) -> ApiError:
    """The ApiError parsing `body` and making its SamplingParams raises."""
    with pytest.raises(ApiError) as e:
        sampling_params(parse_request(body, cls), 64)
    return e.value


# ---- limits the tables name --------------------------------------------------------------------

@pytest.mark.parametrize("body, cls, field", [
    (chat(logprobs=True), ChatCompletionRequest, "top_logprobs"),
    (completion(), CompletionRequest, "logprobs"),
    (chat(), ChatCompletionRequest, "prompt_logprobs"),
    (completion(), CompletionRequest, "prompt_logprobs"),
])
def test_logprobs_top_logprobs_and_prompt_logprobs_take_at_most_20(body, cls, field):
    """API fields: "`logprobs`, `top_logprobs` ... yes (at most 20)"; prompt_logprobs: "k at most 20"."""
    sampling_params(parse_request({**body, field: 20}, cls), 64)
    error = refusal({**body, field: 21}, cls)
    assert (error.status, error.param) == (400, field)
    assert "20" in error.message


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_n_and_best_of_are_at_most_32(field):
    """"`n` or `best_of` above it is refused (a 400 naming that field), and both are at most 32"."""
    sampling_params(parse_request(completion(**{"n": 2, field: 32}), CompletionRequest), 64)
    error = refusal(completion(**{"n": 2, field: 33}), CompletionRequest)
    assert (error.status, error.param) == (400, field)
    assert "32" in error.message


# ---- penalties after logit_bias ----------------------------------------------------------------

def test_penalties_apply_after_logit_bias_as_vllm():
    """API fields: "`presence_penalty`, `frequency_penalty`, `repetition_penalty` | yes (after
    `logit_bias`, as vLLM)". Token 1 (in the prompt) has logit 1 and a bias of -3; token 2, -3.
    Bias first: 1 - 3 = -2, then the repetition penalty makes it -4, below token 2: token 2 wins.
    Penalty first: 1 / 2 - 3 = -2.5, above token 2: token 1 would win."""
    from kvmesh.worker.sampler import Sampler

    logits = torch.tensor([[-10.0, 1.0, -3.0, -10.0]])  # [1 request, vocab 4]
    params = SamplingParams(temperature=0, max_tokens=4, logit_bias={1: -3.0}, repetition_penalty=2.0)
    request = SimpleNamespace(sampling_params=params, prompt_token_ids=[1], output_token_ids=[],
                              generator=None, grammar=None)
    assert Sampler(torch.device("cpu")).sample(logits.clone(), [request]).token_ids == [2]
    # the same request without the bias: the penalty alone leaves token 1 ahead (0.5 > -3)
    unbiased = SimpleNamespace(**{**vars(request), "sampling_params": SamplingParams(
        temperature=0, max_tokens=4, repetition_penalty=2.0)})
    assert Sampler(torch.device("cpu")).sample(logits.clone(), [unbiased]).token_ids == [1]


# ---- refusals that say what to use -------------------------------------------------------------

@pytest.mark.parametrize("field, value, instead", [
    ("functions", [{"name": "f"}], "use tools"), ("function_call", "auto", "use tool_choice")])
def test_deprecated_function_fields_are_refused_naming_the_field_and_what_to_use(field, value, instead):
    """API fields: "`functions`, `function_call` (chat, deprecated) | 400 naming the field; use `tools`"."""
    with pytest.raises(ApiError) as e:
        parse_request(chat(**{field: value}), ChatCompletionRequest)
    assert (e.value.status, e.value.param) == (400, field)
    assert instead in e.value.message


# ---- the ingress's HTTP routes, without Serve ----------------------------------------------------

def ingress(handle=None, model=MODEL):
    return ingress_without_serve(model, handle)


def http_request(body: dict | None = None, headers: dict | None = None) -> Request:
    raw = json.dumps(body).encode() if body is not None else b""
    sent = False

    async def receive():
        nonlocal sent
        if sent:  # nothing more: a client that has sent its body and waits
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    head = [(b"content-type", b"application/json")]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": head,
                    "query_string": b""}, receive)


def body_of(response) -> dict:
    return response if isinstance(response, dict) else json.loads(response.body)


def test_the_user_field_is_the_requests_session_key_for_routing():
    """API fields: "`user` | yes: the session key of the `session` routing policy"."""
    handle = Handle([TokenDelta("r", [65], "A", finish_reason="length", num_prompt_tokens=2,
                                num_output_tokens=1)],
                    [TokenDelta("r", [65], "A", finish_reason="length", num_prompt_tokens=2,
                                num_output_tokens=1)])
    ing = ingress(handle)
    answer = asyncio.run(ing._complete(http_request(completion(max_tokens=1, user="alice")), "completion"))
    assert body_of(answer)["choices"][0]["text"] == "A"
    asyncio.run(ing._complete(http_request(completion(max_tokens=1)), "completion"))
    assert [r.session_key for r in handle.routed] == ["alice", None]


def test_a_model_card_is_served_under_the_path_the_model_was_given_as(tmp_path):
    """Use it: "`GET /v1/models/{model}` (the card under the served name or its path as given;
    another name is a 404, `model_not_found`)"."""
    from kvmesh.worker.presets import build_byte_tokenizer

    model_dir = tmp_path / "my-model"
    build_byte_tokenizer(512).save_pretrained(model_dir)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    ing = ingress(model=str(model_dir))
    assert ing.frontend.model_name == "my-model"
    for name in ("my-model", str(model_dir)):
        card = body_of(asyncio.run(ing.model(name, http_request())))
        assert (card["id"], card["object"]) == ("my-model", "model")
    missing = asyncio.run(ing.model("other", http_request()))
    assert missing.status_code == 404 and body_of(missing)["error"]["code"] == "model_not_found"


def test_tokenize_adds_special_tokens_to_a_prompt_unless_asked_not_to_as_completions_tokenize():
    """API fields: "`add_special_tokens` defaults to true for a prompt and false for messages, as
    there and as vLLM's"."""
    ing = ingress()
    calls = []
    real_encode = ing.frontend.tokenizer.encode

    def encode(text, add_special_tokens):
        calls.append(add_special_tokens)
        return real_encode(text, add_special_tokens=add_special_tokens)

    ing.frontend.tokenizer.encode = encode
    plain = body_of(asyncio.run(ing.tokenize(http_request({"model": MODEL, "prompt": "Hello"}))))
    bare = body_of(asyncio.run(ing.tokenize(http_request({"model": MODEL, "prompt": "Hello",
                                                          "add_special_tokens": False}))))
    assert calls == [True, False]
    # the byte tokenizer adds none (a BOS-adding one: tests/integration/test_prompt_rendering.py)
    assert plain == bare == {"count": 5, "max_model_len": 128, "tokens": list(b"Hello"), "token_strs": None}


def test_tokenize_with_messages_takes_the_chat_fields():
    """API fields: "`POST /tokenize` takes `{"model", "prompt", "add_special_tokens",
    "return_token_strs"}` or `{"model", "messages", ..., "add_special_tokens", "return_token_strs"}`";
    "Unknown fields are a 400 naming them"."""
    ing = ingress()
    ok = body_of(asyncio.run(ing.tokenize(http_request({"model": MODEL, "messages": MESSAGES,
                                                        "return_token_strs": True}))))
    assert ok["count"] == len(ok["tokens"]) == len(ok["token_strs"]) > 0
    asked = body_of(asyncio.run(ing.tokenize(http_request({"model": MODEL, "messages": MESSAGES,
                                                           "add_special_tokens": True}))))
    assert asked["tokens"] == ok["tokens"]  # the byte tokenizer adds none
    refused = asyncio.run(ing.tokenize(http_request({"model": MODEL, "messages": MESSAGES,
                                                     "best_of": 2})))
    assert refused.status_code == 400
    assert body_of(refused)["error"]["param"] == "best_of"


# ---- gRPC's best_of ------------------------------------------------------------------------------

def test_grpc_takes_best_of_only_equal_to_n():
    """Several completions: `best_of` "refused (400, `best_of`) ... on gRPC unless equal to `n`"."""
    from kvmesh.cluster.grpc_service import sampling_from_proto
    from kvmesh.proto import kvmesh_pb2 as pb

    params = sampling_from_proto(pb.GenerateRequest(prompt="x", n=2, best_of=2))
    assert (params.n, params.best_of) == (2, 2)
    for n, best_of in ((2, 3), (1, 2)):
        with pytest.raises(ApiError) as e:
            sampling_from_proto(pb.GenerateRequest(prompt="x", n=n, best_of=best_of))
        assert (e.value.status, e.value.param) == (400, "best_of")


def test_a_grpc_request_label_holds_at_most_256_characters():
    """Use it: "A client's `GenerateRequest.request_id` is a label of its own (at most 256 characters)";
    without one, the server's name for the request is there."""
    from kvmesh.cluster.grpc_service import _label
    from kvmesh.proto import kvmesh_pb2 as pb

    assert _label(pb.GenerateRequest(request_id="x" * 256), "req-1") == "x" * 256
    assert _label(pb.GenerateRequest(), "req-1") == "req-1"
    with pytest.raises(ApiError) as e:
        _label(pb.GenerateRequest(request_id="x" * 257), "req-1")
    assert (e.value.status, e.value.param) == (400, "request_id") and "256" in e.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_worker_fails_is_counted_as_503(stream):
    """METRICS.md, kvmesh_requests_total: a stream that ends with finish_reason "error" counts as
    503, the status a non-streamed request that fails so is answered (here both, through the
    ingress's handler; the worker failed after its first tokens, so the ingress does not re-run it)."""
    handle = Handle([TokenDelta("r", [65], "A", num_prompt_tokens=2, num_output_tokens=1),
                     TokenDelta("r", [], "", finish_reason="error", error="the worker failed: ValueError")])
    ing = ingress(handle)

    async def answer_and_body():  # in one event loop: the stream's reads belong to it
        answer = await ing._complete(http_request(completion(max_tokens=4, stream=stream)), "completion")
        if not stream:
            return answer, None
        return answer, b"".join([chunk async for chunk in answer.body_iterator]).decode()

    answer, body = asyncio.run(answer_and_body())
    if stream:  # the stream ends with an error chunk and [DONE]; its status was 200 when it began
        assert answer.status_code == 200
        assert '"finish_reason":"error"' in body and body.endswith("data: [DONE]\n\n"), body
    else:
        assert answer.status_code == 503 and "the worker failed" in body_of(answer)["error"]["message"]
    counted = ing.frontend.metrics.requests.labels(model=ing.frontend.model_name, status="503")._value.get()
    assert counted == 1
    ok = ing.frontend.metrics.requests.labels(model=ing.frontend.model_name, status="200")._value.get()
    assert ok == 0


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_ttft_and_the_routed_arrival_count_from_the_request_s_arrival_at_the_ingress(api):
    """METRICS.md: TTFT counts "from the request's arrival at the ingress", and the worker's queue
    time from the arrival it is sent with, so both include the ingress's tokenizing, over HTTP and
    gRPC: here a tokenizer that takes 0.2 s."""
    import time

    from kvmesh.proto import kvmesh_pb2 as pb

    handle = Handle([TokenDelta("r", [65], "A", finish_reason="length", num_prompt_tokens=5,
                                num_output_tokens=1)])
    ing = ingress(handle)
    real_encode = ing.frontend.tokenizer.encode

    def slow_encode(text, add_special_tokens):
        time.sleep(0.2)
        return real_encode(text, add_special_tokens=add_special_tokens)

    ing.frontend.tokenizer.encode = slow_encode

    async def answer_text() -> str:
        if api == "http":
            answer = await ing._complete(http_request(completion(max_tokens=1)), "completion")
            return body_of(answer)["choices"][0]["text"]
        return "".join([m.text async for m in ing.Generate(pb.GenerateRequest(prompt="Hello", max_tokens=1))])

    sent = time.time()
    assert asyncio.run(answer_text()) == "A"
    assert sent <= handle.routed[0].arrival_time < sent + 0.1  # stamped before the tokenizing
    assert ing.frontend.metrics.ttft.labels(model=ing.frontend.model_name)._sum.get() >= 0.2
