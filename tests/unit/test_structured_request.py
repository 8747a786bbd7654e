"""The structured-output fields of a request read into one StructuredOutputs (no Ray): each
spelling, the field an error names, and at most one constraint per request."""

import pytest

from kvmesh.cluster.openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvmesh.cluster.structured_request import parse_structured

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def test_text_and_no_field_mean_no_constraint():
    assert parse_structured(chat()) is None
    assert parse_structured(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "json", "response_format.json_schema.schema"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, "json", "structured_outputs.json"),
    ({"guided_json": {"type": "integer"}}, "json", "guided_json"),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", "guided_grammar"),
])
def test_each_spelling(fields, kind, param):
    structured = parse_structured(chat(**fields))
    assert structured.spec.kind == kind and structured.param == param


def test_a_schema_given_as_text_or_object_is_the_same_spec():
    as_text = parse_structured(chat(guided_json='{"type": "object", "properties": {"b": {}, "a": {}}}'))
    as_object = parse_structured(chat(guided_json={"type": "object", "properties": {"b": {}, "a": {}}}))
    assert as_text.spec.key == as_object.spec.key


def test_completions_take_the_same_fields():
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "guided_regex": "[0-9]+"})
    assert parse_structured(req).spec.regex == "[0-9]+"


def test_two_constraints_are_refused_naming_the_second():
    with pytest.raises(ApiError) as e:
        parse_structured(chat(response_format={"type": "json_object"}, guided_regex="a"))
    assert e.value.status == 400 and e.value.param == "guided_regex"
