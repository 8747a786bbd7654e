"""Serve's gRPC proxy (Ray 2.60) can miss a client's cancel or deadline, and the request then runs
to its end on the ingress and the worker.

The proxy answers a streaming call with an async generator that gRPC's asyncio server iterates; a
cancel cancels gRPC's task wherever it is. When it lands while gRPC is writing a message (rather
than while the proxy awaits the replica's next result, where Serve cancels the replica call), the
generators are left suspended at a `yield`, and nothing cancels the replica call until the garbage
collector finalizes them: seconds later, or never before the request ends (Serve freezes the GC
and slows it down).

The fix ties the replica call to the gRPC call: when the call ends without the proxy having set its
status OK, gRPC's done callback cancels the replica call, whatever state the generators are in.
"Without OK", not "cancelled": in the calls that were lost, the done callback ran with
`context.cancelled()` False and no status code at all (traced on a CPU cluster: 6 of 96 cancels
and deadlines, both kinds; each had cancelled nothing before this rule). A call that ended OK has
had every result of the replica; cancelling a call that already ended in an error is a no-op.
"""

from __future__ import annotations

import grpc


# id(gRPC context) -> its call's replica call, while the gRPC call runs (stream_idle_timeout.py
# cancels the replica call of a stream whose client stopped reading).
_REPLICA_CALLS: dict[int, object] = {}


def cancel_replica_call(grpc_context) -> None:
    """Cancel the replica call of a gRPC call that is still running (nothing if it has none)."""
    response = _REPLICA_CALLS.get(id(grpc_context))
    if response is not None:
        response.cancel()


class _CancelledWithTheCall:
    """A DeploymentHandle whose calls are cancelled when the client's gRPC call ends unfinished."""

    def __init__(self, handle, grpc_context):
        self._handle = handle
        self._grpc_context = grpc_context

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def remote(self, *args, **kwargs):
        response = self._handle.remote(*args, **kwargs)
        _REPLICA_CALLS[id(self._grpc_context)] = response

        def on_done(context):
            _REPLICA_CALLS.pop(id(context), None)
            if context.code() != grpc.StatusCode.OK:
                response.cancel()

        self._grpc_context.add_done_callback(on_done)
        return response


def apply() -> None:
    from ray.serve._private.proxy import gRPCProxy

    original = gRPCProxy.setup_request_context_and_handle
    if getattr(original, "kvmesh_patched", False):
        return

    def setup_request_context_and_handle(self, app_name, handle, route, proxy_request,
                                         internal_request_id):
        handle, request_id = original(self, app_name, handle, route, proxy_request,
                                      internal_request_id)
        return _CancelledWithTheCall(handle, proxy_request.context), request_id

    setup_request_context_and_handle.kvmesh_patched = True
    gRPCProxy.setup_request_context_and_handle = setup_request_context_and_handle
