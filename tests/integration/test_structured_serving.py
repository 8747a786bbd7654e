"""Structured outputs and tool calls end to end: `kvmesh serve` of the default model (SmolLM2) on
the CPU, reached with the official openai client over HTTP on 127.0.0.1.

One cluster for the module (starting one is the expensive part): add cases here.
"""

import json
import re

import jsonschema
import pytest

from kvmesh.cluster.local import LocalCluster
from test_cluster_serving import post

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer"},
                       "capital": {"type": "boolean"}},
        "required": ["city", "population", "capital"], "additionalProperties": False}
ASK_CITY = [{"role": "user", "content": "Give the city, population and whether it is a capital, "
                                        "for Paris, as JSON."}]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(["--replicas", "1", "--device", "cpu", "--model", MODEL]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0)


# ---- structured outputs ------------------------------------------------------------------------

def test_response_format_json_schema_is_parsed_and_schema_valid(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=80, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_streamed_json_schema_output_is_schema_valid(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=80, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_response_format_json_object_gives_an_object(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Answer in JSON: what is the capital of France?"}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_structured_outputs_choice_gives_one_of_the_choices(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "Is Paris the capital of Italy?"}],
        extra_body={"structured_outputs": {"choice": ["YES", "NO"]}})
    assert r.choices[0].message.content in ("YES", "NO")


def test_older_guided_regex_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="My phone number is ", max_tokens=20,
                                  temperature=0.7, seed=1,
                                  extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text)


STRUCTURED_ERRORS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": {"type": 7}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize("fields,param", STRUCTURED_ERRORS, ids=[p for _, p in STRUCTURED_ERRORS])
def test_a_bad_constraint_is_a_400_naming_the_field(cluster, fields, param):
    code, err, _ = post(cluster, "/v1/chat/completions",
                        {"model": MODEL, "messages": ASK_CITY, "max_tokens": 4, **fields})
    assert code == 400, err
    assert err["error"]["param"] == param
