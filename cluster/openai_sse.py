"""The server-sent-events bodies of streamed OpenAI responses: a request's streams (one per prompt,
each with its choices) merged as their deltas come, the tool-call form of a chat with tools, and
the response class that closes the worker streams however the response ends."""

import asyncio
import contextlib

from fastapi.responses import StreamingResponse

from kvmesh.cluster import tool_parser
from kvmesh.cluster.openai_choices import StreamChoices
from kvmesh.cluster.openai_protocol import usage
from kvmesh.cluster.openai_responses import SSE_DONE, Shaper, sse
from kvmesh.cluster.pipeline import DeltaStream


async def merged_deltas(streams: list[DeltaStream]):
    """(choice index, delta) of every stream as they come."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    iters = [s.__aiter__() for s in streams]
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.get):
                i = pending.pop(future)
                try:
                    delta = future.result()
                except StopAsyncIteration:
                    continue
                yield i, delta
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def sse_body(streams: list[DeltaStream], choices: list[StreamChoices], shaper: Shaper,
               include_usage: bool, continuous_usage: bool = False):
    """The SSE body of a request's streams (one per prompt, each with its choices: n > 1 and echo,
    cluster/openai_choices.py); closing it closes the streams (which aborts the requests on the
    workers): SseResponse does so however the response ends."""
    async with contextlib.AsyncExitStack() as stack:
        for stream in streams:
            await stack.enter_async_context(stream)
        for prompt_choices in choices:
            for role in prompt_choices.role_chunks():
                yield sse(role)
        counts = [0] * len(streams)
        # closed before the streams (the stack unwinds in reverse): its reads in flight are
        # cancelled first, so closing each stream then finds none running
        merged = await stack.enter_async_context(contextlib.aclosing(merged_deltas(streams)))
        async for i, delta in merged:
            counts[i] += len(delta.token_ids)
            so_far = (usage(prompt_tokens(streams[i], delta), counts[i], delta.num_cached_tokens)
                      if continuous_usage else None)
            for chunk in choices[i].chunks(delta, so_far):
                yield sse(chunk)
        if include_usage:
            yield sse(shaper.usage_chunk(sum(prompt_tokens(s, s.last) for s in streams),
                                         sum(s.num_tokens for s in streams),
                                         sum(s.last.num_cached_tokens for s in streams)))
        yield SSE_DONE


class SseResponse(StreamingResponse):
    """A StreamingResponse that closes its body and the worker stream when it ends, however it
    ends. Starlette 1.x does not close the body iterator: when a client goes while the response
    waits in `send` (its socket full: a client that stopped reading, cut by the stream idle
    timeout), Starlette cancels the response there, outside the generator, which stays suspended
    at a `yield` holding the worker stream open until the garbage collector finalizes it, which
    Serve's frozen, slowed GC does late or never: the engine generated on (70% of unread
    streams' tokens on the direct port, and 36 s after clients closed; docs/RELIABILITY.md
    "Backpressure"). On Serve's proxy path the ingress's `send` never waits, so the cancel lands
    inside the generator instead."""

    def __init__(self, streams: list[DeltaStream], body, **kwargs):
        super().__init__(body, **kwargs)
        self._streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            for stream in self._streams:  # also when the body never started
                await stream.aclose()


def prompt_tokens(stream: DeltaStream, delta) -> int:
    return delta.num_prompt_tokens or stream.routed.num_prompt_tokens


async def sse_tool_body(stream: DeltaStream, shaper: Shaper, include_usage: bool, tools,
                     num_choices: int, reasoning=None):
    """The SSE body of a chat with tools: content and tool-call deltas (tool_parser.ToolStream),
    one parser per choice (n > 1: each sequence's output is parsed on its own). With `reasoning`
    (cluster.reasoning.ChatReasoning), the thinking block streams as `reasoning` deltas and only
    the content is read for calls."""
    parsers: dict[int, tool_parser.ToolStream] = {}
    async with stream:
        for index in range(num_choices):
            role = shaper.role_chunk(include_usage)
            role["choices"][0]["index"] = index
            yield sse(role)
        async for delta in stream:
            parser = parsers.setdefault(delta.index, tool_parser.ToolStream(tools))
            ended = delta.finish_reason is not None  # this sequence's end
            pieces, text = (reasoning.pieces(delta.index, delta.text, ended) if reasoning is not None
                            else ([], delta.text))
            pieces += parser.feed(text)
            if ended:
                pieces += parser.finish()
            for piece in pieces:
                yield sse(shaper.choice_chunk(piece, None, include_usage, delta.index))
            if ended:
                reason = tool_parser.finish_reason(delta.finish_reason, tools, parser.calls)
                yield sse(shaper.choice_chunk({}, reason, include_usage, delta.index))
        if include_usage:
            last = stream.last
            yield sse(shaper.usage_chunk(last.num_prompt_tokens or stream.routed.num_prompt_tokens,
                                         stream.num_tokens, last.num_cached_tokens))
        yield SSE_DONE
