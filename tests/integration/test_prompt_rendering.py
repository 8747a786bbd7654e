"""How prompts become tokens, on a live cluster serving a checkpoint whose tokenizer adds a BOS as
Llama 3's does, with server.trust_request_chat_template on (docs/SERVING.md "API fields"):

vLLM's add_special_tokens:
- /v1/completions tokenizes a text prompt with the BOS unless add_special_tokens is false, and
  answers as it does for the same ids sent as tokens; token-id prompts are taken as they are;
- /v1/chat/completions puts it before the rendered template only with add_special_tokens true;
- /tokenize counts as those endpoints do, with the same defaults; gRPC's field does the same.

vLLM's chat_template and documents: a request's own Jinja template renders its messages (and the
documents it is given) instead of the model's, content still tokenized as text; a template that
fails, changes content as it renders it, or is longer than the limit is a 400 naming it. (A
server without the trust setting refuses chat_template: the schema walk, api_field_table.py.)
"""

import pytest

from bos_checkpoint import BOS, save_bos_checkpoint
from cluster_support import config_cluster
from kvmesh.cluster.client import grpc_stream
from reliability_support import http

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = str(save_bos_checkpoint(tmp_path_factory.mktemp("bos")))
    config = {"model": path, "engine": {"device": "cpu"},
              "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1},
              "server": {"trust_request_chat_template": True}}
    with config_cluster(tmp_path_factory, config) as c:
        c.model = path
        yield c


def post(cluster, route: str, **body) -> dict:
    status, answer, _ = http(cluster.http_url + route, {"model": cluster.model, **body})
    assert status == 200, answer
    return answer


def completion(cluster, prompt, **extra) -> dict:
    return post(cluster, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0,
                return_token_ids=True, **extra)


def chat_prompt_ids(cluster, **extra) -> list[int]:
    answer = post(cluster, "/v1/chat/completions", **{"messages": MESSAGES, **extra}, max_tokens=2,
                  temperature=0, return_token_ids=True)
    return answer["prompt_token_ids"]


def test_a_completion_prompt_gets_the_bos_unless_asked_not_to(cluster):
    default = completion(cluster, "hi")
    assert default["choices"][0]["prompt_token_ids"] == [BOS, *b"hi"]
    assert default["usage"]["prompt_tokens"] == 3
    as_ids = completion(cluster, [BOS, *b"hi"])
    assert as_ids["choices"][0]["text"] == default["choices"][0]["text"]
    without = completion(cluster, "hi", add_special_tokens=False)
    assert without["choices"][0]["prompt_token_ids"] == list(b"hi")
    ids = completion(cluster, list(b"hi"), add_special_tokens=True)  # token ids: as they are
    assert ids["choices"][0]["prompt_token_ids"] == list(b"hi")


def test_a_chat_gets_the_bos_only_when_asked(cluster):
    plain = chat_prompt_ids(cluster)
    assert plain[0] != BOS
    assert chat_prompt_ids(cluster, add_special_tokens=True) == [BOS, *plain]


def test_tokenize_counts_as_the_endpoints_with_their_defaults(cluster):
    assert post(cluster, "/tokenize", prompt="hi")["tokens"] == [BOS, *b"hi"]
    assert post(cluster, "/tokenize", prompt="hi", add_special_tokens=False)["tokens"] == list(b"hi")
    plain = post(cluster, "/tokenize", messages=MESSAGES)["tokens"]
    assert plain == chat_prompt_ids(cluster)
    assert post(cluster, "/tokenize", messages=MESSAGES, add_special_tokens=True)["tokens"] == [BOS, *plain]


def prompt_tokens(cluster, **fields) -> int:
    (*_, last) = grpc_stream(cluster.grpc_target, max_tokens=2, temperature=0, timeout_s=60, **fields)
    return last.usage.prompt_tokens


def test_grpc_add_special_tokens_has_the_same_defaults(cluster):
    assert prompt_tokens(cluster, prompt="hi") == 3
    assert prompt_tokens(cluster, prompt="hi", add_special_tokens=False) == 2
    plain = prompt_tokens(cluster, messages=MESSAGES)
    assert plain == len(chat_prompt_ids(cluster))
    assert prompt_tokens(cluster, messages=MESSAGES, add_special_tokens=True) == plain + 1


ROLES_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
RAG_TEMPLATE = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")


def refused(cluster, route: str, **body) -> dict:
    status, answer, _ = http(cluster.http_url + route, {"model": cluster.model, **body})
    assert status == 400, answer
    return answer["error"]


def test_a_request_s_chat_template_renders_its_messages(cluster):
    messages = [{"role": "user", "content": "hi <|im_start|>system"}]
    expected = list(b"<user>hi <|im_start|>system")  # content stays text: no control token
    assert post(cluster, "/tokenize", messages=messages, chat_template=ROLES_TEMPLATE)["tokens"] == expected
    assert chat_prompt_ids(cluster, messages=messages, chat_template=ROLES_TEMPLATE) == expected
    documents = [{"title": "t", "text": "x"}]
    assert chat_prompt_ids(cluster, chat_template=RAG_TEMPLATE, documents=documents) == list(b"[t: x]hi")
    assert post(cluster, "/tokenize", messages=MESSAGES, chat_template=RAG_TEMPLATE,
                documents=documents)["tokens"] == list(b"[t: x]hi")


@pytest.mark.parametrize("template,why", [
    ("{% for m in messages %}{{ m.content | upper }}{% endfor %}", "changes message content"),
    ("{{ raise_exception('no chat here') }}", "no chat here"),
    ("{% for m in messages %}", "chat template failed"),  # not a whole template
    ("x" * 65537, "65536"),
])
def test_a_chat_template_that_cannot_render_content_as_it_is_is_refused_by_name(cluster, template, why):
    for route, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        error = refused(cluster, route, messages=MESSAGES, chat_template=template, **extra)
        assert error["param"] == "chat_template" and why in error["message"], error


def test_more_documents_than_the_limit_are_refused_by_name(cluster):
    error = refused(cluster, "/v1/chat/completions", messages=MESSAGES, max_tokens=2,
                    documents=[{"title": "t", "text": "x"}] * 257)
    assert error["param"] == "documents" and "256" in error["message"], error


def test_grpc_takes_the_chat_template_and_documents_as_http_does(cluster):
    import json

    import grpc

    assert prompt_tokens(cluster, messages=MESSAGES, chat_template=ROLES_TEMPLATE) == len(b"<user>hi")
    documents = json.dumps([{"title": "t", "text": "x"}])
    assert prompt_tokens(cluster, messages=MESSAGES, chat_template=RAG_TEMPLATE,
                         documents=documents) == len(b"[t: x]hi")
    for fields, param in (({"documents": "{not json"}, "documents"),
                          ({"documents": json.dumps([{"t": 1}])}, "documents"),
                          ({"documents": json.dumps([{}] * 257)}, "documents"),
                          ({"chat_template": "x" * 65537}, "chat_template"),
                          ({"chat_template": "{{ raise_exception('no') }}"}, "chat_template")):
        with pytest.raises(grpc.RpcError) as e:
            prompt_tokens(cluster, messages=MESSAGES, **fields)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(param)
