"""The ingress when the KV event hub does not answer (docs/METRICS.md "When the KV event hub does
not answer", SERVING.md "Faults"): GET /metrics is still a 200 with the ingress's own request
metrics, without the worker gauges, and `kvmesh_kv_event_hub_up` says whether the hub answered;
GET /v1/kvmesh/workers is a 503 naming the hub; both within the bound (cluster/status.py
HubLoads); a failure is logged once per streak; the next call asks for the hub by name again.

The real route handlers run on an Ingress built without Serve (as the constructor builds it, minus
Serve's replica context). The hub is a stand-in object with the actor handle's `loads.remote()`
(a Ray actor per test is too dear here); the live cluster test of a stopped and killed hub is
tests/integration/test_reliability_faults.py
test_metrics_and_worker_status_answer_while_the_kv_event_hub_does_not.
"""

import asyncio
import json
import logging
import time

import pytest
import ray.exceptions
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from kvmesh.cluster.status import HUB_TIMEOUT_S, HubLoads
from kvmesh.protocol import WorkerLoad
from ingress_support import ingress_without_serve

MODEL = "random:tiny-llama"
HUB_NAME = "kvmesh-kv-events-test"
TIMEOUT_S = 0.05  # the bound in these tests (HUB_TIMEOUT_S in the ingress)
LOADS = {"w1": WorkerLoad("w1", running=1, waiting=2, kv_free_blocks=30, kv_total_blocks=40)}
STATS = {"w1": {"requests": 5, "prompt_tokens": 10, "cached_tokens": 4, "preemptions": 1}}
# every series read from the hub's loads and counters
WORKER_FAMILIES = ("kvmesh_queue_depth", "kvmesh_running_requests", "kvmesh_kv_usage_ratio",
                   "kvmesh_prefix_hit_rate", "kvmesh_kv_free_blocks", "kvmesh_worker_requests",
                   "kvmesh_worker_preemptions", "kvmesh_replicas", "vllm:num_requests_running",
                   "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions")


class StandInHub:
    """Stands for the hub actor's handle: `loads.remote()` gives an awaitable, as Ray's handle
    gives an ObjectRef. It answers (loads, stats), raises `fails_with` (Ray raises ActorDiedError
    for an actor killed for good), or, stalled, never answers (a stopped or restarting hub)."""

    def __init__(self, fails_with: Exception | None = None, stalled: bool = False):
        self.fails_with, self.stalled, self.calls = fails_with, stalled, 0
        self.loads = self._Method(self._loads)

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    async def _loads(self):
        self.calls += 1
        if self.stalled:
            await asyncio.Event().wait()
        if self.fails_with is not None:
            raise self.fails_with
        return LOADS, STATS


class HubByName:
    """What event_hub.get_or_create_hub does for HubLoads: the hub found by name, here the
    current one of `hubs` (the test replaces it, as Ray creates the hub again)."""

    def __init__(self, hub: StandInHub):
        self.hub, self.asked = hub, 0

    def __call__(self) -> StandInHub:
        self.asked += 1
        return self.hub


def ingress(hub: StandInHub | HubByName):
    """An Ingress without Serve whose HubLoads asks `hub` (found by name again after a failure)."""
    by_name = hub if isinstance(hub, HubByName) else HubByName(hub)
    return ingress_without_serve(MODEL, hub_loads=HubLoads(by_name, HUB_NAME, timeout_s=TIMEOUT_S,
                                                           hub=by_name.hub))


def get_request() -> Request:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request({"type": "http", "method": "GET", "path": "/", "headers": [],
                    "query_string": b""}, receive)


def call(handler):
    """Run a route handler; returns (response, seconds it took). A hang fails the test."""
    started = time.monotonic()
    response = asyncio.run(asyncio.wait_for(handler(get_request()), 10))
    return response, time.monotonic() - started


def scrape(ing) -> tuple[int, dict]:
    response, took = call(ing.metrics)
    assert took < TIMEOUT_S + 1.0
    text = response.body.decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return response.status_code, found


def names(found: dict) -> set[str]:
    return {name for name, _ in found}


def requests_200(ing, found: dict) -> float:
    return found[("kvmesh_requests_total", (("model", ing.frontend.model_name), ("status", "200")))]


