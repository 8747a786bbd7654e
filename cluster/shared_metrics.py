"""Cluster-wide request metrics: each ingress replica's own, summed through the KV event hub.

Each ingress replica observes the requests it answers (metrics.py). Every PUBLISH_INTERVAL_S it
sends its cumulative samples to the hub (`publish_forever`), which keeps every replica's latest
(`ReplicaSamples`) and answers with the sum of all the others'. A scrape exports each series as
the replica's live value plus that sum (`WithOthers`), with no call to the hub, so a scrape through
any replica shows the cluster's totals. A replica that stopped sending stays in the sum: a
cluster-wide counter does not go backwards when an ingress replica is scaled down or dies.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Metric
from prometheus_client.samples import Sample

logger = logging.getLogger("kvmesh.cluster")

# family name -> {(sample name, its label pairs in order): value}; plain data, sent through Ray
Samples = dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]

# A sample reaches another replica's scrapes within two intervals plus two hub round trips: its
# replica's next send, then the other replica's next send, which brings it back.
PUBLISH_INTERVAL_S = 0.5
# Replicas the hub keeps apart; the least recently heard from beyond these are summed into one
# entry (still counted: only a live replica pushed out, past this many live ones, counts twice).
MAX_REPLICAS = 64


def samples_of(collectors) -> Samples:
    """The cumulative samples of counters and histograms, without their `_created` times (each
    replica's own; a sum of them would mean nothing)."""
    out: Samples = {}
    for collector in collectors:
        for family in collector.collect():
            out[family.name] = {(s.name, tuple(s.labels.items())): s.value
                                for s in family.samples if not s.name.endswith("_created")}
    return out


def add_into(total: Samples, samples: Samples) -> None:
    for family, values in samples.items():
        summed = total.setdefault(family, {})
        for key, value in values.items():
            summed[key] = summed.get(key, 0.0) + value


class ReplicaSamples:
    """Each ingress replica's latest samples, held by the hub (event_hub.py)."""

    def __init__(self, max_replicas: int = MAX_REPLICAS):
        self.max_replicas = max_replicas
        self.latest: dict[str, Samples] = {}  # replica id -> its last samples, least recent first
        self.retired: Samples = {}  # the replicas pushed out by max_replicas, summed

    def publish(self, replica_id: str, samples: Samples) -> Samples:
        """Keep `replica_id`'s samples; the sum of every other replica's, gone ones included."""
        self.latest.pop(replica_id, None)
        self.latest[replica_id] = samples
        while len(self.latest) > self.max_replicas:
            add_into(self.retired, self.latest.pop(next(iter(self.latest))))
        others: Samples = {}
        add_into(others, self.retired)
        for other_id, other in self.latest.items():
            if other_id != replica_id:
                add_into(others, other)
        return others


class WithOthers:
    """A registry as a scrape exports it: each family that other replicas reported has their sum
    added to this replica's series, and gets the series only they have (without `_created`)."""

    def __init__(self, registry, others: Samples):
        self.registry, self.others = registry, others

    def collect(self):
        for family in self.registry.collect():
            others = self.others.get(family.name)
            yield _summed(family, others) if others else family


def _summed(family: Metric, others: dict) -> Metric:
    summed = Metric(family.name, family.documentation, family.type, family.unit)
    own = set()
    for s in family.samples:
        key = (s.name, tuple(s.labels.items()))
        own.add(key)
        summed.samples.append(s._replace(value=s.value + others.get(key, 0.0)))
    summed.samples += [Sample(name, dict(labels), value)
                       for (name, labels), value in others.items() if (name, labels) not in own]
    return summed


async def publish_forever(metrics, replica_id: str, get_hub,
                          interval_s: float = PUBLISH_INTERVAL_S) -> None:
    """Send `metrics.own_samples()` to the hub every interval_s (counted from the last send's
    start) and keep its answer, the other replicas' sum, in `metrics.others`. A failed send (the
    hub restarting) is logged once per streak of failures and tried again with a new handle;
    scrapes meanwhile add the last sum received. Every send is the full cumulative values, so a
    hub that restarted empty has every live replica's counts again after one round."""
    hub, failing = None, False
    while True:
        started = time.monotonic()
        try:
            if hub is None:
                hub = get_hub()
            metrics.others = await hub.publish_ingress_metrics.remote(replica_id, metrics.own_samples())
            failing = False
        except Exception as e:
            if not failing:
                logger.warning("kvmesh ingress %s: sending request metrics to the KV event hub "
                               "failed (trying again every %.1f s): %r", replica_id, interval_s, e)
            hub, failing = None, True
        await asyncio.sleep(max(0.0, started + interval_s - time.monotonic()))
