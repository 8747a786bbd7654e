"""Every request field of OpenAI's and vLLM's chat/completions schemas that kvmesh does not
implement, with why: a request that gives one a value other than its no-op default is answered 400
naming it (nothing is silently ignored). Fields in neither the request models of
openai_protocol.py nor this table are unknown: 400 naming them too.

To implement a field: add it to the request model, remove its entry here, and flip its row in
tests/api_field_table.py (the schema walk).
"""

from __future__ import annotations

from dataclasses import dataclass

CHAT, COMPLETION = "chat", "completion"
BOTH = frozenset({CHAT, COMPLETION})


@dataclass(frozen=True)
class Refused:
    reason: str
    kinds: frozenset = BOTH
    # Values that ask for nothing beyond what kvmesh does (the field's default): accepted.
    no_op: tuple = (None,)


def _refused(reason: str, kinds=BOTH, no_op=(None,)) -> Refused:
    return Refused(reason, frozenset(kinds), no_op)


REFUSED: dict[str, Refused] = {
    # structured outputs and tools (cluster/structured_request.py, cluster/tool_calls.py): what
    # kvmesh does not implement of them
    "guided_whitespace_pattern": _refused("guided_whitespace_pattern is not supported (xgrammar's "
                                          "JSON whitespace is used)"),
    "structural_tag": _refused("structural_tag is not supported"),
    "functions": _refused("functions (deprecated) is not supported; use tools", {CHAT}, (None, [])),
    "function_call": _refused("function_call (deprecated) is not supported; use tool_choice", {CHAT},
                              (None, "none")),
    # best_of on chat: a completions field (openai_protocol.check_choices refuses it by name)
    "best_of": _refused("best_of is a field of /v1/completions, not of chat completions", {CHAT}),
    "use_beam_search": _refused("beam search is not supported", no_op=(None, False)),
    "length_penalty": _refused("length_penalty (beam search) is not supported", no_op=(None, 1, 1.0)),
    # OpenAI-only
    "suffix": _refused("suffix (fill in the middle) is not supported", {COMPLETION}),
    "modalities": _refused("only text output is supported", {CHAT}, (None, ["text"])),
    "audio": _refused("audio output is not supported", {CHAT}),
    "store": _refused("completions are not stored", {CHAT}, (None, False)),
    "metadata": _refused("metadata is for stored completions, which kvmesh does not keep", {CHAT}),
    "service_tier": _refused("service tiers are not supported", no_op=(None, "auto", "default")),
    "web_search_options": _refused("web search is not supported", {CHAT}),
    "prediction": _refused("predicted outputs are not supported", {CHAT}),
    "verbosity": _refused("verbosity is not supported", {CHAT}),
    "safety_identifier": _refused("safety_identifier is not supported"),
    # vLLM's chat template and prompt handling
    "mm_processor_kwargs": _refused("multimodal input is not supported", {CHAT}),
    "prompt_embeds": _refused("prompt_embeds is not supported", {COMPLETION}),
    # vLLM's other sampling and output fields
    "spaces_between_special_tokens": _refused("spaces_between_special_tokens is not supported",
                                              no_op=(None, True)),
    "logits_processors": _refused("logits_processors is not supported"),
    "request_id": _refused("request_id is not supported over HTTP (the server names requests)"),
    "kv_transfer_params": _refused("KV transfer is not supported"),
    "vllm_xargs": _refused("vllm_xargs is not supported"),
}

STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def refused_fields(kind: str) -> dict[str, Refused]:
    return {name: r for name, r in REFUSED.items() if kind in r.kinds}


def check_fields(body: dict, kind: str, model_fields) -> None:
    """Raise ApiError 400 naming the first unknown field, or the first refused field given a
    value that asks for something; `model_fields`: the fields the request model implements."""
    from kvmesh.cluster.openai_protocol import ApiError

    refused = refused_fields(kind)
    unknown = sorted(k for k in body if k not in model_fields and k not in refused)
    if unknown:
        what = "chat completions" if kind == CHAT else "completions"
        raise ApiError(400, f"unknown field{'s' if len(unknown) > 1 else ''} "
                       f"{', '.join(map(repr, unknown))} (not in the OpenAI or vLLM {what} "
                       "request; see docs/SERVING.md)", param=unknown[0])
    for name, why in refused.items():
        if name in body and not _is_no_op(body[name], why.no_op):
            raise ApiError(400, f"{name} {why.reason}" if why.reason.startswith("is ")
                           else f"{name}: {why.reason}", param=name)


def _is_no_op(value, no_op: tuple) -> bool:
    # bool is an int in Python: True must not pass as 1
    return any(value == v and type(value) is type(v) or (value is None and v is None)
               for v in no_op)
