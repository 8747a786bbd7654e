"""`echo` on completions and vLLM's `prompt_logprobs`, rendered from the engine's PromptLogprobs.

- echo: the choice's text starts with the prompt; with `logprobs` the prompt's tokens lead the
  choice's logprobs too, the first one's logprob and top_logprobs null (as OpenAI's API did), so a
  client sums a continuation's log-likelihood from one request (lm-eval-harness's
  `local-completions` loglikelihood).
- prompt_logprobs (vLLM): a list over the prompt tokens, null for the first, else
  {token id as a string: {"logprob", "rank", "decoded_token"}} holding the prompt token and its
  top-`prompt_logprobs` alternatives. On a completion choice, and at the top of a chat response.
"""

from __future__ import annotations

from kvmesh.protocol import PromptLogprobs


def echo_logprobs(prompt_ids: list[int], scores: PromptLogprobs, decode, top_k: int) -> dict:
    """The prompt's part of a completion choice's `logprobs` (offsets from 0)."""
    tokens = [decode(t) for t in prompt_ids]
    offsets, pos = [], 0
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top_logprobs: list = [None]
    for i in range(1, len(prompt_ids)):
        top = {decode(t): v for t, v in list((scores.top[i] or {}).items())[:top_k]}
        if top_k:  # the prompt token itself is listed, as OpenAI lists a sampled one
            top.setdefault(tokens[i], scores.logprobs[i])
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": list(scores.logprobs), "top_logprobs": top_logprobs,
            "text_offset": offsets}


def join_logprobs(prompt_part: dict, completion_part: dict | None, text_shift: int) -> dict:
    """The echoed prompt's logprobs followed by the completion's (its offsets moved past the
    prompt's text)."""
    if completion_part is None:
        return prompt_part
    return {"tokens": prompt_part["tokens"] + completion_part["tokens"],
            "token_logprobs": prompt_part["token_logprobs"] + completion_part["token_logprobs"],
            "top_logprobs": prompt_part["top_logprobs"] + completion_part["top_logprobs"],
            "text_offset": prompt_part["text_offset"] + [o + text_shift for o in completion_part["text_offset"]]}


def vllm_prompt_logprobs(prompt_ids: list[int], scores: PromptLogprobs, decode, top_k: int) -> list:
    out: list = [None]
    for i in range(1, len(prompt_ids)):
        token = prompt_ids[i]
        entry = {str(token): {"logprob": scores.logprobs[i], "rank": scores.ranks[i],
                              "decoded_token": decode(token)}}
        for rank, (alt, value) in enumerate(list((scores.top[i] or {}).items())[:top_k], start=1):
            entry.setdefault(str(alt), {"logprob": value, "rank": rank, "decoded_token": decode(alt)})
        out.append(entry)
    return out


def echo_for(req, kind: str, prompt_text: str | None, prompt_ids: list[int], frontend,
             token_decode=None) -> "Echo | None":
    """What an OpenAI request asks of its prompt (echo, prompt_logprobs); None when nothing.
    prompt_text: the prompt as sent when it was text (else its tokens are decoded); on chat, what
    `echo` puts before the answer (openai_request.chat_echo_text). token_decode: how an echoed
    prompt token is named in the logprobs (return_tokens_as_token_ids: "token_id:N")."""
    echo = bool(getattr(req, "echo", False))
    if not echo and req.prompt_logprobs is None:
        return None
    text = prompt_text if prompt_text is not None else frontend.tokenizer.decode(prompt_ids)
    echoed = Echo(echo, text, list(prompt_ids), token_decode or frontend.decode_token,
                  getattr(req, "logprobs", None) if kind == "completion" else None, req.prompt_logprobs,
                  kind)
    echoed.text_decode = frontend.decode_token  # prompt_logprobs' decoded_token: the text
    return echoed


class Echo:
    """What one request asked of the prompt: its text echoed (completions; on chat the final
    message's content, vLLM's), its logprobs."""

    def __init__(self, echo: bool, prompt_text: str, prompt_ids: list[int], decode,
                 logprobs: int | None, prompt_logprobs: int | None, kind: str = "completion"):
        self.echo, self.prompt_text, self.prompt_ids = echo, prompt_text, prompt_ids
        self.decode, self.logprobs, self.prompt_logprobs = decode, logprobs, prompt_logprobs
        self.kind = kind
        self.text_decode = decode

    def choice_logprobs(self, scores: PromptLogprobs | None, completion_part: dict | None) -> dict | None:
        if not self.echo or self.logprobs is None or scores is None:
            return completion_part
        return join_logprobs(echo_logprobs(self.prompt_ids, scores, self.decode, self.logprobs),
                             completion_part, len(self.prompt_text))

    def text(self, completion_text: str) -> str:
        return self.prompt_text + completion_text if self.echo else completion_text

    def vllm_list(self, scores: PromptLogprobs | None) -> list | None:
        if self.prompt_logprobs is None or scores is None:
            return None
        return vllm_prompt_logprobs(self.prompt_ids, scores, self.text_decode, self.prompt_logprobs)

    def apply(self, body: dict, kind: str, scores: PromptLogprobs | None) -> dict:
        """A whole (non-streaming) response body with the prompt echoed and scored."""
        choice = body["choices"][0]
        if kind == "chat":
            if self.prompt_logprobs is not None:
                body["prompt_logprobs"] = self.vllm_list(scores)
            if self.echo:
                choice["message"]["content"] = self.prompt_text + (choice["message"]["content"] or "")
            return body
        choice["logprobs"] = self.choice_logprobs(scores, choice["logprobs"])
        choice["text"] = self.text(choice["text"])
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm_list(scores)
        return body

    def first_chunk(self, scores: PromptLogprobs | None) -> dict | None:
        """A stream's echoed prompt, as the choice of a chunk sent before the first token."""
        if not self.echo:
            return None
        if self.kind == "chat":  # vLLM sends it only when there is something to echo
            return ({"index": 0, "delta": {"content": self.prompt_text}, "logprobs": None, "finish_reason": None}
                    if self.prompt_text else None)
        choice = {"index": 0, "text": self.prompt_text,
                  "logprobs": self.choice_logprobs(scores, None) if self.logprobs is not None else None,
                  "finish_reason": None}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm_list(scores)
        return choice