# ---- /metrics ------------------------------------------------------------------------------------

@pytest.mark.parametrize("hub", [StandInHub(stalled=True),
                                 StandInHub(fails_with=ray.exceptions.ActorDiedError()),
                                 StandInHub(fails_with=ray.exceptions.ActorUnavailableError(
                                     "restarting", b"\0" * 16))],
                         ids=["stalled", "dead", "restarting"])
def test_a_scrape_the_hub_does_not_answer_is_200_with_the_request_metrics_and_hub_up_0(hub):
    ing = ingress(hub)
    model = ing.frontend.model_name
    for _ in range(3):
        ing.frontend.metrics.observe_status(model, 200)
    ing.frontend.metrics.observe_request(model, arrival=0.0, first_token=0.5, end=1.0,
                                         prompt_tokens=4, output_tokens=2, cached_tokens=0)
    status, found = scrape(ing)
    assert status == 200
    assert found[("kvmesh_kv_event_hub_up", ())] == 0
    assert requests_200(ing, found) == 3  # the ingress's own request metrics
    assert found[("kvmesh_request_ttft_seconds_count", (("model", model),))] == 1
    assert ("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", model))) in found
    assert {"kvmesh_ingress_rss_bytes", "kvmesh_router_index_blocks"} <= names(found)
    # no worker series at all (not zeros: kvmesh_replicas 0 would say the workers are gone)
    assert not {n for n in names(found) if n.startswith(WORKER_FAMILIES)}


def test_a_scrape_the_hub_does_not_answer_adds_the_other_ingress_replicas_last_sum():
    ing = ingress(StandInHub(stalled=True))
    model = ing.frontend.model_name
    ing.frontend.metrics.observe_status(model, 200)
    # what the hub answered the replica's last send (shared_metrics.publish_forever)
    ing.frontend.metrics.others = {"kvmesh_requests": {
        ("kvmesh_requests_total", (("model", model), ("status", "200"))): 5.0}}
    _, found = scrape(ing)
    assert found[("kvmesh_kv_event_hub_up", ())] == 0
    assert requests_200(ing, found) == 6


def test_a_scrape_the_hub_answers_has_the_worker_gauges_and_hub_up_1():
    ing = ingress(StandInHub())
    status, found = scrape(ing)
    assert status == 200
    assert found[("kvmesh_kv_event_hub_up", ())] == 1
    assert found[("kvmesh_kv_free_blocks", (("worker", "w1"),))] == 30
    assert found[("kvmesh_replicas", (("deployment", "KVWorker"),))] == 1


def test_a_scrape_after_the_hub_came_back_has_the_worker_gauges_again():
    """A hub killed for good stays dead behind its handle; the next scrape asks for it by name,
    and the hub created again (event_hub.get_or_create_hub) answers."""
    by_name = HubByName(StandInHub(fails_with=ray.exceptions.ActorDiedError()))
    ing = ingress(by_name)
    assert scrape(ing)[1][("kvmesh_kv_event_hub_up", ())] == 0
    by_name.hub = StandInHub()
    _, found = scrape(ing)
    assert found[("kvmesh_kv_event_hub_up", ())] == 1
    assert found[("kvmesh_kv_free_blocks", (("worker", "w1"),))] == 30
    assert by_name.asked == 1  # the constructor's handle first, then once by name


def test_a_scrape_waits_for_the_hub_at_most_the_bound():
    ing = ingress(StandInHub(stalled=True))
    _, took = call(ing.metrics)
    assert TIMEOUT_S <= took < TIMEOUT_S + 1.0


def test_the_ingress_waits_for_the_hub_at_most_2_s_by_default():
    assert HUB_TIMEOUT_S == 2.0
    assert HubLoads(HubByName(StandInHub()), HUB_NAME).timeout_s == HUB_TIMEOUT_S


# ---- /v1/kvmesh/workers (kvmesh status) ---------------------------------------------------------

