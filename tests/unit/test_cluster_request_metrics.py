"""Cluster-wide request metrics (cluster/shared_metrics.py, docs/METRICS.md): every ingress replica
sends its own counters and histograms to the KV event hub and exports them summed with the other
replicas' latest, which the hub keeps (a replica that stopped included); the per-worker and
per-process gauges are not shared. Two IngressMetrics play two ingress replicas and a
ReplicaSamples plays the hub's store, without Ray."""

import asyncio
import logging
import re
import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cluster import process_metrics
from kvmesh.cluster.metrics import IngressMetrics
from kvmesh.cluster.shared_metrics import PUBLISH_INTERVAL_S, ReplicaSamples, publish_forever
from kvmesh.protocol import WorkerLoad

DOCS = Path(__file__).resolve().parents[2] / "docs"
MODEL = "tiny"
REQUESTS_200 = ("kvmesh_requests_total", (("model", MODEL), ("status", "200")))
REQUESTS_404 = ("kvmesh_requests_total", (("model", MODEL), ("status", "404")))


def replica() -> IngressMetrics:
    metrics = IngressMetrics()
    metrics.init_model(MODEL)
    return metrics


def answer(metrics: IngressMetrics, status: int = 200, e2e_s: float = 0.02, times: int = 1) -> None:
    for _ in range(times):
        metrics.observe_status(MODEL, status)
        if status == 200:
            metrics.observe_request(MODEL, arrival=10.0, first_token=10.0 + e2e_s / 2,
                                    end=10.0 + e2e_s, prompt_tokens=7, output_tokens=3, cached_tokens=0)


def publish(hub: ReplicaSamples, replica_id: str, metrics: IngressMetrics) -> None:
    """One round of publish_forever: send the samples, keep the others' sum."""
    metrics.others = hub.publish(replica_id, metrics.own_samples())


def samples(text: bytes) -> dict[tuple, float]:
    """(sample name, sorted label pairs) -> value"""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def scrape(metrics: IngressMetrics) -> dict[tuple, float]:
    return samples(metrics.render({}, {}))


def model(name: str, **labels) -> tuple:
    return name, tuple(sorted({"model": MODEL, **labels}.items()))


def test_a_scrape_sums_every_replica_s_series_and_shows_a_series_only_another_has():
    hub, a, b = ReplicaSamples(), replica(), replica()
    answer(a, times=2)
    answer(b, times=3)
    answer(b, status=404)
    publish(hub, "b", b)
    publish(hub, "a", a)  # a now holds b's counts
    found = scrape(a)
    assert (found[REQUESTS_200], found[REQUESTS_404]) == (5, 1)
    assert found[model("kvmesh_prompt_tokens_total")] == 5 * 7
    assert found[model("kvmesh_request_ttft_seconds_count")] == 5
    # b sent before a did: it sees a's requests after its next send
    assert (scrape(b)[REQUESTS_200], REQUESTS_404 in scrape(b)) == (3, True)
    publish(hub, "b", b)
    assert scrape(b)[REQUESTS_200] == 5


def test_histogram_buckets_sum_and_count_are_summed():
    hub, a, b = ReplicaSamples(), replica(), replica()
    answer(a, e2e_s=0.02)
    answer(b, e2e_s=0.3, times=2)
    publish(hub, "b", b)
    publish(hub, "a", a)
    found = scrape(a)
    buckets = [found[model("kvmesh_request_e2e_seconds_bucket", le=le)]
               for le in ("0.01", "0.025", "0.25", "0.5", "+Inf")]
    assert buckets == [0, 1, 1, 3, 3]
    assert found[model("kvmesh_request_e2e_seconds_count")] == 3
    assert abs(found[model("kvmesh_request_e2e_seconds_sum")] - 0.62) < 1e-9


def test_created_is_the_answering_replica_s_own_and_a_series_only_others_have_has_none():
    hub, a, b = ReplicaSamples(), replica(), replica()
    answer(b, status=404)
    publish(hub, "b", b)
    publish(hub, "a", a)
    created = {k: v for k, v in scrape(a).items() if k[0].endswith("_created")}
    alone = {k: v for k, v in samples(generate_latest(a.registry)).items()
             if k[0].endswith("_created")}
    assert created == alone and model("kvmesh_requests_created", status="200") in created
    assert model("kvmesh_requests_created", status="404") not in created
    assert scrape(a)[REQUESTS_404] == 1


def test_with_one_replica_a_scrape_is_the_replica_s_own_registry_unchanged():
    hub, a = ReplicaSamples(), replica()
    process_metrics.register(a.registry)
    answer(a, times=2)
    answer(a, status=404)
    publish(hub, "a", a)
    assert a.others == {}
    loads = {"w1": WorkerLoad("w1", running=1, waiting=2, kv_free_blocks=3, kv_total_blocks=4)}
    text = a.render(loads, {"w1": {"requests": 5}}).decode()
    # the registry alone, as /metrics rendered it before replicas shared their counts; the RSS
    # gauge may change between the two renders
    alone = generate_latest(a.registry).decode()
    rss = re.compile(r"^kvmesh_ingress_rss_bytes .*$", re.M)
    assert rss.sub("", text) == rss.sub("", alone)


def test_a_request_counts_at_once_where_answered_and_elsewhere_after_both_replicas_send():
    hub, a, b = ReplicaSamples(), replica(), replica()
    publish(hub, "a", a)
    publish(hub, "b", b)
    answer(a)
    assert (scrape(a)[REQUESTS_200], scrape(b)[REQUESTS_200]) == (1, 0)  # b lower than a, for now
    publish(hub, "b", b)
    assert scrape(b)[REQUESTS_200] == 0  # a has not sent it yet
    publish(hub, "a", a)
    publish(hub, "b", b)
    assert scrape(b)[REQUESTS_200] == 1


