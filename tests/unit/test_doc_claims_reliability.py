"""docs/RELIABILITY.md, without a cluster: behaviours the doc states that no other test would catch
if they stopped being true.

- access control: every key compared in constant time, keys from KVMESH_API_KEYS kept out of the
  emitted Serve config, `/health` and gRPC `Health` behind a key only with `server.auth_health`,
  `kvmesh status --api-key` / `$KVMESH_API_KEY`;
- limits: the 32-characters-per-token default, the 4,096-character line for tokenizing off the
  loop on one thread, `stop` at 64 strings of 512 characters, strictly typed fields;
- gRPC message limits `kvmesh serve` sets for its Ray; the 128 KiB send buffer;
- the KV event hub's log bound; `kvmesh bench soak`'s defaults and verdict.
"""

import asyncio
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvmesh.cluster.auth import ApiKeys
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.messages import ModelInfo
from kvmesh.cluster.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                            parse_request, sampling_params)
from kvmesh.cluster.pipeline import RequestPipeline
from kvmesh.sampling_params import SamplingParams
from kvmesh.serve_config import parse_config

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "random:tiny-llama"


def serve_args(*argv):
    from kvmesh.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


# ---- access control ----------------------------------------------------------------------------

def test_every_key_is_compared_in_constant_time_with_no_early_exit(monkeypatch):
    """"Keys are compared in constant time (`hmac.compare_digest`, every key, no early exit)"."""
    import hmac

    real, calls = hmac.compare_digest, []

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = ApiKeys(["sk-one", "sk-two", "sk-three"])
    for candidate, accepted in (("sk-one", True), ("sk-three", True), ("nope", False),
                                ("sk-one-longer", False)):
        calls.clear()
        assert keys.accepts(candidate) is accepted
        # every configured key was compared, whichever matched (or none), each by compare_digest
        assert sorted(b for _, b in calls) == sorted([b"sk-one", b"sk-two", b"sk-three"]), candidate
        assert all(a == candidate.encode() for a, _ in calls)


def test_keys_from_kvmesh_api_keys_stay_out_of_the_serve_config(tmp_path, monkeypatch):
    """"Keys from the config or `--api-key` travel in the Serve application's config (readable by
    whoever can read Serve's config or `--emit-serve-config` output); keys from `KVMESH_API_KEYS`
    stay in the process environment"."""
    from kvmesh.commands.serve import run_serve

    monkeypatch.setenv("KVMESH_API_KEYS", "sk-env-only-abc123")
    out = tmp_path / "app.yaml"
    assert run_serve(serve_args("--model", MODEL, "--device", "cpu", "--api-key", "sk-cli-xyz789",
                                "--emit-serve-config", str(out))) == 0
    text = out.read_text()
    assert "sk-cli-xyz789" in text
    assert "sk-env-only-abc123" not in text


class _GrpcContext:
    def __init__(self, metadata=()):
        self.metadata, self.code = list(metadata), None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


@pytest.mark.parametrize("auth_health", [False, True])
def test_health_and_grpc_health_need_a_key_only_with_auth_health(auth_health):
    """"`/health` and gRPC `Health` stay open unless `server.auth_health: true`"."""
    from grpc_health.v1 import health_pb2
    from test_ingress_hub_unavailable import StandInHub, call, ingress

    from kvmesh.proto import kvmesh_pb2 as pb

    ing = ingress(StandInHub())
    ing.pipeline = RequestPipeline(ing.frontend, ing.limits,
                                   ApiKeys(["sk-h"], protect_health=auth_health))
    response, _ = call(ing.health)
    assert response.status_code == (401 if auth_health else 200)

    for method, request in ((ing.Health, pb.HealthRequest()),
                            (ing.Check, health_pb2.HealthCheckRequest(service=""))):
        ctx = _GrpcContext()
        if auth_health:
            with pytest.raises(RuntimeError):
                asyncio.run(method(request, ctx))
            assert ctx.code == grpc.StatusCode.UNAUTHENTICATED
            asyncio.run(method(request, _GrpcContext([("authorization", "Bearer sk-h")])))
        else:
            asyncio.run(method(request, ctx))
            assert ctx.code is None


