"""Access control and limits on a live cluster (one CPU worker with a KV pool too small for its
load, so it must preempt and recompute), over HTTP (the official openai client) and gRPC on
127.0.0.1:

- API keys from `--api-key` and from KVMESH_API_KEYS: 401 / UNAUTHENTICATED without one, answers
  with either; /health open, /metrics closed (as configured); no key ever appears in a log;
- limits: body size 413, prompt and output tokens 400 naming the field, the default max_tokens;
- an overload burst: 429 + Retry-After beyond the bounded queue, every accepted request complete
  with exactly its tokens despite KV preemption, KV blocks all free afterwards, and the ingress's
  memory flat across repeated bursts.
"""

import concurrent.futures as cf
import os
import time
import uuid

import grpc
import pytest

from kvmesh.cluster.client import grpc_call, grpc_stream
from cluster_support import MODEL, config_cluster, cpu_config
from reliability_support import (auth, http, metrics, per_worker, ray_processes, rss_mb,
                                 wait_until)

pytestmark = pytest.mark.slow

CLI_KEY = "sk-cli-" + uuid.uuid4().hex
ENV_KEY = "sk-env-" + uuid.uuid4().hex
MAX_OUTPUT = 48
# tiny-llama: 2 layers x 1 KV head x 16 dims x K,V x fp32 = 256 B per token: 12 blocks of 16 tokens.
KV_BYTES = 12 * 16 * 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = cpu_config(engine={"kv_cache_memory_bytes": KV_BYTES, "max_num_seqs": 8},
                        replicas={"max_ongoing_requests": 4, "max_queued_requests": 4},
                        server={"auth_metrics": True, "api_docs": True, "responses_store": 2},
                        limits={"max_prompt_tokens": 100, "max_output_tokens": MAX_OUTPUT,
                                "max_body_bytes": 16384})
    old = os.environ.get("KVMESH_API_KEYS")
    os.environ["KVMESH_API_KEYS"] = f"unused-key,{ENV_KEY}"
    try:
        with config_cluster(tmp_path_factory, config, ["--api-key", CLI_KEY]) as c:
            yield c
    finally:
        if old is None:
            os.environ.pop("KVMESH_API_KEYS", None)
        else:
            os.environ["KVMESH_API_KEYS"] = old


def completion(cluster, body, key=CLI_KEY, **kw):
    return http(cluster.http_url + "/v1/completions", {"model": MODEL, **body}, auth(key), **kw)


# ---- access ------------------------------------------------------------------------------------

def run_client(cluster, *args, key=None):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KVMESH_API_KEY"}
    if key is not None:
        env["KVMESH_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "client", "hi", "--max-tokens", "3",
                           "--url", cluster.http_url + "/v1", "--target", cluster.grpc_target, *args],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("api", [(), ("--grpc",)])
def test_kvmesh_client_streams_with_a_key_from_the_flag_or_the_environment(cluster, api):
    """README's `kvmesh client` (HTTP and --grpc): the key from --api-key or $KVMESH_API_KEY; without
    one, the server's refusal in one line and exit status 1, no traceback."""
    for out in (run_client(cluster, *api, "--api-key", CLI_KEY), run_client(cluster, *api, key=ENV_KEY)):
        assert out.returncode == 0, out.stderr
        assert "finish_reason=" in out.stderr and "'completion_tokens': " in out.stderr, out.stderr
        assert "finish_reason=error" not in out.stderr
    refused = run_client(cluster, *api)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert ("HTTP 401" if not api else "gRPC UNAUTHENTICATED") in refused.stderr, refused.stderr


def test_openai_client_needs_a_key_and_either_key_works(cluster):
    import openai

    anonymous = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anonymous.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    with pytest.raises(openai.AuthenticationError):  # before the name is checked
        anonymous.models.retrieve(MODEL)
    for key in (CLI_KEY, ENV_KEY):
        client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=key, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=3,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL


