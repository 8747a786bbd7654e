"""Bad input, tried systematically against a live cluster (one CPU worker, tiny model) over HTTP and
gRPC on 127.0.0.1: hypothesis draws request bodies field by field from valid and invalid values
(wrong types, huge / negative / NaN / infinite numbers, control characters and lone surrogates,
unknown fields, empty messages, stop lists of thousands of strings), plus hand-picked raw bodies
(malformed JSON, invalid UTF-8, not an object).

Every answer is a 2xx or a 4xx whose error names the field (never a 5xx / INTERNAL), and after the
storm (and every few dozen cases within it) the server still answers a fixed greedy request with
exactly the text it gave before. Bounded: a fixed number of derandomized examples, no deadline.
The worker runs its engine on a thread of the replica (`replicas.engine_process: false`), so the
storm also covers that mode; the other cluster tests run the default engine process.
"""

import json

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.cluster.client import grpc_stream
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from cluster_support import MODEL, config_cluster, cpu_config
from reliability_support import http, worker_pids

pytestmark = pytest.mark.slow

MAX_OUTPUT = 8
HTTP_EXAMPLES = 150
GRPC_EXAMPLES = 120
CHECK_EVERY = 40
FUZZ_SETTINGS = settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize=True,
                         database=None, suppress_health_check=list(HealthCheck))

# Fields a 4xx may name (OpenAI request fields, nested paths start with one of them).
HTTP_FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
               "top_p", "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options", "user",
               "prompt_cache_key",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
               "logprobs", "top_logprobs", "echo", "tools", "functions", "logit_bias", "best_of",
               "suffix", "prompt_logprobs", "response_format", "structured_outputs", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
               "tool_choice", "parallel_tool_calls", "function_call",
               # /v1/responses (cluster/responses_api.py)
               "input", "instructions", "max_output_tokens", "text", "store", "previous_response_id",
               "reasoning", "include", "truncation", "metadata")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = cpu_config(limits={"max_output_tokens": MAX_OUTPUT, "max_body_bytes": 262144},
                        replicas={"engine_process": False})
    with config_cluster(tmp_path_factory, config) as c:
        yield c


def test_engine_process_false_runs_the_engine_in_the_replica(cluster, reference_text):
    """SERVING.md: `replicas.engine_process: false` runs the engine on a thread of the replica: the
    worker's actor has no engine child process, and it serves (reference_text is its answer)."""
    import psutil

    (pid,) = worker_pids(cluster).values()
    children = [" ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)]
    assert not [c for c in children if "kvmesh.cluster.engine_process" in c], children
    assert len(reference_text) > 0


REFERENCE = {"model": MODEL, "prompt": "The reference prompt", "max_tokens": MAX_OUTPUT,
             "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference_text(cluster):
    status, body, _ = http(cluster.http_url + "/v1/completions", REFERENCE)
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_OUTPUT
    return body["choices"][0]["text"]


def assert_still_correct(cluster, reference_text):
    status, body, _ = http(cluster.http_url + "/v1/completions", REFERENCE)
    assert status == 200 and body["choices"][0]["text"] == reference_text, body
    msgs = list(grpc_stream(cluster.grpc_target, prompt=REFERENCE["prompt"], max_tokens=MAX_OUTPUT,
                            temperature=0, ignore_eos=True))
    assert "".join(m.text for m in msgs) == reference_text


# ---- strategies ------------------------------------------------------------------------------------

any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=40)  # controls, surrogates
huge_ints = st.sampled_from([-(2**64), -1, 0, 1, 2**31, 2**63, 2**64, 10**30])
weird_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-1e308, 1e308])
json_leaf = st.none() | st.booleans() | huge_ints | st.integers(-5, 600) | weird_floats | any_text
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(any_text, inner, max_size=3), max_leaves=8)


def numbers(lo, hi):
    return st.floats(lo, hi) | st.integers(int(lo) - 2, int(hi) + 2) | weird_floats | json_value


message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot", ""])
     | json_value},
    optional={"content": any_text | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]) | json_value, "text": any_text | json_value}),
        max_size=3) | json_value})