def test_only_the_request_counters_and_histograms_are_shared():
    metrics = replica()
    process_metrics.register(metrics.registry)
    answer(metrics)
    shared = metrics.own_samples()
    families = {f.name: f for f in metrics.registry.collect()}
    # every counter and histogram but the per-worker one, which the hub reports
    assert set(shared) == {name for name, f in families.items() if f.type in ("counter", "histogram")
                           and name != "vllm:num_preemptions"}
    assert len(shared) == 9 + 14
    # each with every sample but `_created`
    for name, values in shared.items():
        assert values == {(s.name, tuple(s.labels.items())): s.value for s in families[name].samples
                          if not s.name.endswith("_created")}, name


def test_a_replica_that_stopped_sending_stays_in_the_others_sum():
    hub, a, b = ReplicaSamples(), replica(), replica()
    answer(b, times=4)
    publish(hub, "b", b)  # b's last send: then it is scaled down
    for _ in range(3):
        answer(a)
        publish(hub, "a", a)
    assert scrape(a)[REQUESTS_200] == 3 + 4


def test_past_max_replicas_the_least_recent_are_summed_into_one_entry_and_still_counted():
    hub = ReplicaSamples(max_replicas=2)
    for i in range(5):
        gone = replica()
        answer(gone, times=i + 1)
        publish(hub, f"r{i}", gone)
    assert list(hub.latest) == ["r3", "r4"]
    a = replica()
    publish(hub, "a", a)
    assert list(hub.latest) == ["r4", "a"]
    assert scrape(a)[REQUESTS_200] == 1 + 2 + 3 + 4 + 5


def test_a_hub_that_restarted_empty_has_every_running_replica_s_full_counts_after_one_round():
    hub, a, b, gone = ReplicaSamples(), replica(), replica(), replica()
    answer(a, times=2)
    answer(b, times=3)
    answer(gone, times=100)
    for replica_id, metrics in (("gone", gone), ("a", a), ("b", b)):
        publish(hub, replica_id, metrics)
    restarted = ReplicaSamples()
    publish(restarted, "a", a)
    publish(restarted, "b", b)
    publish(restarted, "a", a)
    assert scrape(a)[REQUESTS_200] == scrape(b)[REQUESTS_200] == 5  # `gone`'s 100 are lost


class FlakyHub:
    """The hub's publish_ingress_metrics: each call answers the next outcome (raised if an
    exception) after `latency_s`; `done` is set when the outcomes are used up, and a call after
    that (the publisher's next, if the test is slow to cancel it) waits, recording nothing."""

    def __init__(self, outcomes: list, latency_s: float):
        self.outcomes, self.latency_s = list(outcomes), latency_s
        self.starts: list[float] = []
        self.others_at_call: list[dict] = []
        self.metrics = None
        self.done = asyncio.Event()
        self.publish_ingress_metrics = self

    async def remote(self, replica_id: str, samples: dict):
        assert replica_id == "a" and samples
        if self.done.is_set():
            await asyncio.Event().wait()  # until the test cancels the publisher
        self.starts.append(time.monotonic())
        self.others_at_call.append(self.metrics.others)
        await asyncio.sleep(self.latency_s)  # the round trip
        outcome = self.outcomes.pop(0)
        if not self.outcomes:
            self.done.set()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_the_publisher_sends_every_interval_and_logs_one_warning_per_failure_streak(caplog):
    first, second = {"x": {("x_total", ()): 1.0}}, {"x": {("x_total", ()): 2.0}}
    outcomes = [first, ConnectionError("hub restarting"), ConnectionError("hub restarting"),
                second, ConnectionError("hub gone"), first]
    hub, metrics, handles = FlakyHub(outcomes, latency_s=0.12), replica(), []
    hub.metrics = metrics

    def get_hub():
        handles.append(hub)
        return hub

    async def run():
        task = asyncio.create_task(publish_forever(metrics, "a", get_hub, interval_s=0.2))
        await asyncio.wait_for(hub.done.wait(), 10)
        task.cancel()

    with caplog.at_level(logging.WARNING, logger="kvmesh.cluster"):
        asyncio.run(run())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "sending request metrics" in warnings[0].getMessage()
    assert len(handles) == 1 + 3  # the first, then a new handle after every failed send
    # while the hub failed, scrapes kept adding the last sum it sent
    assert hub.others_at_call == [{}, first, first, first, second, second]
    # counted from each send's start, not its end (0.2 + 0.12)
    gaps = sorted(b - a for a, b in zip(hub.starts, hub.starts[1:]))
    assert gaps[len(gaps) // 2] < 0.28, gaps


def test_the_docs_state_the_publish_interval():
    assert PUBLISH_INTERVAL_S == 0.5
    for doc in ("METRICS.md", "DEPLOY.md"):
        text = " ".join((DOCS / doc).read_text().split())
        assert "every 0.5 s" in text and "within 1 s plus two round trips to the hub" in text, doc


def test_the_hub_actor_keeps_each_ingress_replica_s_samples_and_answers_the_others_sum():
    from kvmesh.cluster.event_hub import KVEventHub

    hub, a, b = KVEventHub.__ray_actor_class__(), replica(), replica()
    answer(a, times=2)
    answer(b, times=3)
    asyncio.run(hub.publish_ingress_metrics("b", b.own_samples()))
    a.others = asyncio.run(hub.publish_ingress_metrics("a", a.own_samples()))
    assert scrape(a)[REQUESTS_200] == 5
