"""Memory gauges of an ingress replica for /metrics, so a soak (or Prometheus) can see growth
without access to the machine: this process's resident memory and the size of the KV index of the
router copy it holds (block hashes indexed, bounded by the index's max_blocks)."""

from __future__ import annotations

import os

from prometheus_client.core import GaugeMetricFamily

from kvmesh.cluster import router_copies


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # not Linux: peak instead of current
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class IngressProcessCollector:
    def collect(self):
        rss = GaugeMetricFamily("kvmesh_ingress_rss_bytes", "Resident memory of this ingress replica's process.")
        rss.add_metric([], _rss_bytes())
        blocks = GaugeMetricFamily("kvmesh_router_index_blocks", "Block hashes in this ingress's router copy of the KV index.")
        # len() of the index's dict is safe to read while the router thread updates it
        blocks.add_metric([], sum(copy.state.router.index.num_blocks for copy in list(router_copies.ROUTER_COPIES)
                                  if hasattr(copy, "state")))
        return [rss, blocks]


def register(registry) -> None:
    registry.register(IngressProcessCollector())