# mostly the served model, sometimes anything
model_field = st.sampled_from([MODEL, MODEL, MODEL, ""]) | any_text | json_value

FIELDS = {
    "max_tokens": st.integers(-3, MAX_OUTPUT + 3) | huge_ints | json_value,
    "temperature": numbers(0, 2), "top_p": numbers(0, 1), "top_k": numbers(-1, 600),
    "min_p": numbers(0, 1), "seed": st.integers(0, 1000) | huge_ints | json_value,
    "presence_penalty": numbers(-2, 2), "frequency_penalty": numbers(-2, 2),
    "repetition_penalty": numbers(0, 10),
    "stop": any_text | st.lists(any_text, max_size=6) | json_value
    | st.integers(60, 5000).map(lambda n: [f"s{i}" for i in range(n)]),
    "n": st.integers(-1, 3) | json_value, "stream": st.booleans() | json_value,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_value,
    "user": any_text | json_value, "prompt_cache_key": any_text | json_value, "ignore_eos": st.booleans() | json_value,
    "logprobs": st.integers(-1, 25) | st.booleans() | json_value,
    "tools": json_value, "logit_bias": json_value, "echo": st.booleans() | json_value,
    "max_completion_tokens": st.integers(-1, MAX_OUTPUT + 2) | json_value,
    "top_logprobs": st.integers(-1, 25) | json_value,
    "prompt_logprobs": st.integers(-1, 25) | json_value, "best_of": st.integers(-1, 4) | json_value,
    # structured outputs and tools (cluster/structured_request.py, cluster/tool_calls.py)
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | json_value},
        optional={"json_schema": st.fixed_dictionaries({"schema": json_value})}) | json_value,
    "structured_outputs": st.fixed_dictionaries({}, optional={
        "regex": any_text | json_value, "choice": st.lists(any_text, max_size=3) | json_value,
        "json": json_value, "grammar": any_text}) | json_value,
    "guided_regex": any_text | json_value, "guided_choice": st.lists(any_text, max_size=3) | json_value,
    "guided_json": json_value,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_value,
}

completion_body = st.fixed_dictionaries(
    {"model": model_field,
     "prompt": any_text | st.lists(st.integers(-2, 520) | huge_ints, max_size=12)
     | st.lists(any_text, max_size=2) | st.lists(st.lists(st.integers(0, 511), max_size=4), max_size=2)
     | json_value},
    optional={**FIELDS, "unknown_field": json_value, "x-extra": json_value})

chat_body = st.fixed_dictionaries(
    {"model": model_field, "messages": st.lists(message, max_size=3) | json_value},
    optional={**FIELDS, "unknown_field": json_value})


text_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image"]) | json_value,
     "text": any_text | json_value})
input_item = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | json_value},
    optional={"type": st.sampled_from(["message", "function_call"]) | json_value,
              "content": any_text | st.lists(text_part, max_size=3) | json_value})
RESPONSES_FIELDS = {
    **{name: FIELDS[name] for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                       "presence_penalty", "frequency_penalty", "repetition_penalty",
                                       "stream", "user", "prompt_cache_key", "tools", "tool_choice")},
    "instructions": any_text | json_value,
    "max_output_tokens": st.integers(-1, MAX_OUTPUT + 2) | json_value,
    "metadata": st.dictionaries(any_text, any_text, max_size=3) | json_value,
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | json_value},
        optional={"name": any_text | json_value, "schema": json_value})}) | json_value,
    "store": st.booleans() | json_value, "previous_response_id": st.none() | any_text,
    "reasoning": st.none() | json_value, "include": json_value,
    "truncation": st.sampled_from(["disabled", "auto"]) | json_value,
    "parallel_tool_calls": st.booleans() | json_value,
}

responses_body = st.fixed_dictionaries(
    {"model": model_field, "input": any_text | st.lists(input_item, max_size=3) | json_value},
    optional={**RESPONSES_FIELDS, "unknown_field": json_value})

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
BODIES = {"completions": completion_body, "chat": chat_body, "responses": responses_body}


