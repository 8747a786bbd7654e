"""Structured outputs on a reasoning model, as vLLM applies them (docs/SERVING.md "Reasoning
models"): on a live cluster with server.reasoning_parser deepseek_r1 and the default
structured_outputs_in_reasoning false, the grammar constrains only what follows the model's
</think>, and the whole answer when the prompt's own thinking block is closed. And `kvmesh client`
on that cluster: the thinking on stderr, the answer on stdout.

The random model writes </think> when logit_bias makes it the likeliest token, and never when the
bias forbids it; the regex holds the rest."""

import re
import subprocess
import sys

import pytest

from cluster_support import config_cluster
from reliability_support import http

pytestmark = pytest.mark.slow

MODEL = "random:tiny-qwen3"  # its byte tokenizer: <think> = 259, </think> = 260
END = 260
ASK = [{"role": "user", "content": "Name three letters."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = {"model": MODEL, "engine": {"device": "cpu"},
              "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1},
              "server": {"reasoning_parser": "deepseek_r1"}}
    with config_cluster(tmp_path_factory, config) as c:
        yield c


def message(cluster, **extra) -> dict:
    status, answer, _ = http(cluster.http_url + "/v1/chat/completions",
                             {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0,
                              "structured_outputs": {"regex": "[a-c]{4}"}, **extra})
    assert status == 200, answer
    return answer["choices"][0]["message"]


def test_the_grammar_constrains_only_what_follows_the_models_end_of_thinking(cluster):
    ended = message(cluster, logit_bias={str(END): 100})  # </think> first, then the regex
    assert ended["reasoning"] == "" and re.fullmatch("[a-c]{4}", ended["content"]), ended


def test_while_the_model_thinks_the_grammar_does_not_constrain_it(cluster):
    thinking = message(cluster, logit_bias={str(END): -100})  # the block never closes
    assert thinking["content"] is None, thinking
    assert not re.fullmatch("[a-c]*", thinking["reasoning"]), thinking  # 12 free tokens


def test_a_prompt_whose_thinking_block_is_closed_is_constrained_from_the_first_token(cluster):
    closed = message(cluster, chat_template_kwargs={"enable_thinking": False})
    assert closed["reasoning"] is None and re.fullmatch("[a-c]{4}", closed["content"]), closed


@pytest.mark.parametrize("flags", [[], ["--grpc"]], ids=["http", "grpc"])
def test_kvmesh_client_streams_the_thinking_to_stderr_and_the_answer_to_stdout(cluster, flags):
    """The same greedy answer as the chat API's: its reasoning on stderr as it streams (before the
    finish line), its content alone on stdout."""
    status, answer, _ = http(cluster.http_url + "/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                              "temperature": 0})
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message["reasoning"]  # deepseek_r1: the answer starts inside the block
    where = ["--grpc", "--target", cluster.grpc_target] if flags else ["--url", cluster.http_url + "/v1"]
    run = subprocess.run([sys.executable, "-m", "kvmesh.cli", "client", "hi", "--max-tokens", "8", *where],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == (message["content"] or "") + "\n"
    assert run.stderr.startswith(message["reasoning"] + "\n[finish_reason="), run.stderr