def test_the_ingress_checks_the_key_before_it_reads_the_body():
    """"an unauthenticated request with a head within the limit reaches the ingress, which checks
    the key before it reads the body"."""
    import json

    from starlette.requests import Request
    from test_ingress_hub_unavailable import StandInHub, ingress

    ing = ingress(StandInHub())
    ing.pipeline = RequestPipeline(ing.frontend, ing.limits, ApiKeys(["sk-body"]))

    def post(authorization):
        reads = []

        async def receive():
            reads.append(1)
            return {"type": "http.request", "body": b"{not json", "more_body": False}

        headers = [(b"content-type", b"application/json")]
        if authorization:
            headers.append((b"authorization", authorization.encode()))
        request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                           "headers": headers, "query_string": b""}, receive)
        response = asyncio.run(asyncio.wait_for(ing.completions(request), 10))
        return response.status_code, json.loads(response.body)["error"], reads

    status, error, reads = post(None)
    assert (status, error["code"], reads) == (401, "invalid_api_key", [])  # body never read
    status, error, reads = post("Bearer sk-wrong")
    assert (status, reads) == (401, [])
    status, error, reads = post("Bearer sk-body")
    assert status == 400 and reads  # with the key the body is read (and is not JSON)


def test_kvmesh_status_sends_the_key_from_the_flag_or_the_environment(monkeypatch, capsys):
    """"Clients: `kvmesh client --api-key` / `kvmesh status --api-key` (or `$KVMESH_API_KEY`)"."""
    import json

    from kvmesh.cli import main
    from tests.unit.json_server import json_server

    seen = []

    def answer(path, headers):
        seen.append(headers.get("Authorization"))
        if headers.get("Authorization") != "Bearer sk-status":
            return 401, {"error": {"message": "no", "code": "invalid_api_key"}}
        return 200, ({"status": "ok", "workers": 0} if path == "/health" else {"model": "m", "workers": []})

    with json_server(answer) as url:
        monkeypatch.delenv("KVMESH_API_KEY", raising=False)
        assert main(["status", "--json", "--url", url, "--api-key", "sk-status"]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "ok"
        monkeypatch.setenv("KVMESH_API_KEY", "sk-status")
        assert main(["status", "--json", "--url", url]) == 0
        monkeypatch.delenv("KVMESH_API_KEY")
        assert main(["status", "--json", "--url", url]) != 0
        assert "401" in capsys.readouterr().err
    assert seen[:4] == ["Bearer sk-status"] * 4 and seen[4] is None


# ---- limits ------------------------------------------------------------------------------------

def frontend(limits: dict | None = None) -> Frontend:
    fe = Frontend(parse_config({"model": MODEL, "limits": limits or {}}), worker_handle=None)
    fe._info = ModelInfo("tiny-llama", max_model_len=512, block_size=16, hash_salt=b"")
    return fe


def test_the_character_limit_defaults_to_32_per_token_and_is_context_length_exceeded():
    """`limits.max_prompt_chars` "(default: 32 x `limits.max_prompt_tokens` when that is set, else
    32 x the model's `max_model_len`)"; beyond it "400, `param` `prompt` / `messages`, `code:
    context_length_exceeded`, the message names the characters and the limit"."""
    assert asyncio.run(frontend().max_prompt_chars()) == 32 * 512
    assert asyncio.run(frontend({"max_prompt_tokens": 100}).max_prompt_chars()) == 3200
    with pytest.raises(ApiError) as e:
        asyncio.run(frontend({"max_prompt_tokens": 100}).encode_text("a" * 3201))
    assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "context_length_exceeded")
    assert "3201 characters" in e.value.message and "3200" in e.value.message
    with pytest.raises(ApiError) as e:
        asyncio.run(frontend().encode_chat([{"role": "user", "content": "a" * (32 * 512 + 1)}]))
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")


