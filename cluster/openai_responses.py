"""OpenAI response bodies and SSE chunks for chat completions and completions."""

from __future__ import annotations

import json

from kvmesh.cluster.openai_protocol import usage


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def finish_reason(reason: str | None) -> str | None:
    # "abort" reaches a client only when its request was aborted through the API (gRPC Abort).
    return reason


class Shaper:
    """Builds the bodies of one request (chat or completion); `decode` turns a token id into text."""

    def __init__(self, kind: str, request_id: str, model: str, created: int, decode,
                 top_logprobs: int | None):
        self.kind, self.id, self.model, self.created = kind, request_id, model, created
        self.decode = decode
        self.top_logprobs = top_logprobs  # None: no logprobs requested
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.role = "assistant"  # a chat answer's (openai_request.response_role)
        self.return_token_ids = False  # vLLM's: token_ids on each choice (and chunk), prompt_token_ids

    # ---- logprobs ----------------------------------------------------------------------------

    def chat_logprobs(self, token_ids, logprobs, tops) -> dict | None:
        if self.top_logprobs is None or not logprobs:
            return None
        content = []
        for i, (tok, lp) in enumerate(zip(token_ids, logprobs)):
            text = self.decode(tok)
            top = tops[i] if tops and i < len(tops) and tops[i] else {}
            content.append({
                "token": text, "logprob": lp, "bytes": list(text.encode()),
                "top_logprobs": [{"token": self.decode(t), "logprob": v,
                                  "bytes": list(self.decode(t).encode())}
                                 for t, v in list(top.items())[: self.top_logprobs]]})
        return {"content": content}

    def logprob_entries(self, delta) -> list[dict]:
        """The chat's logprob entries of a delta's tokens ([] when none were asked for)."""
        return (self.chat_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs) or {}).get("content", [])

    def _completion_logprobs(self, token_ids, logprobs, tops, offset: int) -> dict | None:
        if self.top_logprobs is None or not logprobs:
            return None
        tokens = [self.decode(t) for t in token_ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top_list = []
        for i in range(len(tokens)):
            top = tops[i] if tops and i < len(tops) and tops[i] else {}
            top_list.append({self.decode(t): v for t, v in list(top.items())[: self.top_logprobs]})
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_list,
                "text_offset": offsets}

    # ---- whole responses ---------------------------------------------------------------------

    def full(self, text: str, token_ids, logprobs, tops, reason: str | None,
             prompt_tokens: int, cached_tokens: int, stop_reason: str | int | None = None) -> dict:
        """stop_reason (vLLM's): the stop string or stop token id that ended it, else None."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": self.role, "content": text},
                      "logprobs": self.chat_logprobs(token_ids, logprobs, tops),
                      "finish_reason": finish_reason(reason), "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text,
                      "logprobs": self._completion_logprobs(token_ids, logprobs, tops, 0),
                      "finish_reason": finish_reason(reason), "stop_reason": stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(prompt_tokens, len(token_ids), cached_tokens)}

    # ---- stream chunks -----------------------------------------------------------------------

    def _chunk(self, choices: list, usage_body: dict | None = None, include_usage_key=False) -> dict:
        body = {"id": self.id, "object": self.object + ".chunk" if self.kind == "chat" else self.object,
                "created": self.created, "model": self.model, "choices": choices}
        if include_usage_key:
            body["usage"] = usage_body
        return body

    def role_chunk(self, include_usage: bool) -> dict | None:
        if self.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": self.role, "content": ""},
                             "logprobs": None, "finish_reason": None}], None, include_usage)

    def delta_chunk(self, text: str, token_ids, logprobs, tops, reason: str | None,
                    text_offset: int, include_usage: bool, stop_reason: str | int | None = None,
                    usage_so_far: dict | None = None) -> dict:
        """usage_so_far: the usage of the request up to this chunk (stream_options
        continuous_usage_stats), else None."""
        if self.kind == "chat":
            delta = {"content": text} if text or reason is None else {}
            choice = {"index": 0, "delta": delta,
                      "logprobs": self.chat_logprobs(token_ids, logprobs, tops),
                      "finish_reason": finish_reason(reason)}
        else:
            choice = {"index": 0, "text": text,
                      "logprobs": self._completion_logprobs(token_ids, logprobs, tops, text_offset),
                      "finish_reason": finish_reason(reason)}
        choice["stop_reason"] = stop_reason
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._chunk([choice], usage_so_far, include_usage)

    def choice_chunk(self, delta: dict, reason: str | None, include_usage: bool,
                     index: int = 0) -> dict:
        """A chat chunk with this delta (content and/or tool_calls) of choice `index`, no logprobs."""
        return self._chunk([{"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": finish_reason(reason)}], None, include_usage)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens), True)
