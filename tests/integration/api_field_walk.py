"""The schema walk against a real `kvmesh serve` (tests/api_field_table.py's rows): the helpers
test_cluster_serving.py's walk uses, and the checks of the rows whose outcome is "check"."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from api_field_table import CHAT, SAMPLED

MODEL = "random:tiny-llama"
PROMPT_IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
MESSAGES = [{"role": "user", "content": "Hello world"}]
PATHS = {CHAT: "/v1/chat/completions", "completion": "/v1/completions"}


def post(url, path, body, timeout=120):
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                return resp.status, sse_events(raw)
            return resp.status, json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def sse_events(raw: str) -> list[dict]:
    events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def body(kind: str, **fields) -> dict:
    base = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    if kind == CHAT:
        base["messages"] = MESSAGES
    else:
        base["prompt"] = PROMPT_IDS
    return {**base, **fields}


def answer(url, kind, **fields) -> dict:
    status, response = post(url, PATHS[kind], body(kind, **fields))
    assert status == 200, response
    return response


def outcome(response: dict, kind: str) -> tuple:
    """What a choice says: text, finish_reason, stop_reason."""
    choice = response["choices"][0]
    text = choice["message"]["content"] if kind == CHAT else choice["text"]
    return text, choice["finish_reason"], choice.get("stop_reason")


def streamed_text(events: list[dict], kind: str, index: int = 0) -> str:
    parts = []
    for event in events:
        for choice in event["choices"]:
            if choice["index"] == index:
                parts.append((choice["delta"].get("content") or "") if kind == CHAT
                             else choice["text"])
    return "".join(parts)


# ---- the "check" rows ---------------------------------------------------------------------------

def check_model(url, kind, row):
    assert answer(url, kind, model=row.value)["model"] == MODEL
    status, err = post(url, PATHS[kind], body(kind, model="no-such-model"))
    assert (status, err["error"]["param"]) == (404, "model")


def check_max_tokens(url, kind, row):
    response = answer(url, kind, ignore_eos=True, **{"max_tokens": None, row.field: row.value})
    assert response["usage"]["completion_tokens"] == row.value


def check_equals_greedy(url, kind, row):
    greedy = outcome(answer(url, kind), kind)
    assert outcome(answer(url, kind, **SAMPLED), kind) != greedy
    assert outcome(answer(url, kind, **SAMPLED, **{row.field: row.value}), kind) == greedy


def check_stream(url, kind, row):
    status, events = post(url, PATHS[kind], body(kind, stream=True))
    assert status == 200
    assert streamed_text(events, kind) == outcome(answer(url, kind), kind)[0]


def check_stream_options(url, kind, row):
    status, events = post(url, PATHS[kind], body(kind, stream=True, ignore_eos=True,
                                                 stream_options=row.value))
    assert status == 200
    chunks = [e for e in events
              if e["choices"] and "role" not in e["choices"][0].get("delta", {})]
    assert chunks and all(e["usage"] is not None for e in chunks)  # continuous_usage_stats
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 8
    final = events[-1]  # include_usage
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8


def check_same_answer(url, kind, row):
    # `user` and `prompt_cache_key` are session routing keys (where they route:
    # tests/integration/test_session_routing.py); add_special_tokens and documents change nothing
    # for the tiny model's tokenizer and template (tests/integration/test_prompt_rendering.py);
    # include_reasoning changes nothing without a reasoning parser
    assert outcome(answer(url, kind, **{row.field: row.value}), kind) == outcome(answer(url, kind), kind)


def check_untrusted_chat_template(url, kind, row):
    status, err = post(url, PATHS[kind], body(kind, **{row.field: row.value}))
    assert (status, err["error"]["param"]) == (400, "chat_template"), err
    assert "trust_request_chat_template" in err["error"]["message"]


def check_completion_logprobs(url, kind, row):
    logprobs = answer(url, kind, logprobs=row.value)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) > 0
    # keyed by token text: two byte tokens that both decode to U+FFFD share one key
    assert all(1 <= len(top) <= row.value for top in logprobs["top_logprobs"])
    assert any(len(top) == row.value for top in logprobs["top_logprobs"])


def check_chat_logprobs(url, kind, row):
    response = answer(url, kind, **row.base, **{row.field: row.value})
    content = response["choices"][0]["logprobs"]["content"]
    assert len(content) == response["usage"]["completion_tokens"]
    if row.field == "top_logprobs":
        assert all(len(c["top_logprobs"]) == row.value for c in content)


def check_prompts(url, kind, row):
    alone = [outcome(answer(url, kind, prompt=p), kind) for p in row.value]
    response = answer(url, kind, prompt=row.value)
    assert [c["index"] for c in response["choices"]] == list(range(len(row.value)))
    assert [outcome({"choices": [c]}, kind) for c in response["choices"]] == alone
    assert response["usage"]["prompt_tokens"] == sum(len(p) for p in row.value)
    status, events = post(url, PATHS[kind], body(kind, prompt=row.value, stream=True))
    assert status == 200
    assert [streamed_text(events, kind, i) for i in range(len(row.value))] == [a[0] for a in alone]


def check_messages(url, kind, row):
    response = answer(url, kind, messages=row.value)
    assert response["usage"]["prompt_tokens"] != answer(url, kind)["usage"]["prompt_tokens"]


# ---- vLLM's chat template fields: against the offline engine's LLM.chat with the same options ----

CONTINUED = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "The sea is"}]
_offline = []


def offline_chat(messages, **options) -> tuple[str, int]:
    """(greedy text of 8 tokens, prompt tokens) of kvmesh.LLM.chat on the served model."""
    from kvmesh import LLM, SamplingParams

    if not _offline:
        _offline.append(LLM(MODEL, device="cpu"))
    out = _offline[0].chat(messages, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False, **options)[0]
    return out.text, len(out.prompt_token_ids)


def served_chat(url, messages, **fields) -> tuple[str, int, dict]:
    response = answer(url, CHAT, messages=messages, **fields)
    return response["choices"][0]["message"]["content"], response["usage"]["prompt_tokens"], response


def check_template_option(url, kind, row):
    """The prompt the template renders with the option, as LLM.chat renders it, and its answer;
    /tokenize counts the same prompt."""
    messages = CONTINUED if row.field == "continue_final_message" else MESSAGES
    options = {**row.base, row.field: row.value}
    text, prompt_tokens, response = served_chat(url, messages, **options)
    assert (text, prompt_tokens) == offline_chat(messages, **options)
    # the answer's role: the final message's without the generation prompt (vLLM's), else the assistant's
    role = messages[-1]["role"] if options.get("add_generation_prompt") is False else "assistant"
    assert response["choices"][0]["message"]["role"] == role
    assert prompt_tokens != served_chat(url, messages, **{k: v for k, v in row.base.items()
                                                          if k != "add_generation_prompt"})[1]
    status, counted = post(url, "/tokenize", {"model": MODEL, "messages": messages, **options})
    assert status == 200 and counted["count"] == prompt_tokens, counted


def check_reasoning_effort(url, kind, row):
    """OpenAI's reasoning_effort as vLLM renders it: "none" switches thinking off in the template
    (the prompt of enable_thinking false), another effort leaves it on, and chat_template_kwargs'
    own enable_thinking wins."""
    def prompt(**fields):
        return served_chat(url, MESSAGES, return_token_ids=True, **fields)[2]["prompt_token_ids"]

    off, plain = prompt(chat_template_kwargs={"enable_thinking": False}), prompt()
    assert off != plain
    assert prompt(reasoning_effort=row.value) == off
    assert prompt(reasoning_effort="high") == plain
    assert prompt(reasoning_effort=row.value, chat_template_kwargs={"enable_thinking": True}) == plain
    status, err = post(url, PATHS[kind], body(kind, reasoning_effort="lots"))
    assert (status, err["error"]["param"]) == (400, "reasoning_effort"), err


def check_chat_echo(url, kind, row):
    """vLLM's: the final message's content leads the answer when it is the answer's role (here
    the assistant's turn, continued); streamed, it is the first content chunk."""
    options = {**row.base}
    text, _, response = served_chat(url, CONTINUED, **options, echo=True)
    alone = served_chat(url, CONTINUED, **options)[0]
    assert text == "The sea is" + alone and response["choices"][0]["message"]["role"] == "assistant"
    status, events = post(url, PATHS[CHAT], body(CHAT, messages=CONTINUED, **options, echo=True, stream=True))
    contents = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    assert status == 200 and [c for c in contents if c][0] == "The sea is" and "".join(filter(None, contents)) == text
    # a final message of another role is not echoed (the answer is the assistant's)
    assert served_chat(url, MESSAGES, echo=True)[0] == served_chat(url, MESSAGES)[0]


