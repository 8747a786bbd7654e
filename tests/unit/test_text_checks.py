"""Unpaired surrogates in a JSON body are found and named by their field path (regression: such a
prompt made the tokenizer raise TypeError, answered as a 500)."""

import json

from kvmesh.cluster.text_checks import lone_surrogate_path


def test_the_first_string_with_a_surrogate_is_named_by_its_path():
    body = json.loads('{"model": "m", "messages": [{"content": "ok"}, {"content": "b\\ud800"}]}')
    assert lone_surrogate_path(body) == "messages.1.content"
    assert lone_surrogate_path(json.loads('{"prompt": "\\udfff"}')) == "prompt"
    assert lone_surrogate_path(json.loads('{"\\ud800": 1}')) == "body"


def test_valid_text_including_paired_surrogates_and_controls_passes():
    body = json.loads('{"prompt": "emoji \\ud83d\\ude00 and \\u0000 \\u001f", "stop": ["a", 1, null]}')
    assert lone_surrogate_path(body) is None


def test_nesting_deeper_than_the_recursion_limit_is_walked():
    deep = inner = []
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    inner.append("\ud800")
    assert lone_surrogate_path(deep).endswith(".0")