@pytest.mark.parametrize("hub, says", [
    (StandInHub(stalled=True), f"did not answer within {TIMEOUT_S:g} s"),
    (StandInHub(fails_with=ray.exceptions.ActorDiedError()), "failed: ActorDiedError"),
], ids=["stalled", "dead"])
def test_worker_status_the_hub_does_not_answer_is_a_503_naming_the_hub(hub, says):
    ing = ingress(hub)
    response, took = call(ing.workers)
    assert took < TIMEOUT_S + 1.0
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    error = json.loads(response.body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "kv_event_hub_unavailable")
    assert error["message"].startswith(f"the KV event hub (Ray actor {HUB_NAME}) {says}")


def test_a_worker_status_503_is_not_counted_as_a_request():
    ing = ingress(StandInHub(stalled=True))
    call(ing.workers)
    ing.hub_loads = HubLoads(HubByName(StandInHub()), HUB_NAME, timeout_s=TIMEOUT_S)
    _, found = scrape(ing)
    assert not [labels for name, labels in found
                if name == "kvmesh_requests_total" and ("status", "503") in labels]


def test_worker_status_the_hub_answers_is_one_row_per_worker():
    response, _ = call(ingress(StandInHub()).workers)
    assert [(r["worker"], r["running"], r["waiting"], r["requests"]) for r in response["workers"]] \
        == [("w1", 1, 2, 5)]


# ---- logging -------------------------------------------------------------------------------------

def test_a_streak_of_failures_is_logged_once(caplog):
    by_name = HubByName(StandInHub(fails_with=ray.exceptions.ActorDiedError()))
    ing = ingress(by_name)
    caplog.set_level(logging.INFO, logger="kvmesh.cluster")

    def warnings():
        return [r for r in caplog.records if r.levelno == logging.WARNING and HUB_NAME in r.message]

    for _ in range(3):
        scrape(ing)
    call(ing.workers)
    assert len(warnings()) == 1
    by_name.hub = StandInHub()
    scrape(ing)  # answered: the streak ends
    assert len(warnings()) == 1
    by_name.hub.stalled = True  # the hub it holds a handle to stops answering
    scrape(ing)
    scrape(ing)
    assert len(warnings()) == 2
    assert "did not answer within" in warnings()[1].message


# ---- /health, gRPC Health and kvmesh status ------------------------------------------------------

def test_health_the_hub_does_not_answer_is_a_503_kv_event_hub_unavailable_within_the_bound():
    response, took = call(ingress(StandInHub(stalled=True)).health)
    assert took < TIMEOUT_S + 1.0
    assert response.status_code == 503
    assert json.loads(response.body) == {"status": "kv_event_hub_unavailable", "workers": 0}
    response, _ = call(ingress(StandInHub()).health)
    assert (response.status_code, json.loads(response.body)) == (200, {"status": "ok", "workers": 1})


def test_grpc_health_the_hub_does_not_answer_is_not_serving_within_the_bound():
    from grpc_health.v1 import health_pb2

    from kvmesh.proto import kvmesh_pb2 as pb

    def ask(hub):
        ing = ingress(hub)
        started = time.monotonic()
        check = asyncio.run(ing.Check(health_pb2.HealthCheckRequest(service="")))
        health = asyncio.run(ing.Health(pb.HealthRequest()))
        assert time.monotonic() - started < 2 * TIMEOUT_S + 1.0
        return check.status, health.healthy, health.num_workers

    assert ask(StandInHub(stalled=True)) == (health_pb2.HealthCheckResponse.NOT_SERVING, False, 0)
    assert ask(StandInHub()) == (health_pb2.HealthCheckResponse.SERVING, True, 1)


def test_kvmesh_status_names_the_hub_when_it_does_not_answer(capsys):
    """`kvmesh status` against a server answering as the ingress does while the hub is down (a
    real HTTP server on 127.0.0.1): an error naming the hub and exit status 2, not an empty table."""
    from kvmesh.cli import main
    from tests.unit.json_server import json_server

    message = f"the KV event hub (Ray actor {HUB_NAME}) did not answer within 2 s: ..."

    def answer(path, headers):
        return 503, ({"status": "kv_event_hub_unavailable", "workers": 0} if path == "/health"
                     else {"error": {"message": message, "code": "kv_event_hub_unavailable"}})

    with json_server(answer) as url:
        code = main(["status", "--url", url])
    assert code == 2
    assert message in capsys.readouterr().err
