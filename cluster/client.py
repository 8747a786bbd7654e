"""A small Python client of a kvmesh cluster: streams a completion over gRPC (kvmesh.v1) or over
the OpenAI HTTP API (SSE). Used by `kvmesh client` and the tests.

    from kvmesh.cluster.client import grpc_stream
    for delta in grpc_stream("127.0.0.1:9000", "Hello", max_tokens=32, temperature=0):
        print(delta.text, end="", flush=True)
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator


def grpc_stream(target: str, prompt: str | None = None, messages: list[dict] | None = None,
                max_tokens: int = 16, temperature: float | None = None, seed: int | None = None,
                request_id: str = "", timeout_s: float = 300.0, api_key: str | None = None,
                **fields) -> Iterator:
    """Yields kvmesh.v1.GenerateResponse messages (the last one has finish_reason and usage).
    request_id: a label of the caller's for the request (what Abort takes; one label in flight per
    API key). timeout_s: the call's deadline; when it passes, the server stops the request."""
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(max_tokens=max_tokens, request_id=request_id, **fields)
    if messages:
        req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif prompt is not None:
        req.prompt = prompt
    if temperature is not None:
        req.temperature = temperature
    if seed is not None:
        req.seed = seed
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        yield from stub.Generate(req, timeout=timeout_s, metadata=_key_metadata(api_key))


def _key_metadata(api_key: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def grpc_call(target: str, method: str, request=None, timeout_s: float = 30.0,
              api_key: str | None = None):
    """One unary RPC (Health, ListModels, Abort) by name."""
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    default = {"Health": pb.HealthRequest, "ListModels": pb.ListModelsRequest}
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return getattr(stub, method)(request if request is not None else default[method](),
                                     timeout=timeout_s, metadata=_key_metadata(api_key))


def http_stream(base_url: str, prompt: str | None = None, messages: list[dict] | None = None,
                model: str = "", max_tokens: int = 16, temperature: float | None = None,
                seed: int | None = None, api_key: str | None = None,
                timeout_s: float = 300.0) -> Iterator[dict]:
    """Yields the SSE chunks (parsed JSON) of a streamed chat completion (messages) or
    completion (prompt) from an OpenAI-compatible base URL such as http://127.0.0.1:8000/v1."""
    body = {"model": model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if temperature is not None:
        body["temperature"] = temperature
    if seed is not None:
        body["seed"] = seed
    if messages:
        body["messages"], path = messages, "/chat/completions"
    else:
        body["prompt"], path = prompt or "", "/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(base_url.rstrip("/") + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            yield json.loads(data)


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=timeout_s) as resp:
        return json.load(resp)["data"][0]["id"]
