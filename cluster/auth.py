"""API keys: who may call the cluster.

Keys come from the serving config (`server.api_keys`, which `kvmesh serve --api-key` extends) and
from the environment variable KVMESH_API_KEYS (comma- or newline-separated), read in each ingress
replica: that is how the Helm chart hands them over from a Kubernetes Secret, so they never appear
in the RayService object or Serve's config. No keys at all = no authentication.

HTTP clients send `Authorization: Bearer KEY` (what the OpenAI clients do); gRPC clients send the
same in the call's metadata (`authorization: Bearer KEY`). /health and /metrics (and gRPC Health)
are open unless `server.auth_health` / `server.auth_metrics` say otherwise, so that load balancers
and Prometheus can reach them. Keys are compared in constant time and never logged or repr'd.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Iterable, Mapping

ENV_VAR = "KVMESH_API_KEYS"
_SCHEME = "bearer "
UNAUTHORIZED_MESSAGE = "invalid or missing API key (send Authorization: Bearer <key>)"


def keys_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys of KVMESH_API_KEYS; a variable that is set but holds none (an empty Secret) is an
    error, not a server without authentication."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR)
    if raw is None:
        return []
    keys = [k for k in re.split(r"[,\s]+", raw) if k]
    if not keys:
        raise ValueError(f"{ENV_VAR} is set but holds no key (comma- or newline-separated); unset it "
                         f"to serve without authentication")
    return keys


class ApiKeys:
    """The accepted keys and which endpoints need one."""

    def __init__(self, keys: Iterable[str], protect_health: bool = False,
                 protect_metrics: bool = False):
        self._keys = tuple({k.encode() for k in keys if k})
        self.protect_health = protect_health
        self.protect_metrics = protect_metrics

    @classmethod
    def from_server_config(cls, server, environ: Mapping[str, str] | None = None) -> "ApiKeys":
        return cls(list(server.api_keys) + keys_from_env(environ),
                   protect_health=server.auth_health, protect_metrics=server.auth_metrics)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self._keys)} keys)"

    def needs_key(self, endpoint: str) -> bool:
        """endpoint: "api" (generation, models, abort), "health" or "metrics"."""
        if not self._keys:
            return False
        if endpoint == "health":
            return self.protect_health
        if endpoint == "metrics":
            return self.protect_metrics
        return True

    def accepts(self, key: str | None) -> bool:
        if key is None:
            return False
        candidate = key.encode("utf-8", "surrogatepass")
        # Every key is compared (no early exit), each in constant time.
        matched = False
        for k in self._keys:
            matched |= hmac.compare_digest(candidate, k)
        return matched

    def allows(self, endpoint: str, authorization: str | None) -> bool:
        """authorization: the value of the Authorization header (HTTP) or metadata (gRPC)."""
        if not self.needs_key(endpoint):
            return True
        return self.accepts(bearer_token(authorization))

    def allows_grpc(self, endpoint: str, grpc_context) -> bool:
        if not self.needs_key(endpoint):
            return True
        return self.accepts(bearer_token(grpc_authorization(grpc_context)))


def grpc_authorization(grpc_context) -> str | None:
    """The `authorization` metadata of a gRPC call (None without one)."""
    metadata = grpc_context.invocation_metadata() if grpc_context is not None else []
    value = next((v for k, v in metadata if k.lower() == "authorization"), None)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value


def bearer_token(authorization: str | None) -> str | None:
    if not authorization or not authorization[:len(_SCHEME)].lower() == _SCHEME:
        return None
    return authorization[len(_SCHEME):].strip() or None