def test_a_prompt_over_4096_characters_is_tokenized_on_one_thread_off_the_loop():
    """"a prompt over 4,096 characters is tokenized on a thread of the ingress (one thread:
    tokenizers are not safe to share), never on the event loop"."""
    fe = frontend()
    encode, calls, busy, overlaps = fe.tokenizer.encode, [], [0], []

    def recording(*args, **kwargs):
        busy[0] += 1
        overlaps.append(busy[0])
        calls.append((threading.current_thread(), len(args[0])))
        time.sleep(0.2)  # long enough for a second thread, if there were one, to start another
        busy[0] -= 1
        return encode(*args, **kwargs)

    fe.tokenizer.encode = recording

    async def run():
        loop_thread = threading.current_thread()
        await fe.encode_text("x" * 4096)
        await asyncio.gather(fe.encode_text("y" * 4097), fe.encode_text("z" * 5000),
                             fe.encode_chat([{"role": "user", "content": "w" * 4097}]))
        return loop_thread

    loop_thread = asyncio.run(run())
    on_loop = [n for t, n in calls if t is loop_thread]
    off_loop = {t for t, _ in calls if t is not loop_thread}
    assert on_loop == [4096]  # 4,096 characters and under: on the loop
    assert len(off_loop) == 1 and max(overlaps) == 1  # the rest: one thread, one at a time


