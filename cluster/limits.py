"""Per-request limits the ingress enforces before a request reaches a worker (`limits:` in the
serving config): request body size (413), prompt tokens and output tokens (400 naming the field and
the limit).

Concurrency is bounded elsewhere, by Serve: each worker replica accepts `replicas.max_ongoing_requests`
at once and each ingress holds at most `replicas.max_queued_requests` waiting for a slot; beyond
that the handle call fails at once and the client gets 429 / RESOURCE_EXHAUSTED with Retry-After
(cluster/generation.py), so no queue grows without bound.
"""

from __future__ import annotations

from kvmesh.cluster.openai_protocol import ApiError


class RequestLimits:
    def __init__(self, section):
        self.max_prompt_tokens: int | None = section.max_prompt_tokens
        self.max_output_tokens: int | None = section.max_output_tokens
        self.max_body_bytes: int = section.max_body_bytes

    def body_too_large(self, num_bytes: int) -> ApiError:
        return ApiError(413, f"the request body is {num_bytes} bytes or more; the limit is "
                        f"{self.max_body_bytes} bytes (limits.max_body_bytes)",
                        code="request_too_large")

    async def read_body(self, request) -> bytes:
        """The HTTP body, refused (413) as soon as it passes max_body_bytes: a client cannot make
        the ingress buffer more than the limit."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self.body_too_large(int(declared))
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self.body_too_large(size)
            parts.append(chunk)
        return b"".join(parts)

    def check_prompt(self, num_tokens: int, param: str) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise ApiError(400, f"the prompt is {num_tokens} tokens; the limit is "
                           f"{self.max_prompt_tokens} (limits.max_prompt_tokens)", param=param,
                           code="context_length_exceeded")

    def output_budget(self, requested: int | None, context_left: int, param: str) -> int:
        """The most output tokens this request may have: the context left, capped by
        max_output_tokens. A request asking for more than the cap is refused naming `param`."""
        if self.max_output_tokens is None:
            return context_left
        if requested is not None and not isinstance(requested, bool) and requested > self.max_output_tokens:
            raise ApiError(400, f"{param} is {requested}; the limit is {self.max_output_tokens} "
                           "(limits.max_output_tokens)", param=param)
        return min(context_left, self.max_output_tokens)
