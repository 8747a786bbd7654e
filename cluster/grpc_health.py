"""gRPC's standard health service (`grpc.health.v1.Health`) and server reflection v1.

Health lives in the ingress, not in Serve's gRPC proxy: the proxy routes every service it was
given (gRPCOptions.grpc_servicer_functions) to the ingress method named like the RPC, as it routes
kvmesh.v1.Generation, so `Check` and `Watch` answer as /health does (cluster/status.py
cluster_health: SERVING while a worker is healthy, and while autoscaling has taken the workers to
zero, since a request then starts one; NOT_SERVING with no worker otherwise, or all failed). When no ingress replica can answer, the proxy's own error
is what a probe sees: not SERVING either.

Reflection: Serve 2.60 registers only v1alpha. The v1 service has the same messages under another
package name (wire-identical), so v1 is served by the v1alpha servicer under the v1 method path,
on the proxy itself (a passthrough service, as Serve registers v1alpha).
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server  # noqa: F401 (import path)

from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.cluster.status import cluster_health

# The services whose health is the cluster's ("" is the server as a whole).
SERVICES = ("", "kvmesh.v1.Generation")
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
WATCH_PERIOD_S = 1.0


def servicer_functions(reflection: bool) -> list[str]:
    """gRPCOptions.grpc_servicer_functions: Generation, Health, and (last, so it sees the
    others) reflection v1 when reflection is on."""
    functions = ["kvmesh.proto.kvmesh_pb2_grpc.add_GenerationServicer_to_server",
                 "kvmesh.cluster.grpc_health.add_HealthServicer_to_server"]
    if reflection:
        functions.append("kvmesh.cluster.grpc_health.add_reflection_v1")
    return functions


def add_reflection_v1(_servicer, server) -> None:
    """Serve reflection v1 on Serve's gRPC proxy server (called with the proxy's server)."""
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    names = set()
    for handlers in getattr(server, "generic_rpc_handlers", []):
        names |= {method.split("/")[1] for method in handlers[0]._method_handlers}
    names.discard("ray.serve.RayServeAPIService")
    names |= {REFLECTION_V1, reflection.SERVICE_NAME}
    servicer = reflection.ReflectionServicer(sorted(names))
    handler = grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)})
    if hasattr(server, "add_passthrough_service"):  # Serve's proxy: run it there, not routed
        server.add_passthrough_service(REFLECTION_V1)
    server.add_generic_rpc_handlers((handler,))


class HealthService:
    """grpc.health.v1.Health's methods, mixed into the Ingress deployment (which provides
    self.hub_loads, self.config and self._check_key)."""

    async def _serving(self, service: str) -> int:
        if service not in SERVICES:
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        answer = await self.hub_loads.get()  # None: the hub did not answer in time
        health = cluster_health(answer and answer[0], self.config.scales_to_zero)  # as /health
        return (health_pb2.HealthCheckResponse.SERVING if health.serving
                else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    grpc_context=None) -> health_pb2.HealthCheckResponse:
        self._check_key("health", grpc_context)
        status = await self._serving(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            raise self._grpc_refused(ApiError(404, f"service: {request.service!r} is not served "
                                              f"here (known: {', '.join(map(repr, SERVICES))})",
                                              param="service"), grpc_context)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context=None):
        """The status now, then each change (checked every WATCH_PERIOD_S) until the client
        cancels."""
        self._check_key("health", grpc_context)
        last = None
        while True:
            status = await self._serving(request.service)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(WATCH_PERIOD_S)
