"""The schema walk at parse level (no Ray): every OpenAI / vLLM request field in
tests/api_field_table.py is implemented or refused with a 400 naming it, unknown fields are refused
by name, and each implemented sampling field changes what the engine generates."""

import pytest
from api_field_table import BOTH, CHAT, COMPLETION, ROWS, row_id, rows

from kvmesh import LLM
from kvmesh.cluster.api_fields import refused_fields
from kvmesh.cluster.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                            parse_request, sampling_params)

MODEL = "random:tiny-llama"
CLS = {CHAT: ChatCompletionRequest, COMPLETION: CompletionRequest}
PROMPT_IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


def body(kind: str, **fields) -> dict:
    base = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    if kind == CHAT:
        base["messages"] = [{"role": "user", "content": "Hello world"}]
    else:
        base["prompt"] = PROMPT_IDS
    return {**base, **fields}


@pytest.mark.parametrize("kind", BOTH)
def test_the_table_lists_every_field_the_server_knows_and_no_other(kind):
    known = set(CLS[kind].model_fields) | set(refused_fields(kind))
    in_table = {r.field for r in rows(kind)}
    assert known - in_table == set(), "fields with no row in the schema walk"
    assert in_table - known == set(), "fields of the schema the server would call unknown"


@pytest.mark.parametrize("row", [r for r in ROWS if r.outcome.startswith("refused")], ids=row_id)
def test_each_refused_field_is_a_400_naming_it(row):
    for kind in row.kinds:
        with pytest.raises(ApiError) as e:
            parse_request(body(kind, **{row.field: row.value}), CLS[kind])
        assert (e.value.status, e.value.param) == (400, row.field)
        assert row.field in e.value.message
        if row.field in refused_fields(kind):
            parse_request(body(kind, **{row.field: None}), CLS[kind])  # null asks for nothing


@pytest.mark.parametrize("kind", BOTH)
def test_unknown_fields_are_a_400_naming_them(kind):
    with pytest.raises(ApiError) as e:
        parse_request(body(kind, frobnicate=1), CLS[kind])
    assert (e.value.status, e.value.param) == (400, "frobnicate")
    assert "unknown field 'frobnicate'" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_request(body(kind, zeta=1, alpha=2), CLS[kind])
    assert e.value.param == "alpha" and "unknown fields 'alpha', 'zeta'" in e.value.message


def test_a_field_of_the_other_endpoint_is_unknown():
    with pytest.raises(ApiError) as e:
        parse_request(body(CHAT, prompt="x"), ChatCompletionRequest)
    assert e.value.param == "prompt"
    with pytest.raises(ApiError) as e:
        parse_request(body(COMPLETION, suffix=None, max_completion_tokens=3), CompletionRequest)
    assert e.value.param == "max_completion_tokens"


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu")


def generate(llm, kind, **fields):
    req = parse_request(body(kind, **fields), CLS[kind])
    params = sampling_params(req, 64)
    ids = (llm.apply_chat_template([{"role": "user", "content": "Hello world"}]) if kind == CHAT
           else PROMPT_IDS)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
    return out.token_ids, out.text, out.finish_reason, out.stop_reason


@pytest.mark.parametrize("row", [r for r in ROWS if r.outcome == "sampling"], ids=row_id)
def test_each_sampling_field_changes_the_output(llm, row):
    for kind in row.kinds:
        without = generate(llm, kind, **row.base)
        with_field = generate(llm, kind, **{**row.base, row.field: row.value})
        assert with_field != without


@pytest.mark.parametrize("options,param", [
    ({"include_usage": 1}, "stream_options.include_usage"),
    ({"usage": True}, "stream_options.usage"),
    ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
])
def test_bad_stream_options_name_the_option(options, param):
    with pytest.raises(ApiError) as e:
        parse_request(body(COMPLETION, stream=True, stream_options=options), CompletionRequest)
    assert e.value.param == param


def test_stream_options_need_a_stream():
    with pytest.raises(ApiError) as e:
        parse_request(body(COMPLETION, stream_options={"include_usage": True}), CompletionRequest)
    assert e.value.param == "stream_options" and "stream: true" in e.value.message


