"""Malformed request bytes on Serve's gRPC proxy answer INVALID_ARGUMENT (docs/SERVING.md: never
UNKNOWN). Ray Serve 2.60's gRPC proxy (`ray.serve._private.grpc_util.gRPCGenericServer`) keeps
each method's protobuf deserializer; when it raises, grpc's asyncio server answers UNKNOWN before
any Serve or kvmesh code runs, and Serve has no setting for it. Here the deserializer of each
unary-request method returns a `MalformedRequest` instead of raising, and the method's handler
answers it with INVALID_ARGUMENT and protobuf's reason (which names the message type). Client-streaming methods (kvmesh has
none) are left as they are. tests/integration/test_transport_limits.py
(test_malformed_request_bytes_get_invalid_argument) sends raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MalformedRequest:
    message: str


def _tolerant(deserialize):
    def decode(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as e:  # protobuf's DecodeError, or anything a custom decoder raises
            return MalformedRequest(f"the request bytes are not a valid message: {e}")
    return decode


def _checked_unary(handler):
    async def unary(request, context):
        if isinstance(request, MalformedRequest):
            await _refuse(request, context)
        return await handler(request, context)
    return unary


def _checked_stream(handler):
    async def unary_stream(request, context):
        if isinstance(request, MalformedRequest):
            await _refuse(request, context)
        async for message in handler(request, context):
            yield message
    return unary_stream


async def _refuse(request: MalformedRequest, context) -> None:
    import grpc

    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def apply() -> None:
    from ray.serve._private.grpc_util import gRPCGenericServer

    override = gRPCGenericServer._override_method_handler

    def _override_method_handler(self, service_method, method_handler):
        handler = override(self, service_method, method_handler)
        if method_handler.request_streaming or method_handler.request_deserializer is None:
            return handler
        return handler._replace(
            request_deserializer=_tolerant(method_handler.request_deserializer),
            unary_unary=_checked_unary(handler.unary_unary),
            unary_stream=_checked_stream(handler.unary_stream))

    gRPCGenericServer._override_method_handler = _override_method_handler
