"""vLLM's priority scheduling on a live cluster: `engine.scheduling_policy: priority`, one CPU
worker that runs one request at a time (`max_num_seqs: 1`) and accepts 8 (`max_ongoing_requests`),
so the others wait in its engine's queue.

- While a long request holds the worker, a request of priority 5 and then one of priority -5 queue
  behind it; once it is cancelled, the later one (the lower value) runs first. Over HTTP and gRPC:
  the field reaches the worker's queue on both.
- A priority that is not a 64-bit integer is a 400 naming the field (INVALID_ARGUMENT on gRPC is
  protobuf's own: the field is an int64). The default policy's refusal of a non-zero priority is in
  the schema walk (tests/integration/api_field_walk.py check_priority).
"""

import threading

import pytest

from cluster_support import MODEL, config_cluster, cpu_config
from reliability_support import http, wait_until

pytestmark = pytest.mark.slow

HOLD_TOKENS = 1900  # about all of tiny-llama's 2048-token context: seconds on a CPU, cancelled sooner
QUEUED_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = cpu_config(engine={"max_num_seqs": 1, "scheduling_policy": "priority"},
                        replicas={"max_ongoing_requests": 8})
    with config_cluster(tmp_path_factory, config) as c:
        yield c


def worker_row(cluster) -> dict:
    status, body, _ = http(cluster.http_url + "/v1/kvmesh/workers")
    assert status == 200, body
    (row,) = body["workers"]
    return row


def http_completion(cluster, prompt: str, priority: int) -> None:
    status, body, _ = http(cluster.http_url + "/v1/completions",
                           {"model": MODEL, "prompt": prompt, "max_tokens": QUEUED_TOKENS,
                            "temperature": 0, "ignore_eos": True, "priority": priority})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == QUEUED_TOKENS


def grpc_completion(cluster, prompt: str, priority: int) -> None:
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    with grpc.insecure_channel(cluster.grpc_target) as channel:
        request = pb.GenerateRequest(prompt=prompt, max_tokens=QUEUED_TOKENS, temperature=0,
                                     ignore_eos=True, priority=priority)
        tokens = sum(len(m.token_ids) for m in pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    assert tokens == QUEUED_TOKENS


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_queued_requests_run_lowest_priority_value_first(cluster, protocol):
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    send = http_completion if protocol == "http" else grpc_completion
    wait_until(lambda: (r := worker_row(cluster))["running"] == 0 and r["waiting"] == 0, 60, what="an idle worker")
    finished, errors = [], []

    def run(name: str, priority: int) -> None:
        try:
            send(cluster, f"{name} request", priority)
            finished.append(name)
        except BaseException as e:  # reported by the test, not lost on the thread
            errors.append((name, e))

    channel = grpc.insecure_channel(cluster.grpc_target)
    try:
        hold = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt="hold the only slot", max_tokens=HOLD_TOKENS, temperature=0,
                               ignore_eos=True), timeout=120)
        assert next(hold).token_ids  # running: the worker's one slot is taken
        threads = []
        for name, priority in (("lax", 5), ("urgent", -5)):
            threads.append(threading.Thread(target=run, args=(name, priority), daemon=True))
            threads[-1].start()
            wait_until(lambda n=len(threads): worker_row(cluster)["waiting"] == n, 30,
                       what=f"{len(threads)} request(s) queued in the engine")
        assert finished == [] and worker_row(cluster)["running"] == 1  # both queued behind the hold
        hold.cancel()  # frees the slot: the queue's order decides who runs next
        for thread in threads:
            thread.join(timeout=120)
    finally:
        channel.close()
    assert errors == []
    assert finished == ["urgent", "lax"]


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, "1", 1.5, True, None])
def test_a_priority_that_is_not_a_64_bit_integer_is_a_400_naming_it(cluster, bad):
    status, body, _ = http(cluster.http_url + "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2, "priority": bad})
    assert (status, body["error"]["param"]) == (400, "priority"), body


def test_any_64_bit_priority_is_accepted_under_the_priority_policy(cluster):
    for priority in (-(2**63), 2**63 - 1, 0):
        status, body, _ = http(cluster.http_url + "/v1/completions",
                               {"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": priority})
        assert status == 200, (priority, body)
    status, body, _ = http(cluster.http_url + "/v1/responses",
                           {"model": MODEL, "input": "x", "max_output_tokens": 2, "priority": 7})
    assert (status, body["status"]) == (200, "incomplete"), body
