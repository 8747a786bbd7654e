"""The schema walk's table: every request field of OpenAI's CreateChatCompletionRequest and
CreateCompletionRequest and of vLLM's extra request fields, with a non-default value and what
kvmesh does with it. Walked at parse level with the engine (tests/unit/test_api_fields.py) and
against a real `kvmesh serve` (tests/integration/test_cluster_serving.py); any field the server
accepts without the effect asserted here fails them.

Outcomes:
- "sampling": the output differs from the same request without the field (`base` fields in both),
  and the server's output equals the offline engine's with the same SamplingParams;
- "check": honoured as the named check asserts (the integration test's CHECKS);
- "refused": 400 naming the field;
"""

from dataclasses import dataclass, field

CHAT, COMPLETION = "chat", "completion"
BOTH = (CHAT, COMPLETION)

A = 65  # the tiny model's byte tokenizer: "A"; 257 is "<|im_start|>", 258 EOS
SAMPLED = {"temperature": 1.0, "seed": 7}
NUDGE_A = {"logit_bias": {str(A): 1.0}}  # greedy then says A every time (the model's logits are small)


@dataclass(frozen=True)
class Row:
    field: str
    value: object
    outcome: str
    kinds: tuple = BOTH
    base: dict = field(default_factory=dict)
    source: str = "vllm"  # "openai": in OpenAI's schema (vLLM implements those too)