def test_no_header_or_another_scheme_is_refused(cluster):
    for headers in ({}, {"Authorization": CLI_KEY}, {"Authorization": f"Basic {CLI_KEY}"},
                    {"Authorization": f"Bearer {CLI_KEY}x"}):
        status, body, hdrs = http(cluster.http_url + "/v1/completions",
                                  {"model": MODEL, "prompt": "a", "max_tokens": 1}, headers)
        assert status == 401 and body["error"]["type"] == "authentication_error", headers
        assert hdrs["WWW-Authenticate"] == "Bearer"


def test_grpc_needs_the_key_in_metadata(cluster):
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stream(cluster.grpc_target, prompt="abc", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        grpc_call(cluster.grpc_target, "ListModels", api_key="wrong")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    from kvmesh.proto import kvmesh_pb2 as pb
    with pytest.raises(grpc.RpcError) as e:
        grpc_call(cluster.grpc_target, "Abort", pb.AbortRequest(request_id="x"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    msgs = list(grpc_stream(cluster.grpc_target, prompt="abc", max_tokens=3, ignore_eos=True,
                            temperature=0, api_key=ENV_KEY))
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 3
    assert [m.id for m in grpc_call(cluster.grpc_target, "ListModels", api_key=CLI_KEY).models] == [MODEL]
    assert grpc_call(cluster.grpc_target, "Health").healthy  # open: auth_health is off


def test_every_route_but_health_needs_the_key(cluster):
    # the routes as the app lists them (/openapi.json and /docs: test_api_docs_when_on_need_the_key),
    # so a route added without the key check fails here
    status, schema, _ = http(cluster.http_url + "/openapi.json", headers=auth(CLI_KEY), method="GET")
    assert status == 200, schema
    routes = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}
    assert {("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
            ("GET", "/v1/kvmesh/workers"), ("GET", "/metrics")} <= routes, routes
    for method, path in sorted(routes - {("GET", "/health")}):
        url = cluster.http_url + path.replace("{model_id}", MODEL)
        for headers in ({}, auth("sk-wrong")):
            status, body, hdrs = http(url, {} if method == "POST" else None, headers, method=method)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (method, path, status, body)
            assert hdrs["WWW-Authenticate"] == "Bearer", (method, path)
    status, body, _ = http(cluster.http_url + "/tokenize", {"model": MODEL, "prompt": "hello"}, auth(ENV_KEY))
    assert status == 200 and body["count"] >= 1, body


def test_a_stored_response_is_the_storing_keys_alone_and_the_oldest_goes_beyond_the_store(cluster):
    """server.responses_store: 2 here. Another key finds nothing under a response's id (retrieve,
    delete, previous_response_id): a 404, as for an id never stored."""
    import openai

    mine, theirs = (openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=k, max_retries=0)
                    for k in (CLI_KEY, ENV_KEY))
    ids = [mine.responses.create(model=MODEL, input=f"turn {i}", max_output_tokens=2, store=True).id
           for i in range(3)]
    with pytest.raises(openai.NotFoundError):  # the oldest of three went
        mine.responses.retrieve(ids[0])
    assert [mine.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    for call in (lambda: theirs.responses.retrieve(ids[2]), lambda: theirs.responses.delete(ids[2]),
                 lambda: theirs.responses.create(model=MODEL, input="x", previous_response_id=ids[2],
                                                 max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert mine.responses.retrieve(ids[2]).id == ids[2]  # still there for its key


def test_health_is_open_and_metrics_needs_a_key_as_configured(cluster):
    status, body, _ = http(cluster.http_url + "/health")
    assert status == 200 and body["status"] == "ok"
    assert http(cluster.http_url + "/metrics")[0] == 401
    assert "kvmesh_kv_free_blocks" in str(metrics(cluster.http_url, auth(ENV_KEY)))


def test_no_key_is_ever_written_to_a_log(cluster):
    # after the requests above, right and wrong keys included
    completion(cluster, {"prompt": "x", "max_tokens": 1}, key=CLI_KEY + "-wrong")
    assert CLI_KEY not in cluster.log() and ENV_KEY not in cluster.log()
    # every log file of this cluster's Ray session (the keys are random: no other session has them)
    found = []
    for root in _ray_session_dirs(cluster):
        for dirpath, _, files in os.walk(root):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if CLI_KEY.encode() in data or ENV_KEY.encode() in data:
                    found.append(path)
    assert found == []


def _ray_session_dirs(cluster) -> list[str]:
    import psutil

    dirs = set()
    for p in psutil.Process(cluster.proc.pid).children(recursive=True):
        try:
            for arg in p.cmdline():
                if "/session_" in arg:
                    path = arg.split("=", 1)[-1]
                    i = path.find("/session_")
                    j = path.find("/", i + 1)
                    dirs.add(path[:j] if j > 0 else path)
        except Exception:
            continue
    assert dirs, "no Ray session directory found"
    return sorted(d for d in dirs if os.path.isdir(d))


# ---- limits --------------------------------------------------------------------------------------

def test_a_body_over_max_body_bytes_gets_413(cluster):
    status, body, _ = completion(cluster, {"prompt": "a" * 20000, "max_tokens": 1})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "16384" in body["error"]["message"]


def test_prompt_and_output_limits_name_the_field(cluster):
    status, body, _ = completion(cluster, {"prompt": list(range(1, 150)), "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "limits.max_prompt_tokens" in body["error"]["message"]
    status, body, _ = completion(cluster, {"prompt": "abc", "max_tokens": MAX_OUTPUT + 1})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body, _ = http(cluster.http_url + "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                            "max_completion_tokens": 10_000}, auth(CLI_KEY))
    assert status == 400 and body["error"]["param"] == "max_completion_tokens"
    # no max_tokens: the cap is the default
    status, body, _ = completion(cluster, {"prompt": "abc", "ignore_eos": True, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_OUTPUT
    from kvmesh.proto import kvmesh_pb2 as pb  # noqa: F401
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stream(cluster.grpc_target, prompt="abc", max_tokens=MAX_OUTPUT + 1, api_key=CLI_KEY))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    # over gRPC the token limit answers the same message as HTTP's (SERVING.md)
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stream(cluster.grpc_target, prompt_token_ids=list(range(1, 150)), max_tokens=1,
                         api_key=CLI_KEY))
    status, body, _ = completion(cluster, {"prompt": list(range(1, 150)), "max_tokens": 1})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == body["error"]["message"], (e.value.details(), body)


def test_a_prompt_over_the_character_limit_is_refused_before_tokenizing(cluster):
    # limits.max_prompt_chars unset: 32 characters per token of max_prompt_tokens (100)
    status, body, _ = completion(cluster, {"prompt": "a" * 3201, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "3201 characters; the limit is 3200" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stream(cluster.grpc_target, messages=[{"role": "user", "content": "a" * 3201}],
                         api_key=CLI_KEY))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in e.value.details()


def test_api_docs_when_on_need_the_key(cluster):
    for path in ("/openapi.json", "/docs"):
        status, body, _ = http(cluster.http_url + path, method="GET")
        assert status == 401 and body["error"]["code"] == "invalid_api_key", path
    status, schema, _ = http(cluster.http_url + "/openapi.json", headers=auth(CLI_KEY), method="GET")
    assert status == 200 and "/v1/chat/completions" in schema["paths"]
    status, page, _ = http(cluster.http_url + "/docs", headers=auth(CLI_KEY), method="GET")
    assert status == 200 and "swagger" in page["raw"].lower()


# ---- overload ------------------------------------------------------------------------------------

def _burst(cluster, n: int):
    def one(i):
        body = {"prompt": f"burst request number {i}", "max_tokens": MAX_OUTPUT,
                "ignore_eos": True, "temperature": 0}
        if i % 2:
            return completion(cluster, body)
        return _stream(cluster, body)

    with cf.ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


def _stream(cluster, body):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(cluster.http_url + "/v1/completions",
                                 json.dumps({"model": MODEL, **body, "stream": True,
                                             "stream_options": {"include_usage": True}}).encode(),
                                 {"Content-Type": "application/json", **auth(CLI_KEY)})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            usage, finish = None, None
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices", []):
                        finish = c.get("finish_reason") or finish
            return 200, {"usage": usage, "choices": [{"finish_reason": finish}]}, resp.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def test_an_overload_burst_gets_429_and_every_accepted_request_completes(cluster):
    ingress = ray_processes(cluster, "Ingress")
    assert len(ingress) == 1
    deadline = time.monotonic() + 15  # an idle worker reports its load about once a second
    while True:
        free_idle = per_worker(metrics(cluster.http_url, auth(CLI_KEY)), "kvmesh_kv_free_blocks")
        if list(free_idle.values()) == [12] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert list(free_idle.values()) == [12]
    # Three bursts that overload the replica (4 running + 4 queued): more than 8 in flight at once.
    # The client cannot make that certain: once in CI (2 busy cores) the ingress let 32 requests
    # through so slowly that no more than 8 were ever in flight, and all 32 were answered whole.
    # Such a burst is checked the same way but not counted; at most 6 bursts.
    sizes, overloaded = [], 0
    for _ in range(6):
        results = _burst(cluster, 32)
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) >= 8, statuses
        for status, body, headers in results:
            if status == 429:
                assert body["error"]["code"] == "overloaded" and int(headers["Retry-After"]) >= 1
            else:  # preempted under KV pressure and recomputed, never cut short
                assert body["usage"]["completion_tokens"] == MAX_OUTPUT, body
                assert body["choices"][0]["finish_reason"] == "length"
        sizes.append(rss_mb(ingress))
        overloaded += 429 in statuses
        if overloaded == 3:
            break
    assert overloaded == 3, f"{overloaded} of {len(sizes)} bursts of 32 got a 429"
    # the first burst warms caches; later ones must not keep growing the ingress
    assert sizes[-1] - sizes[0] < 40, sizes
    # the pool was too small for what was admitted: the worker preempted (and recomputed)
    # (a worker's counters reach /metrics with its next load report: wait for it, bounded)
    wait_until(lambda: sum(per_worker(metrics(cluster.http_url, auth(CLI_KEY)),
                                      "kvmesh_worker_preemptions").values()) >= 1, 15,
               what="a preemption counted")
    # every KV block is free again (nothing leaked by preemption)
    wait_until(lambda: per_worker(metrics(cluster.http_url, auth(CLI_KEY)),
                                  "kvmesh_kv_free_blocks") == free_idle, 15,
               what="free KV blocks back to the total")


def test_grpc_overload_is_resource_exhausted_with_retry_after(cluster):
    def one(i):
        try:
            msgs = list(grpc_stream(cluster.grpc_target, prompt=f"grpc burst {i}",
                                    max_tokens=MAX_OUTPUT, ignore_eos=True, temperature=0,
                                    api_key=CLI_KEY))
            return "ok", msgs[-1].usage.completion_tokens, None
        except grpc.RpcError as e:
            return e.code(), e.details(), None

    # a burst that never had more than 8 in flight at once (a slow, busy machine: see the HTTP
    # burst above) is checked the same way and another one sent, at most 3
    for _ in range(3):
        with cf.ThreadPoolExecutor(32) as ex:
            results = list(ex.map(one, range(32)))
        kinds = [r[0] for r in results]
        assert set(kinds) <= {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}, results
        assert kinds.count("ok") >= 8, results
        for kind, detail, _ in results:
            if kind == "ok":
                assert detail == MAX_OUTPUT
            else:
                assert "overloaded" in detail and "(retry-after: 1 s)" in detail
        if grpc.StatusCode.RESOURCE_EXHAUSTED in kinds:
            break
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in kinds, "no burst of 32 got RESOURCE_EXHAUSTED"
    # and it keeps serving
    assert completion(cluster, {"prompt": "after", "max_tokens": 2})[0] == 200
