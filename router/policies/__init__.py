"""Routing policies, one per file; `make_policy(name, ...)` builds one.

Common arguments (`index`, `block_size`, `seed`) are passed to the policies that take them; any other
keyword must be one the policy declares.
"""

import importlib
import inspect

from kvmesh.router.policies.base import Policy, RouteRequest

POLICIES = {
    "round_robin": "kvmesh.router.policies.round_robin:RoundRobinPolicy",
    "least_loaded": "kvmesh.router.policies.least_loaded:LeastLoadedPolicy",
    "power_of_two": "kvmesh.router.policies.power_of_two:PowerOfTwoPolicy",
    "session": "kvmesh.router.policies.session:SessionPolicy",
    "prefix_approx": "kvmesh.router.policies.prefix_approx:PrefixApproxPolicy",
    "kv_events": "kvmesh.router.policies.kv_events:KVEventsPolicy",
}
POLICY_NAMES = tuple(POLICIES)
DEFAULT_POLICY = "kv_events"
_COMMON = ("index", "block_size", "seed")


def policy_class(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    module, _, cls = POLICIES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_policy(name: str, *, index=None, block_size: int = 16, seed: int | None = None,
                **kwargs) -> Policy:
    cls = policy_class(name)
    params = inspect.signature(cls.__init__).parameters
    common = {"index": index, "block_size": block_size, "seed": seed}
    args = {k: v for k, v in common.items() if k in params}
    unknown = [k for k in kwargs if k not in params or k in _COMMON]
    if unknown:
        raise ValueError(f"policy {name!r} takes no option {', '.join(map(repr, unknown))}")
    if "index" in params and index is None:
        raise ValueError(f"policy {name!r} needs the KV index (index=...)")
    return cls(**args, **kwargs)


__all__ = ["POLICIES", "POLICY_NAMES", "DEFAULT_POLICY", "Policy", "RouteRequest", "make_policy",
           "policy_class"]
