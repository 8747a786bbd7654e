"""One owner of detokenization: the engine process decodes every token a logprobs answer names
(sampled tokens, their alternatives, and with prompt_logprobs the prompt's tokens and theirs) and
sends the texts with the delta; the ingress looks them up and never decodes them itself."""

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.frontend import Frontend
from kvmesh.protocol import EngineRequest, TokenDelta
from kvmesh.serve_config import parse_config


def test_each_delta_carries_the_texts_of_the_tokens_its_logprobs_name():
    engine = LLM(model="random:tiny-qwen3", device="cpu").engine
    prompt = [5, 17, 99, 4, 250, 8]
    engine.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=3,
                                                                 prompt_logprobs=2, ignore_eos=True)))
    # in the same batch, a request that asked for no logprobs (the batch computes them for every row)
    engine.add_request(EngineRequest("plain", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
    deltas, plain = [], []
    while not (deltas and deltas[-1].finished and plain and plain[-1].finished):
        for d in engine.step():
            (deltas if d.request_id == "r" else plain).append(d)
    named = 0
    for d in deltas:
        ids = set(d.token_ids)
        for top in d.top_logprobs or []:
            ids.update(top)
        if d.prompt_logprobs is not None:
            ids.update(prompt)
            for top in d.prompt_logprobs.top:
                ids.update(top or ())
        if ids:
            assert d.token_texts is not None and ids <= set(d.token_texts)
            assert all(d.token_texts[t] == engine.tokenizer.decode([t]) for t in ids)
            named += len(ids)
    assert named > len(prompt)
    # without logprobs asked nothing is sent
    assert plain and all(d.token_texts is None for d in plain)


def test_merged_deltas_keep_every_text():
    a = TokenDelta("r", [1], "a", logprobs=[-0.1], token_texts={1: "a", 7: "x"})
    b = TokenDelta("r", [2], "b", logprobs=[-0.2], token_texts={2: "b"})
    assert a.followed_by(b).token_texts == {1: "a", 7: "x", 2: "b"}
    assert TokenDelta("r", [3], "c").followed_by(b).token_texts == {2: "b"}


def test_the_ingress_looks_texts_up_without_decoding():
    fe = Frontend(parse_config({"model": "random:tiny-llama"}), worker_handle=None)

    class NoDecoding:
        def decode(self, ids):
            raise AssertionError("the ingress decoded a token the engine had sent")

    real, fe.tokenizer = fe.tokenizer, NoDecoding()
    fe.learn_token_texts({5: " Paris", 6: "."})
    assert fe.decode_token(5) == " Paris" and fe.decode_token(6) == "."
    assert fe.token_text_misses == 0
    fe.tokenizer = real  # a token with no text sent is still answered, and counted
    assert fe.decode_token(9) == real.decode([9]) and fe.token_text_misses == 1


def test_a_merged_delta_keeps_the_worker_that_made_it():
    """gRPC's GenerateResponse.worker_id survives the merges of a slow reader's deltas."""
    a, b = TokenDelta("r", [1], "a", worker_id="w1"), TokenDelta("r", [2], "b")
    assert a.followed_by(b).worker_id == "w1"
    assert b.followed_by(TokenDelta("r", [3], "c", worker_id="w2")).worker_id == "w2"