@pytest.mark.parametrize("cls, base", [
    (CompletionRequest, {"model": "m", "prompt": "hi"}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_stop_takes_64_strings_of_512_characters(cls, base):
    """"`stop`: 64 strings of 512 characters (`SamplingParams`) | ingress | 400, `param: stop`"."""
    for ok in (["s"] * 64, ["s" * 512], "s" * 512):
        sampling_params(parse_request({**base, "stop": ok}, cls), 64)
    for bad in (["s"] * 65, ["s" * 513], "s" * 513):
        with pytest.raises(ApiError) as e:
            sampling_params(parse_request({**base, "stop": bad}, cls), 64)
        assert (e.value.status, e.value.param) == (400, "stop")


@pytest.mark.parametrize("cls, body, param", [
    (CompletionRequest, {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    (CompletionRequest, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (CompletionRequest, {"prompt": "hi", "stream": "true"}, "stream"),
    (CompletionRequest, {"prompt": "hi", "stream": 1}, "stream"),
    (CompletionRequest, {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    (CompletionRequest, {"prompt": [1, 2, "x"]}, "prompt.2"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [5]}]}, "messages.0.content.0"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
])
def test_request_fields_are_strictly_typed_and_the_error_names_the_fields_path(cls, body, param):
    """"a number must be a JSON number (`"max_tokens": "10"` and `"max_tokens": true` are 400 naming
    `max_tokens` ...), a boolean a JSON boolean, a string a string; the error's `param` is the
    field's path in the body (`messages.0.content.0`, `prompt.2`), never a type name"."""
    with pytest.raises(ApiError) as e:
        sampling_params(parse_request({"model": "m", **body}, cls), 64)
    assert (e.value.status, e.value.param) == (400, param)


def test_an_integer_is_accepted_where_a_float_is():
    """"an integer is accepted where a float is"."""
    req = parse_request({"model": "m", "prompt": "hi", "temperature": 1, "top_p": 1,
                         "presence_penalty": 0}, CompletionRequest)
    params = sampling_params(req, 64)
    assert (params.temperature, params.top_p) == (1, 1)


def test_a_full_handle_queue_is_429_with_retry_after_1_on_http_and_resource_exhausted_on_grpc():
    """`replicas.max_queued_requests` beyond it: "429 + `Retry-After: 1`, `code: overloaded`; gRPC
    RESOURCE_EXHAUSTED with `(retry-after: 1 s)` in the details"; "A worker-side `BackPressureError`
    reached gRPC clients as Serve's raw message: the failed handle call's `cancel()` in
    `run_request`'s cleanup re-raised it over the ingress's own error" (fixed)."""
    from ray.serve.exceptions import BackPressureError

    from handle_support import Handle, Response
    from kvmesh.cluster.generation import run_request
    from kvmesh.cluster.grpc_service import _grpc_error
    from kvmesh.cluster.ingress import _error_response
    from kvmesh.cluster.messages import RoutedRequest

    def full():
        return BackPressureError(num_queued_requests=4, max_queued_requests=4)

    class FailedCall(Response):
        def cancel(self):  # as Serve's: cancelling a failed call re-raises its error
            self.cancelled = True
            raise full()

    async def main():
        return [d async for d in run_request(Handle([full()], response=FailedCall), RoutedRequest(
            "req-1", [1, 2, 3], SamplingParams(max_tokens=2)))]

    with pytest.raises(ApiError) as e:
        asyncio.run(main())
    assert (e.value.status, e.value.code) == (429, "overloaded")
    response = _error_response(e.value)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    ctx = _GrpcContext()
    _grpc_error(e.value, ctx)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ctx.details.endswith("(retry-after: 1 s)") and "overloaded" in ctx.details


# ---- transport limits --------------------------------------------------------------------------

@pytest.mark.parametrize("limit, replica", [
    (None, 5 * 2**20),        # default 4 MiB: the limit plus 1 MiB
    (2**20, 4 * 2**20),       # at least 4 MiB (Ray's default)
    (64 * 2**20, 65 * 2**20),
])
def test_kvmesh_serve_sets_serves_grpc_message_limits_for_its_ray(limit, replica):
    """"`server.grpc_max_message_bytes` (4 MiB) is Serve's own `RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`
    ..., which `kvmesh serve` sets for its Ray; ... `kvmesh serve` sets Serve's proxy-to-replica
    limit, `RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH` (Ray's default 4 MiB), to that limit plus
    1 MiB (at least 4 MiB)"."""
    from kvmesh.cluster.launcher import listener_env

    server = {} if limit is None else {"grpc_max_message_bytes": limit}
    env = listener_env(parse_config({"model": MODEL, "server": server}))
    assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(limit or 4 * 2**20)
    assert env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == str(replica)


def test_the_send_buffer_of_every_http_connection_is_fixed_at_128_kib():
    """"the send buffer of every HTTP connection of Serve's proxy and the direct port fixed at
    128 KiB (`stream_idle_timeout.SEND_BUFFER_BYTES`, which Linux doubles)" (the middleware's
    effect on a live socket: tests/unit/test_stream_idle_timeout.py)."""
    from kvmesh.cluster import stream_idle_timeout

    assert stream_idle_timeout.SEND_BUFFER_BYTES == 128 * 1024


# ---- the KV event hub and the soak benchmark ---------------------------------------------------

def test_the_hubs_event_log_is_bounded_at_50000_batches():
    """"its event log filling, which is bounded at 50,000 batches (`EventLog(max_entries=50_000)`"."""
    import inspect

    from kvmesh.cluster import event_hub
    from kvmesh.protocol import BlockStored, KVEventBatch
    from kvmesh.router.event_log import EventLog

    assert "self.log = EventLog()" in inspect.getsource(event_hub)  # the hub takes the default
    log = EventLog()
    for seq in range(50_010):
        log.publish(KVEventBatch("w", 1, seq, [BlockStored([seq], None, 16)]))
    assert len(log._entries) == 50_000


def test_soak_defaults_mix_warm_up_and_growth_limit():
    """"`kvmesh bench soak` runs a bounded mixed load (default 40% non-streaming, 40% streaming, 20%
    aborted mid-stream) ... exits 1 if a request was lost or a process grew by more than
    `--max-growth-mb` after the warm-up (first 20% of the run ...)"; "the default `--max-growth-mb
    50`"."""
    from kvmesh.bench import soak
    from kvmesh.cli import build_parser

    args = build_parser().parse_args(["bench", "soak", "--url", "http://127.0.0.1:1"])
    assert soak.parse_mix(args.mix) == {"whole": 0.4, "stream": 0.4, "abort": 0.2}
    assert (args.warmup_fraction, args.max_growth_mb) == (0.2, 50.0)


# ---- request identity --------------------------------------------------------------------------

@pytest.mark.parametrize("cls, base", [
    (CompletionRequest, {"model": "m", "prompt": "hi"}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_http_takes_no_client_request_id_and_the_server_names_every_request(cls, base):
    """"The server names every request (`req-` + a random UUID) and only that name reaches the
    workers and the engine"; "HTTP takes no client id"."""
    import re
    import uuid

    with pytest.raises(ApiError) as e:
        parse_request({**base, "request_id": "mine"}, cls)
    assert (e.value.status, e.value.param) == (400, "request_id")
    fe = frontend()
    info = asyncio.run(fe.model_info())
    ids = [fe.routed_request([1, 2, 3], SamplingParams(), info, session_key=None).request_id
           for _ in range(2)]
    assert ids[0] != ids[1]
    for rid in ids:
        assert re.fullmatch(r"req-[0-9a-f]{32}", rid) and uuid.UUID(rid[4:]).version == 4


def test_grpc_labels_are_scoped_to_the_api_key_and_without_keys_one_scope_for_all():
    """"A gRPC client's `request_id` is a label scoped to its API key (with no keys configured, one
    scope for all): ... `Abort` finds only the caller's own labels (another key's label: `found:
    false`, no effect)"."""
    from test_ingress_hub_unavailable import StandInHub, ingress

    from kvmesh.cluster.grpc_service import _caller
    from kvmesh.proto import kvmesh_pb2 as pb

    def ctx(key):
        return _GrpcContext([("authorization", f"Bearer {key}")])

    def abort(ing, key, label):
        return asyncio.run(ing.Abort(pb.AbortRequest(request_id=label), ctx(key))).found

    for keys in ((), ("sk-a", "sk-b")):
        ing = ingress(StandInHub())
        ing.api_keys = ApiKeys(keys)
        ing.pipeline = RequestPipeline(ing.frontend, ing.limits, ing.api_keys)
        event = ing._in_flight[(_caller(ing, ctx("sk-a")), "mine")] = asyncio.Event()
        if keys:  # another key's label: not found, no effect; the owner's: found
            assert not abort(ing, "sk-b", "mine") and not event.is_set()
            assert abort(ing, "sk-a", "mine") and event.is_set()
        else:  # one scope: any caller's Abort finds it
            assert abort(ing, "anyone", "mine") and event.is_set()


# ---- the kv_events policy's hysteresis (the "Known limit" on slow replicas) -------------------

def _first_choice(holder_extra_cost: int, holder_blocks: int) -> str:
    """The worker ranked first for a 64-token prompt between "holder" (caching its first
    `holder_blocks` blocks of 16 tokens, and `holder_extra_cost` prompt tokens queued) and an idle
    "other" that caches nothing."""
    from kvmesh.hashing import block_hashes
    from kvmesh.protocol import KVSnapshot, WorkerLoad
    from kvmesh.router.event_log import EventLog
    from kvmesh.router.routing_state import RoutingState

    hashes = block_hashes(list(range(64)), 16)
    log = EventLog()
    log.publish_snapshot(KVSnapshot("holder", 1, 0, hashes[:holder_blocks], 16))
    log.publish_snapshot(KVSnapshot("other", 1, 0, [], 16))
    log.update_load(WorkerLoad("holder", waiting_prefill_tokens=holder_extra_cost,
                               kv_free_blocks=100, kv_total_blocks=100, timestamp=1.0))
    log.update_load(WorkerLoad("other", kv_free_blocks=100, kv_total_blocks=100, timestamp=1.0))
    state = RoutingState("kv_events", 16, clock=lambda: 100.0, stale_load_s=3.0)
    state.apply(log.poll(state.instance, state.cursor))
    return state.rank(hashes, 64, None, ["holder", "other"])[0]


def test_kv_events_keeps_a_continuation_on_its_holder_unless_another_is_cheaper_by_over_8192():
    """Known limit: "the `kv_events` policy's hysteresis (`stay_margin`: a continuation, a request
    whose longest cached prefix is at least half its prompt, stays on the worker holding that prefix
    unless another is cheaper by more than 8192 tokens ...) keeps sending a prefix to its holder
    while that holder is slow but still reporting"."""
    uncached = 2 * 64  # what "other" costs: 2 per uncached prompt token; the holder caches all
    assert _first_choice(uncached + 6000, holder_blocks=4) == "holder"  # > 4096 more, <= 8192
    assert _first_choice(uncached + 8500, holder_blocks=4) == "other"   # > 8192 more
    # a prefix under half the prompt is no continuation: the cheaper worker gets it
    assert _first_choice(500, holder_blocks=1) == "other"