def _read_sse(raw: str) -> list[dict]:
    chunks = []
    for line in raw.splitlines():
        if line.startswith("data: {"):
            chunks.append(json.loads(line[6:]))
    return chunks


def _check_http_answer(status, body, request):
    assert status < 500, (status, body, request)
    if status >= 400:
        err = body["error"]
        assert err["message"], body
        if status == 400:
            param = err["param"]
            # a known field, or an unknown one the request sent (e.g. a surrogate in it), or the
            # body itself (a surrogate in a top-level key)
            top = param.split(".")[0] if param else None
            assert top in HTTP_FIELDS or top in request or top == "body", (body, request)
    elif "raw" in body and "input" in request:  # a streamed response: OpenAI's typed events
        events = _read_sse(body["raw"])
        assert events and events[-1]["type"] in ("response.completed", "response.incomplete"), body["raw"][-300:]
    elif "raw" in body:  # a 200 that is not JSON: an SSE stream
        text = body["raw"]
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        chunks = _read_sse(text)
        assert all(c.get("choices") is not None for c in chunks)
        assert not any(ch.get("finish_reason") == "error" for c in chunks for ch in c["choices"])


# ---- HTTP --------------------------------------------------------------------------------------------

def test_http_bad_bodies_get_a_4xx_naming_the_field_and_the_server_keeps_answering(cluster, reference_text):
    count = {"n": 0}

    @FUZZ_SETTINGS
    @given(kind=st.sampled_from(sorted(PATHS)), data=st.data())
    def run(kind, data):
        request = data.draw(BODIES[kind])
        raw = json.dumps(request, allow_nan=True).encode()
        status, body, _ = http(cluster.http_url + PATHS[kind], raw=raw, timeout=60)
        _check_http_answer(status, body, request)
        count["n"] += 1
        if count["n"] % CHECK_EVERY == 0:
            assert_still_correct(cluster, reference_text)

    run()
    assert count["n"] == HTTP_EXAMPLES
    assert_still_correct(cluster, reference_text)


RAW_BODIES = [
    b"", b"{", b"not json", b"[]", b'"a string"', b"42", b"null", b'{"model": ', b"\xff\xfe\xfd",
    b'{"model": "random:tiny-llama", "prompt": "\xc3\x28"}',         # invalid UTF-8 in a string
    b'{"model": "random:tiny-llama", "prompt": "\\ud800"}',         # lone surrogate
    b'{"model": "random:tiny-llama", "prompt": "a\\u0000b\\u001f"}',  # control characters
    b'{"model": "random:tiny-llama", "prompt": "a", "temperature": NaN}',
    b'{"model": "random:tiny-llama", "prompt": "a", "max_tokens": Infinity}',
    b'{"model": "random:tiny-llama", "prompt": "a", "max_tokens": 1e400}',
    b'{"model": "random:tiny-llama", "prompt": "a", "seed": 123456789012345678901234567890}',
    b'{"model": "random:tiny-llama", "prompt": "a", "max_tokens": -1}',
    b'{"model": "random:tiny-llama", "prompt": []}',
    b'{"model": "random:tiny-llama", "messages": []}',
    b'{"model": "random:tiny-llama", "messages": [{}]}',
    b'{"model": "random:tiny-llama", "prompt": "a", "prompt": 5}',
    b'{"model": "random:tiny-llama", "prompt": [1, 2, 99999]}',
    b'{"model": "random:tiny-llama", "prompt": "' + b"[" * 5000 + b'"}',
    b"[" * 100000 + b"]" * 100000,                                    # deep nesting
    json.dumps({"model": MODEL, "prompt": "a", "stop": [str(i) for i in range(5000)]}).encode(),
    json.dumps({"model": MODEL, "prompt": "a", "stop": ["x" * 100000]}).encode(),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_raw_malformed_bodies_are_4xx(cluster, reference_text, path):
    for raw in RAW_BODIES:
        status, body, _ = http(cluster.http_url + path, raw=raw, timeout=60)
        assert 400 <= status < 500 or status == 200, (status, body, raw[:80])
        if status != 200:
            assert body["error"]["message"], body
    assert_still_correct(cluster, reference_text)


def test_json_nested_too_deep_is_a_400_saying_the_body_is_not_json(cluster):
    """docs/SERVING.md "Errors": no field to name, so `param` is null."""
    status, body, _ = http(cluster.http_url + "/v1/completions", raw=b"[" * 100000 + b"]" * 100000, timeout=60)
    assert status == 400 and body["error"]["param"] is None, body
    assert "not valid JSON" in body["error"]["message"], body


# ---- gRPC --------------------------------------------------------------------------------------------

grpc_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)  # protobuf strings are UTF-8
GRPC_FIELDS = ("prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p",
               "top_k", "min_p", "seed", "stop", "logprobs", "model", "request_id", "n", "best_of",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
               "stop_token_ids", "logit_bias", "prompt_logprobs", "echo", "tool_choice")
