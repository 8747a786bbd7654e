"""cluster/serve_grpc_cancel.py over a real gRPC server on the loopback: the handle that Serve's gRPC
proxy gets is wrapped so that its replica call is cancelled whenever the gRPC call ends without
status OK (a client's cancel, a deadline, an error status, no status at all) and never after an OK
one (RELIABILITY.md, gRPC cancels). The replica call is a stand-in recording `cancel()`: the live
path through Ray Serve is tests/integration/test_grpc_identity_cancel.py."""

import asyncio

import grpc
import pytest

from kvmesh.cluster import serve_grpc_cancel
from kvmesh.cluster.serve_grpc_cancel import _REPLICA_CALLS, _CancelledWithTheCall


class ReplicaCall:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class Handle:
    def __init__(self):
        self.calls: list[ReplicaCall] = []
        self.options = "kept"  # any other attribute is the handle's own

    def remote(self, *args, **kwargs):
        self.calls.append(ReplicaCall())
        return self.calls[-1]


async def serve_and_call(how: str) -> tuple[Handle, object, int]:
    """One call ending `how`; (the handle, the client's status code, replica calls it left tracked)."""
    handle = Handle()
    tracked_before = len(_REPLICA_CALLS)
    entered = asyncio.Event()

    async def method(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        wrapped = _CancelledWithTheCall(handle, context)
        assert wrapped.options == "kept"
        wrapped.remote(request)
        entered.set()
        if how == "ok":
            context.set_code(grpc.StatusCode.OK)  # as Serve's proxy sets each status
            return b"done"
        if how == "error":
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            return b""
        if how == "no status":
            return b""
        await asyncio.sleep(30)  # "cancel" and "deadline": the client ends the call
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.S", {"M": grpc.unary_unary_rpc_method_handler(method)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/M")(b"x", timeout=0.3 if how == "deadline" else 10)
            if how == "cancel":
                await asyncio.wait_for(entered.wait(), 10)
                call.cancel()
            try:
                await call
                code = grpc.StatusCode.OK
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
            except grpc.aio.AioRpcError as e:
                code = e.code()
        for _ in range(100):  # the server's done callback runs after the client has its answer
            if len(_REPLICA_CALLS) == tracked_before:
                break
            await asyncio.sleep(0.02)
    finally:
        await server.stop(None)
    return handle, code, len(_REPLICA_CALLS) - tracked_before


@pytest.mark.parametrize("how,client_sees,cancelled", [
    ("ok", grpc.StatusCode.OK, False),
    ("error", grpc.StatusCode.RESOURCE_EXHAUSTED, True),
    # gRPC answers OK, but no status was set (as in the lost cancels traced in the module): cancelled
    ("no status", grpc.StatusCode.OK, True),
    ("cancel", grpc.StatusCode.CANCELLED, True),
    ("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, True),
])
def test_the_replica_call_is_cancelled_unless_the_grpc_call_ended_ok(how, client_sees, cancelled):
    handle, code, tracked = asyncio.run(serve_and_call(how))
    assert len(handle.calls) == 1
    assert code == client_sees, code
    assert handle.calls[0].cancelled is cancelled, how
    assert tracked == 0  # the call's entry is dropped when it ends, whatever its status


def test_cancel_replica_call_cancels_a_running_call_and_nothing_else():
    call = ReplicaCall()
    _REPLICA_CALLS[id(call)] = call
    try:
        serve_grpc_cancel.cancel_replica_call(object())  # a context with no replica call
        assert not call.cancelled
        serve_grpc_cancel.cancel_replica_call(call)  # looked up by the context's id
        assert call.cancelled
    finally:
        _REPLICA_CALLS.pop(id(call), None)