ROWS = [
    # ---- OpenAI, both endpoints ----
    Row("model", "random:tiny-llama", "check", source="openai"),
    Row("max_tokens", 3, "check", source="openai"),
    Row("temperature", 1.0, "sampling", base={"seed": 7}, source="openai"),
    Row("top_p", 0.001, "check", base=SAMPLED, source="openai"),  # equals greedy
    Row("seed", 8, "sampling", base={"temperature": 1.0}, source="openai"),
    Row("stop", ["AAA"], "sampling", base=NUDGE_A, source="openai"),
    Row("presence_penalty", 2.0, "sampling", base=NUDGE_A, source="openai"),
    Row("frequency_penalty", 1.0, "sampling", base=NUDGE_A, source="openai"),
    Row("logit_bias", {str(A): 100}, "sampling", source="openai"),
    Row("stream", True, "check", source="openai"),
    Row("stream_options", {"include_usage": True, "continuous_usage_stats": True}, "check",
        base={"stream": True}, source="openai"),
    Row("user", "someone", "check", source="openai"),  # the session policy's routing key
    Row("logprobs", 2, "check", (COMPLETION,), source="openai"),
    Row("n", 2, "check", source="openai"),
    Row("service_tier", "flex", "refused", source="openai"),
    Row("prompt_cache_key", "k", "check", source="openai"),
    Row("safety_identifier", "s", "refused", source="openai"),
    # ---- OpenAI, completions ----
    Row("prompt", [[72, 105], [72, 111]], "check", (COMPLETION,), source="openai"),
    Row("echo", True, "check", (COMPLETION,), source="openai"),
    Row("best_of", 2, "check", (COMPLETION,), source="openai"),
    Row("best_of", 2, "refused", (CHAT,), source="openai"),
    Row("suffix", "tail", "refused", (COMPLETION,), source="openai"),
    # ---- OpenAI, chat ----
    Row("messages", [{"role": "user", "content": "other"}], "check", (CHAT,), source="openai"),
    Row("max_completion_tokens", 3, "check", (CHAT,), source="openai"),
    Row("logprobs", True, "check", (CHAT,), source="openai"),
    Row("top_logprobs", 2, "check", (CHAT,), base={"logprobs": True}, source="openai"),
    Row("response_format", {"type": "json_object"}, "check", source="openai"),
    Row("tools", [{"type": "function", "function": {"name": "f"}}], "check", (CHAT,),
        base={"tool_choice": "required"}, source="openai"),
    Row("tool_choice", "required", "check", (CHAT,), base={"tools": [{"type": "function", "function": {"name": "f"}}]},
        source="openai"),
    Row("parallel_tool_calls", False, "check", (CHAT,),
        base={"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        source="openai"),
    Row("functions", [{"name": "f"}], "refused", (CHAT,), source="openai"),
    Row("function_call", "auto", "refused", (CHAT,), source="openai"),
    Row("modalities", ["text", "audio"], "refused", (CHAT,), source="openai"),
    Row("audio", {"voice": "alloy", "format": "wav"}, "refused", (CHAT,), source="openai"),
    Row("store", True, "refused", (CHAT,), source="openai"),
    Row("metadata", {"k": "v"}, "refused", (CHAT,), source="openai"),
    Row("web_search_options", {}, "refused", (CHAT,), source="openai"),
    Row("prediction", {"type": "content", "content": "x"}, "refused", (CHAT,), source="openai"),
    # a template variable, and enable_thinking false for "none" (vLLM's): the random presets'
    # template has Qwen3's switch
    Row("reasoning_effort", "none", "check", (CHAT,), source="openai"),
    Row("verbosity", "low", "refused", (CHAT,), source="openai"),
    # ---- vLLM's extra sampling fields ----
    Row("top_k", 1, "check", base=SAMPLED),  # equals greedy
    Row("min_p", 1.0, "check", base=SAMPLED),  # equals greedy
    Row("repetition_penalty", 10.0, "sampling", base=NUDGE_A),
    Row("ignore_eos", True, "sampling", base={"logit_bias": {"258": 100}}),
    Row("min_tokens", 4, "sampling", base={"logit_bias": {"258": 100}}),
    Row("stop_token_ids", [A], "sampling", base=NUDGE_A),
    Row("include_stop_str_in_output", True, "sampling", base={**NUDGE_A, "stop": ["AA"]}),
    Row("skip_special_tokens", False, "sampling", base={"logit_bias": {"257": 100}}),
    Row("use_beam_search", True, "refused"),
    Row("length_penalty", 0.5, "refused"),
    Row("spaces_between_special_tokens", False, "refused"),
    Row("truncate_prompt_tokens", 4, "check"),
    Row("allowed_token_ids", [A, 66], "sampling"),
    Row("bad_words", ["A"], "sampling", base=NUDGE_A),
    Row("logits_processors", ["x"], "refused"),
    Row("return_tokens_as_token_ids", True, "check"),
    Row("return_token_ids", True, "check"),
    Row("priority", 1, "check"),
    Row("request_id", "mine", "refused"),
    Row("cache_salt", "salt", "check"),
    Row("kv_transfer_params", {"k": 1}, "refused"),
    Row("vllm_xargs", {"k": 1}, "refused"),
    # the tiny model's byte tokenizer adds no special tokens: the same answer either way here
    # (their effect with a BOS-adding tokenizer: tests/integration/test_prompt_rendering.py)
    Row("add_special_tokens", False, "check", (COMPLETION,)),
    Row("add_special_tokens", True, "check", (CHAT,)),
    Row("prompt_logprobs", 1, "check"),
    Row("structured_outputs", {"choice": ["a", "b"]}, "check"),
    Row("guided_json", {"type": "object"}, "check"),
    Row("guided_regex", "a+", "check"),
    Row("guided_choice", ["a", "b"], "check"),
    Row("guided_grammar", "root ::= \"a\"", "check"),
    Row("guided_decoding_backend", "xgrammar", "check", base={"guided_choice": ["a", "b"]}),
    Row("guided_whitespace_pattern", " ", "refused"),
    Row("structural_tag", "{}", "refused"),
    # ---- vLLM's chat fields ----
    Row("echo", True, "check", (CHAT,), base={"add_generation_prompt": False, "continue_final_message": True}),
    Row("add_generation_prompt", False, "check", (CHAT,)),
    Row("continue_final_message", True, "check", (CHAT,), base={"add_generation_prompt": False}),
    # the tiny model's template renders no documents: the same answer (a template that does:
    # tests/integration/test_prompt_rendering.py)
    Row("documents", [{"title": "t", "text": "x"}], "check", (CHAT,)),
    # refused by a server whose server.trust_request_chat_template is off, as the walk's
    Row("chat_template", "{{ messages }}", "check", (CHAT,)),
    Row("chat_template_kwargs", {"enable_thinking": False}, "check", (CHAT,)),
    Row("mm_processor_kwargs", {"k": 1}, "refused", (CHAT,)),
    # the walk's server has no reasoning parser: the same answer (one that has:
    # tests/integration/test_reasoning_serving.py)
    Row("include_reasoning", False, "check", (CHAT,)),
    # ---- vLLM's completions fields ----
    Row("prompt_embeds", "AAAA", "refused", (COMPLETION,)),
]


def rows(kind: str, outcome_prefix: str = "") -> list[Row]:
    return [r for r in ROWS if kind in r.kinds and r.outcome.startswith(outcome_prefix)]


def row_id(row: Row) -> str:
    return f"{row.field}-{'-'.join(row.kinds)}"