grpc_float = st.floats(width=32, allow_nan=True, allow_infinity=True)
grpc_token_id = st.integers(0, 2**32 - 1) | st.integers(0, 520)

grpc_request = st.fixed_dictionaries({}, optional={
    "model": st.just(MODEL) | grpc_text,
    "prompt": grpc_text,
    "messages": st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "assistant",
                                                                          "tool", "", "robot"]),
                                   content=grpc_text), max_size=3),
    "prompt_token_ids": st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 520), max_size=10),
    "max_tokens": st.integers(0, 2**32 - 1) | st.integers(0, MAX_OUTPUT + 2),
    "temperature": st.floats(width=32, allow_nan=True, allow_infinity=True),
    "top_p": st.floats(width=32, allow_nan=True, allow_infinity=True),
    "top_k": st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 600),
    "min_p": st.floats(width=32, allow_nan=True, allow_infinity=True),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(grpc_text, max_size=5) | st.integers(60, 3000).map(lambda n: [str(i) for i in range(n)]),
    "logprobs": st.integers(0, 2**32 - 1) | st.integers(0, 25),
    "request_id": grpc_text,
    "session_id": grpc_text,
    "ignore_eos": st.booleans(),
    # beyond sampling's basics (SERVING.md's gRPC fields), at their wire types' extremes too
    "n": st.integers(0, 2**32 - 1) | st.integers(0, 3),
    "best_of": st.integers(0, 2**32 - 1) | st.integers(0, 3),
    "presence_penalty": grpc_float,
    "frequency_penalty": grpc_float,
    "repetition_penalty": grpc_float,
    "min_tokens": st.integers(0, 2**32 - 1) | st.integers(0, MAX_OUTPUT + 2),
    "stop_token_ids": st.lists(grpc_token_id, max_size=5),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(grpc_token_id, grpc_float, max_size=4),
    "skip_special_tokens": st.booleans(),
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(0, 2**32 - 1) | st.integers(0, 25),
    "tool_choice": grpc_text | st.sampled_from(["none", "auto", "required"]),
    "parallel_tool_calls": st.booleans(),
})


def test_grpc_bad_messages_get_invalid_argument_naming_the_field(cluster, reference_text):
    count = {"n": 0}
    channel = grpc.insecure_channel(cluster.grpc_target)
    stub = pb_grpc.GenerationStub(channel)

    @settings(FUZZ_SETTINGS, max_examples=GRPC_EXAMPLES)
    @given(fields=grpc_request)
    def run(fields):
        req = pb.GenerateRequest(**fields)
        try:
            msgs = list(stub.Generate(req, timeout=60))
            assert msgs and msgs[-1].finish_reason in ("stop", "length"), (fields, msgs[-1:])
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (
                e.code(), e.details(), fields)
            assert any(name in e.details() for name in GRPC_FIELDS), (e.details(), fields)
        count["n"] += 1
        if count["n"] % CHECK_EVERY == 0:
            assert_still_correct(cluster, reference_text)

    try:
        run()
        # an empty message: no prompt at all
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
    assert count["n"] == GRPC_EXAMPLES
    assert_still_correct(cluster, reference_text)

