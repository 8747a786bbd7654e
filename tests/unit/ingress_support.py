"""An Ingress (cluster/ingress.py) as its constructor builds it, without Serve: no replica
context, no metrics publisher, no router warm-up; the workers' handle and the KV event hub's
loads are what the test passes (the live clusters' tests exercise the real ones)."""

from __future__ import annotations

from kvmesh.cluster import process_metrics
from kvmesh.cluster.auth import ApiKeys
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.messages import ModelInfo
from kvmesh.cluster.pipeline import RequestPipeline
from kvmesh.serve_config import parse_config


def ingress_without_serve(model: str, handle=None, hub_loads=None):
    """`handle` stands in for the workers' deployment handle (handle_support.Handle), `hub_loads`
    for the ingress's HubLoads; the model's info is set as a worker would report it."""
    from kvmesh.cluster.ingress import Ingress

    ing = Ingress.__new__(Ingress)
    ing.config = parse_config({"model": model})
    ing.frontend = Frontend(ing.config, worker_handle=handle)
    ing.frontend._info = ModelInfo(ing.frontend.model_name, max_model_len=128, block_size=16,
                                   hash_salt=b"", vocab_size=512)
    ing.api_keys = ApiKeys(())
    ing.limits = RequestLimits(ing.config.limits)
    ing.pipeline = RequestPipeline(ing.frontend, ing.limits, ing.api_keys)
    ing.hub_loads = hub_loads
    ing.created = 0
    process_metrics.register(ing.frontend.metrics.registry)
    return ing