def check_return_token_ids(url, kind, row):
    """vLLM's: the prompt's ids (chat: on the response; completions: on each choice) and each
    choice's generated ids, whole and streamed (the prompt's on the first chunk only)."""
    response = answer(url, kind, return_token_ids=True, max_tokens=6, ignore_eos=True)
    choice = response["choices"][0]
    prompt_ids = response["prompt_token_ids"] if kind == CHAT else choice["prompt_token_ids"]
    if kind == CHAT:
        status, counted = post(url, "/tokenize", {"model": MODEL, "messages": MESSAGES})
        assert status == 200 and prompt_ids == counted["tokens"]
    else:
        assert prompt_ids == PROMPT_IDS
    assert len(choice["token_ids"]) == response["usage"]["completion_tokens"] == 6
    plain = answer(url, kind, max_tokens=6, ignore_eos=True)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    status, events = post(url, PATHS[kind], body(kind, return_token_ids=True, max_tokens=6, ignore_eos=True,
                                                  stream=True))
    assert status == 200
    first = events[0] if kind == CHAT else events[0]["choices"][0]
    assert first["prompt_token_ids"] == prompt_ids
    later = events[1:] if kind == CHAT else [e["choices"][0] for e in events[1:]]
    assert all("prompt_token_ids" not in e for e in later)
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]


