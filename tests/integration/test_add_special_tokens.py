"""vLLM's add_special_tokens on a live cluster serving a checkpoint whose tokenizer adds a BOS, as
Llama 3's does (docs/SERVING.md "API fields"):

- /v1/completions tokenizes a text prompt with the BOS unless add_special_tokens is false, and
  answers as it does for the same ids sent as tokens; token-id prompts are taken as they are;
- /v1/chat/completions puts it before the rendered template only with add_special_tokens true;
- /tokenize counts as those endpoints do, with the same defaults; gRPC's field does the same.
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
              "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1}}
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
    answer = post(cluster, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, temperature=0,
                  return_token_ids=True, **extra)
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
