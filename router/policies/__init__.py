"""The routing-policy registry: one line per policy in `POLICIES`, one file per policy.

`POLICIES` maps each name to its class ("module:Class", imported on first use). Every other list of
policy names (the serving config, `kvmesh sim`, `kvmesh bench serve`) is taken from it; the Helm
schema's enum is checked against it (tests/unit/test_registries.py). A policy's options and their
defaults are its constructor's keywords (`policy_defaults`); `index`, `block_size` and `seed` are
common arguments that `make_policy` passes to the policies that take them.
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


def policy_defaults(name: str) -> dict:
    """The options a policy takes beyond the common arguments, with their defaults."""
    params = inspect.signature(policy_class(name).__init__).parameters
    return {k: p.default for k, p in params.items()
            if k != "self" and k not in _COMMON and p.default is not inspect.Parameter.empty}


def parse_policy_names(text: str) -> list[str]:
    """A comma-separated list of policy names, or `all` (every policy, in registry order)."""
    if text == "all":
        return list(POLICY_NAMES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)} or all")
    if not names:
        raise ValueError(f"no policy named; choose one of {', '.join(POLICY_NAMES)} or all")
    return names


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
           "parse_policy_names", "policy_class", "policy_defaults"]