def check_tokens_as_token_ids(url, kind, row):
    """vLLM's: with logprobs, each token (and each alternative) named "token_id:N"; the ids are
    those return_token_ids gives."""
    logprobs = {"logprobs": True, "top_logprobs": 2} if kind == CHAT else {"logprobs": 2}
    response = answer(url, kind, return_tokens_as_token_ids=True, return_token_ids=True, **logprobs)
    choice = response["choices"][0]
    if kind == CHAT:
        tokens = [e["token"] for e in choice["logprobs"]["content"]]
        alternatives = [t["token"] for e in choice["logprobs"]["content"] for t in e["top_logprobs"]]
    else:
        tokens = choice["logprobs"]["tokens"]
        alternatives = [t for top in choice["logprobs"]["top_logprobs"] for t in top]
    assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]
    assert alternatives and all(re.fullmatch(r"token_id:\d+", t) for t in alternatives)


def check_truncate_prompt_tokens(url, kind, row):
    """vLLM's: the prompt's last k tokens only, as a request sending just those (completions:
    the ids; chat: the rendered prompt's tail, sent as ids)."""
    response = answer(url, kind, truncate_prompt_tokens=row.value, return_token_ids=True)
    tail = (response["prompt_token_ids"] if kind == CHAT else response["choices"][0]["prompt_token_ids"])
    assert response["usage"]["prompt_tokens"] == row.value == len(tail)
    full = answer(url, kind, return_token_ids=True)
    full_ids = full["prompt_token_ids"] if kind == CHAT else full["choices"][0]["prompt_token_ids"]
    assert tail == full_ids[-row.value:]
    same = answer(url, "completion", prompt=tail)
    assert outcome(response, kind)[0] == outcome(same, "completion")[0]
    for bad in (0, -2, 10 ** 7):  # above the longest prompt the server takes
        status, err = post(url, PATHS[kind], body(kind, truncate_prompt_tokens=bad))
        assert (status, err["error"]["param"]) == (400, "truncate_prompt_tokens"), (bad, err)
    # -1: as many as the server takes; this prompt is shorter, so all of it
    assert answer(url, kind, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(full_ids)


def check_cache_salt(url, kind, row):
    """vLLM's: a prompt's cached blocks are shared only with requests of the same salt (the
    cluster routes on them too, so a repeat lands on the worker holding them)."""
    import uuid

    long_prompt = {"prompt": "salted " * 40} if kind != CHAT else {"messages": [{"role": "user", "content": "salted " * 40}]}
    salt = f"{row.value}-{uuid.uuid4().hex}"

    def cached(**fields) -> int:
        usage = answer(url, kind, max_tokens=1, **long_prompt, **fields)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    cached(cache_salt=salt)  # the first: computes and caches its blocks under the salt
    assert cached(cache_salt=salt) > 0  # the same salt: a hit
    assert cached(cache_salt=salt + "-other") == 0  # another salt: none
    assert cached() == 0  # nor a request without one
    status, err = post(url, PATHS[kind], body(kind, cache_salt=""))
    assert (status, err["error"]["param"]) == (400, "cache_salt")


def check_priority(url, kind, row):
    """vLLM's: under the default scheduling policy (fcfs) only priority 0 is accepted; anything
    else is a 400 naming the field and the policy. (Ordering under engine.scheduling_policy
    priority: tests/integration/test_priority_scheduling.py.)"""
    assert answer(url, kind, priority=0)["choices"]
    for bad in (row.value, -1, 2**63, "1", 1.5):
        status, err = post(url, PATHS[kind], body(kind, priority=bad))
        assert (status, err["error"]["param"]) == (400, "priority"), (bad, err)
    status, err = post(url, PATHS[kind], body(kind, priority=row.value))
    assert "scheduling_policy" in err["error"]["message"], err


def check_n(url, kind, row):
    response = answer(url, kind, n=row.value, temperature=1.0, seed=7)
    assert [c["index"] for c in response["choices"]] == list(range(row.value))
    alone = [outcome(answer(url, kind, temperature=1.0, seed=7 + i), kind) for i in range(row.value)]
    assert [outcome({"choices": [c]}, kind) for c in response["choices"]] == alone  # seed + i


def check_best_of(url, kind, row):
    response = answer(url, kind, best_of=row.value, temperature=1.0, seed=7, ignore_eos=True)
    assert len(response["choices"]) == 1
    assert response["usage"]["completion_tokens"] == row.value * 8  # every sequence generated


def check_echo(url, kind, row):
    response = answer(url, kind, prompt="abc", echo=row.value)
    assert response["choices"][0]["text"].startswith("abc")
    assert response["choices"][0]["text"] == "abc" + answer(url, kind, prompt="abc")["choices"][0]["text"]


def check_prompt_logprobs(url, kind, row):
    response = answer(url, kind, prompt_logprobs=row.value)
    scores = response.get("prompt_logprobs") if kind == CHAT else response["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == response["usage"]["prompt_tokens"]
    assert all(len(s) >= 1 for s in scores[1:])


def check_structured(url, kind, row):
    """The output follows the constraint (the tiny random model says anything otherwise)."""
    response = answer(url, kind, max_tokens=40, **row.base, **{row.field: row.value})
    text = outcome(response, kind)[0]
    spec = row.value if row.field != "guided_decoding_backend" else row.base["guided_choice"]
    if row.field in ("guided_choice", "guided_decoding_backend") or (
            row.field == "structured_outputs" and "choice" in spec):
        choices = spec if isinstance(spec, list) else spec["choice"]
        assert text in choices, text
    elif row.field == "guided_regex":
        assert re.fullmatch(row.value, text), text
    elif row.field == "guided_grammar":
        assert text == "a", text
    else:  # JSON: response_format json_object, guided_json {"type": "object"}
        assert text.lstrip().startswith("{"), text
        assert text != outcome(answer(url, kind, max_tokens=40), kind)[0]


def check_tool_call(url, kind, row):
    """A required call of the one tool: the answer is a call of f, not prose."""
    response = answer(url, kind, max_tokens=64, **row.base, **{row.field: row.value})
    choice = response["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    if row.field == "parallel_tool_calls":  # one call: the grammar ends after it
        assert [c["function"]["name"] for c in calls] == ["f"], message
        return
    if calls:
        assert {c["function"]["name"] for c in calls} == {"f"}, message
    else:  # parallel calls allowed: the random model may list calls until max_tokens cuts the array
        assert choice["finish_reason"] == "length", choice
        assert message["content"].startswith('[{"name": "f"'), message


CHECKS = {
    "response_format": check_structured, "structured_outputs": check_structured,
    "guided_json": check_structured, "guided_regex": check_structured, "guided_choice": check_structured,
    "guided_grammar": check_structured, "guided_decoding_backend": check_structured,
    "tools": check_tool_call, "tool_choice": check_tool_call, "parallel_tool_calls": check_tool_call,
    "n": check_n, "best_of": check_best_of, "echo": check_echo, "prompt_logprobs": check_prompt_logprobs,
    ("echo", CHAT): check_chat_echo, "return_token_ids": check_return_token_ids,
    "return_tokens_as_token_ids": check_tokens_as_token_ids, "truncate_prompt_tokens": check_truncate_prompt_tokens,
    "cache_salt": check_cache_salt, "priority": check_priority, "add_generation_prompt": check_template_option,
    "continue_final_message": check_template_option, "chat_template_kwargs": check_template_option,
    "model": check_model, "max_tokens": check_max_tokens, "max_completion_tokens": check_max_tokens,
    "top_p": check_equals_greedy, "top_k": check_equals_greedy, "min_p": check_equals_greedy,
    "stream": check_stream, "stream_options": check_stream_options, "user": check_same_answer, "prompt_cache_key": check_same_answer, "add_special_tokens": check_same_answer, "documents": check_same_answer,
    "include_reasoning": check_same_answer, "reasoning_effort": check_reasoning_effort,
    "chat_template": check_untrusted_chat_template,
    "prompt": check_prompts, "messages": check_messages,
    ("logprobs", "completion"): check_completion_logprobs, ("logprobs", CHAT): check_chat_logprobs,
    "top_logprobs": check_chat_logprobs,
}


def check_for(field: str, kind: str):
    return CHECKS.get((field, kind)) or CHECKS[field]
