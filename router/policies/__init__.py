"""The routing-policy registry: one line per policy in `POLICIES`, one file per policy.

`POLICIES` maps each name to its class ("module:Class", imported on first use). Every other list of
policy names (the serving config, `kvmesh sim`, `kvmesh bench serve`) is taken from it; the Helm
schema's enum is checked against it (tests/unit/test_registries.py). A policy's options and their
defaults are its constructor's keywords (`policy_defaults`); `index`, `block_size` and `seed` are
common arguments that `make_policy` passes to the policies that take them.
"""

import dataclasses
import importlib
import inspect
import typing
from collections.abc import Mapping
from typing import Any

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


def policy_options(name: str, raw: Mapping[str, Any] | None) -> dict:
    """A policy's options as a config gives them (plain values; a dataclass option such as
    kv_events' `weights` as a mapping of its fields), checked and converted for `make_policy`.
    A ValueError names the option (`weights.stay_margin`) and what it takes."""
    raw = dict(raw or {})
    known = policy_defaults(name)
    hints = typing.get_type_hints(policy_class(name).__init__)
    options = {}
    for key, value in raw.items():
        if key not in known:
            takes = ", ".join(known) if known else "none"
            raise ValueError(f"{key}: policy {name!r} takes no option {key!r} (its options: {takes})")
        kinds = typing.get_args(hints.get(key)) or (hints.get(key),)
        structs = [k for k in kinds if dataclasses.is_dataclass(k)]
        if structs and isinstance(value, structs[0]):  # already built (a caller's own)
            options[key] = value
            continue
        if structs:
            if not isinstance(value, Mapping):
                raise ValueError(f"{key}: a mapping of {structs[0].__name__}'s fields, got {value!r}")
            fields = [f.name for f in dataclasses.fields(structs[0])]
            for field_name in value:
                if field_name not in fields:
                    raise ValueError(f"{key}.{field_name}: no such field (fields: {', '.join(fields)})")
            try:
                options[key] = structs[0](**value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{key}: {e}") from None
            continue
        default = known[key]
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))
                        or (isinstance(default, int) and not isinstance(value, int))):
            kind = "a whole number" if isinstance(default, int) else "a number"
            raise ValueError(f"{key}: {kind} like its default {default!r}, got {value!r}")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"{key}: true or false, got {value!r}")
        options[key] = value
    return options


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
           "parse_policy_names", "policy_class", "policy_defaults", "policy_options"]
