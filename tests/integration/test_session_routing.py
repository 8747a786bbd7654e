"""The session routing policy on a live cluster of two CPU workers (`routing.policy: session`):
every request of one session key goes to the worker the ring gives that key, whatever its prompt.

- The key comes from the session header (`routing.session_header`, default x-session-id), else
  OpenAI's `prompt_cache_key`, else `user`, on chat and completions; from `prompt_cache_key` or
  `user` on /v1/responses; from `session_id` on gRPC.
- The header outranks `prompt_cache_key`, which outranks `user`.

Each key is picked so that the ring (the policy's own `SessionPolicy.owner`, over the workers'
ids the cluster reports) gives it a known worker; the workers' request counters
(/v1/kvmesh/workers) then say where each request ran.
"""

import itertools

import pytest

from kvmesh.router.policies.session import SessionPolicy
from cluster_support import MODEL, config_cluster, cpu_config
from reliability_support import http, wait_until

pytestmark = pytest.mark.slow

HEADER = "x-session-id"  # routing.session_header's default
PER_KEY = 3  # requests of distinct prompts sent under each key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with config_cluster(tmp_path_factory, cpu_config(2, routing={"policy": "session"})) as c:
        wait_until(lambda: len(served(c)) == 2, 120, what="two workers reporting")
        yield c


def served(cluster) -> dict[str, int]:
    """Requests each worker has accepted since it started, by worker id."""
    status, body, _ = http(cluster.http_url + "/v1/kvmesh/workers")
    assert status == 200, body
    return {row["worker"]: row["requests"] for row in body["workers"]}


@pytest.fixture(scope="module")
def key_of(cluster) -> dict[str, str]:
    """A session key per worker id that the ring gives to that worker."""
    ring = SessionPolicy()
    workers = sorted(served(cluster))
    for worker in workers:
        ring.add_worker(worker)
    keys: dict[str, str] = {}
    for i in itertools.count():
        keys.setdefault(ring.owner(f"key-{i}"), f"key-{i}")
        if len(keys) == len(workers):
            return keys


def send(cluster, how: str, prompt: str, key: str, **extra) -> None:
    headers = {}
    if how == "grpc":
        import grpc

        from kvmesh.proto import kvmesh_pb2 as pb
        from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

        with grpc.insecure_channel(cluster.grpc_target) as channel:
            request = pb.GenerateRequest(prompt=prompt, max_tokens=2, temperature=0, session_id=key)
            assert sum(len(m.token_ids) for m in pb_grpc.GenerationStub(channel).Generate(request, timeout=60)) == 2
        return
    endpoint, field = how.split(":")
    if field == "header":
        headers[HEADER] = key
    else:
        extra[field] = key
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    elif endpoint == "completions":
        path, body = "/v1/completions", {"prompt": prompt, "max_tokens": 2}
    else:
        path, body = "/v1/responses", {"input": prompt, "max_output_tokens": 2}
    status, answer, _ = http(cluster.http_url + path, {"model": MODEL, "temperature": 0, **body, **extra},
                             headers=headers)
    assert status == 200, answer


def expect_on(cluster, worker: str, requests) -> None:
    """Run `requests` (callables) one after another and check that all ran on `worker`."""
    before = served(cluster)
    for request in requests:
        request()
    expected = {w: n + (len(requests) if w == worker else 0) for w, n in before.items()}

    def settled():  # the counters reach the KV event hub with the workers' load reports
        now = served(cluster)
        return now if now == expected or any(now[w] > expected[w] for w in now) else None

    assert wait_until(settled, 15, what=f"all {len(requests)} on {worker}") == expected


WAYS = ["chat:header", "chat:prompt_cache_key", "chat:user", "completions:header",
        "completions:prompt_cache_key", "completions:user", "responses:prompt_cache_key",
        "responses:user", "grpc"]


@pytest.mark.parametrize("how", WAYS)
def test_a_session_key_keeps_its_requests_on_its_worker(cluster, key_of, how):
    for worker, key in key_of.items():
        expect_on(cluster, worker, [lambda i=i: send(cluster, how, f"{how} prompt {i} for {key}", key)
                                    for i in range(PER_KEY)])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_header_outranks_prompt_cache_key_which_outranks_user(cluster, key_of, endpoint):
    (a, key_a), (b, key_b) = key_of.items()
    expect_on(cluster, a, [lambda i=i: send(cluster, f"{endpoint}:header", f"header first {i}", key_a,
                                            prompt_cache_key=key_b, user=key_b) for i in range(PER_KEY)])
    expect_on(cluster, b, [lambda i=i: send(cluster, f"{endpoint}:prompt_cache_key", f"cache key next {i}",
                                            key_b, user=key_a) for i in range(PER_KEY)])
    expect_on(cluster, a, [lambda i=i: send(cluster, f"{endpoint}:user", f"user last {i}", key_a)
                           for i in range(PER_KEY)])