@pytest.mark.parametrize("bias,message", [({"A": 1}, "token ids"), ({"65": 101}, "[-100, 100]")])
def test_bad_logit_bias_names_the_field_and_the_limit(bias, message):
    req = parse_request(body(COMPLETION, logit_bias=bias), CompletionRequest)
    with pytest.raises(ApiError) as e:
        sampling_params(req, 64)
    assert e.value.param == "logit_bias" and message in e.value.message


def test_min_tokens_over_max_tokens_names_both():
    req = parse_request(body(COMPLETION, min_tokens=9), CompletionRequest)
    with pytest.raises(ApiError) as e:
        sampling_params(req, 64)
    assert e.value.param == "min_tokens" and "max_tokens (8)" in e.value.message


@pytest.mark.parametrize("kind,fields", [
    (CHAT, {"response_format": {"type": "text"}}), (CHAT, {"modalities": ["text"]}),
    (CHAT, {"store": False}), (CHAT, {"service_tier": "auto"}), (CHAT, {"tools": []}),
    (CHAT, {"add_generation_prompt": True}), (CHAT, {"n": 1}), (COMPLETION, {"echo": False}),
])
def test_no_op_values_of_refused_fields_are_accepted(kind, fields):
    parse_request(body(kind, **fields), CLS[kind])


@pytest.mark.parametrize("kind,name,value", [
    (kind, name, value) for kind in BOTH for name, refused in refused_fields(kind).items()
    for value in refused.no_op])
def test_every_no_op_value_the_table_names_is_accepted(kind, name, value):
    """api_fields.REFUSED's no-op values (e.g. function_call: "none") ask for nothing: accepted."""
    parse_request(body(kind, **{name: value}), CLS[kind])


@pytest.mark.parametrize("extra,param", [
    ({"nickname": "a"}, "messages.0.nickname"), ({"refusal": "no"}, "messages.0.refusal"),
    ({"annotations": [{"type": "url_citation"}]}, "messages.0.annotations")])
def test_a_message_key_outside_openais_message_types_or_with_a_value_is_a_400_naming_it(extra, param):
    with pytest.raises(ApiError) as e:
        parse_request(body(CHAT, messages=[{"role": "user", "content": "Hi", **extra}]), CLS[CHAT])
    assert e.value.status == 400 and e.value.param == param


def test_an_assistant_message_sent_back_with_empty_fields_is_accepted():
    """As another server returned it: refusal / audio / function_call null, annotations []."""
    reply = {"role": "assistant", "content": "Hello", "refusal": None, "audio": None,
             "function_call": None, "annotations": [], "name": "bot"}
    req = parse_request(body(CHAT, messages=[{"role": "user", "content": "Hi"}, reply,
                                             {"role": "user", "content": "Again"}]), CLS[CHAT])
    assert req.messages[1].name == "bot"


def test_best_of_with_stream_is_accepted_only_when_it_equals_n():
    """docs/SERVING.md: streaming cannot pick the best of more sequences than it returns."""
    parse_request(body(COMPLETION, n=2, best_of=2, stream=True), CLS[COMPLETION])
    with pytest.raises(ApiError) as e:
        parse_request(body(COMPLETION, n=2, best_of=3, stream=True), CLS[COMPLETION])
    assert e.value.param == "best_of"


def test_a_request_holds_at_most_64_prompts():
    from kvmesh.cluster.openai_request import MAX_PROMPTS_PER_REQUEST, prompts_of as _prompts

    assert MAX_PROMPTS_PER_REQUEST == 64
    req = parse_request(body(COMPLETION, prompt=["a"] * 65), CompletionRequest)
    with pytest.raises(ApiError) as e:
        _prompts(req, COMPLETION)
    assert e.value.param == "prompt" and "65 prompts in one request; the limit is 64" in e.value.message
    req = parse_request(body(COMPLETION, prompt=[[3], [1, 2]]), CompletionRequest)
    assert [(p.param, p.token_ids) for p in _prompts(req, COMPLETION)] == [
        ("prompt.0", [3]), ("prompt.1", [1, 2])]
