"""vLLM's allowed_token_ids and bad_words on the GPU, per attention backend (with its CUDA graphs, the
GPU default): the masks are torch ops on the sampler's logits (worker/sampler.py
constrain_logits, worker/bad_words.py), which keep a masked row off the fused Triton
sampler.

1. allowed_token_ids, greedy and seeded at temperature 1.0, in a batch beside unmasked rows: every
   masked row's token is allowed, and the unmasked rows' greedy tokens equal those of a run of the
   same batch in which no row is masked (same prompts and shapes: bf16 logits are not promised the
   same bits across batch shapes, docs/SERVING.md, and random weights give exact ties often).
2. bad_words taken from what the unmasked greedy (and seeded) run produced, of one, two and three
   tokens (the byte tokenizer: a lowercase letter is one token, and a logit_bias keeps every row on
   lowercase letters): no output contains a banned sequence, and each masked row equals the
   unmasked run's up to the first token that completed a bad word there, then differs; a row
   without bad_words is unchanged.
3. The masks on fixed logits: CUDA's masked logits equal the CPU's (-inf where masked, the rest
   bit for bit), and the CUDA Sampler's greedy tokens are the masked argmax.
"""

import gc
import importlib.util

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.worker.attention.registry import BACKENDS as REGISTRY
from kvmesh.worker.attention.registry import backend_spec, block_size_for
from kvmesh.worker.bad_words import bad_word_token_ids
from kvmesh.worker.sampler import Sampler, constrain_logits

pytestmark = pytest.mark.gpu

MODEL = "random:qwen3-0.6b"  # byte tokenizer: ids 0-255 are bytes ("a" is 97)
PROMPTS = [[(17 * i + 3 * j) % 10000 for j in range(n)] for i, n in enumerate((5, 77, 300, 21))]
BACKENDS = list(REGISTRY)  # every registered backend (the torch one too), as test_parallel_sampling_gpu
MAX_TOKENS = 32
ALLOWED = [35, 1000, 4242, 77777, 150000]
LETTERS = {t: 100.0 for t in range(ord("a"), ord("z") + 1)}  # logit_bias: the output is lowercase letters


def make_llm(backend: str) -> LLM:
    library = backend_spec(backend).library
    if library is not None and importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed here")
    # Without the prefix cache: each run of a prompt computes all of it, with the same GEMM shapes
    # as the run it is compared with (test_parallel_sampling_gpu says why).
    return LLM(model=MODEL, device="cuda", attention_backend=backend,
               block_size=block_size_for(backend), kv_cache_memory_bytes=2 << 30,
               max_model_len=2048, max_num_seqs=16, enable_prefix_caching=False)


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request):
    # one engine per backend for both engine tests; pytest drops the previous backend's only after
    # its teardown, so it is collected here, before the next is built
    gc.collect()
    torch.cuda.empty_cache()
    return make_llm(request.param)


def generate(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    return [o.token_ids for o in outs]


def test_only_allowed_tokens_and_the_other_rows_unchanged(llm):
    def params(allowed, seed=None):
        return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0 if seed is None else 1.0,
                              seed=seed, allowed_token_ids=allowed)

    # rows 0 and 2 masked (greedy, seeded); rows 1 and 3 not. The seeded row keeps both runs on the
    # sampler's general path (a per-request seed is never fused).
    masked = generate(llm, PROMPTS, [params(ALLOWED), params(None), params(ALLOWED, seed=7), params(None)])
    plain = generate(llm, PROMPTS, [params(None), params(None), params(None, seed=7), params(None)])
    for row in (0, 2):
        assert set(masked[row]) <= set(ALLOWED), (row, masked[row])
        assert not set(plain[row]) <= set(ALLOWED), "the mask changed nothing"
    assert len(set(masked[2])) > 1, "temperature 1.0 samples among the allowed"
    assert masked[1] == plain[1] and masked[3] == plain[3], "an unmasked row of the batch changed"


def completions(tokens: list[int], word: list[int]) -> list[int]:
    """The positions where `tokens` completes `word` (the index of its last token)."""
    n = len(word)
    return [i for i in range(n - 1, len(tokens)) if tokens[i - n + 1:i + 1] == word]


def test_bad_words_are_never_completed_and_change_the_output_where_they_would_be(llm):
    def params(bad_words=None, seed=None):
        return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=LETTERS,
                              temperature=0.0 if seed is None else 1.0, seed=seed, bad_words=bad_words)

    prompts = PROMPTS + PROMPTS[:1]  # row 4: prompt 0 again, sampled
    plain = generate(llm, prompts, [params(), params(), params(), params(), params(seed=5)])
    assert all(ord("a") <= t <= ord("z") for out in plain for t in out), plain
    words = [[plain[0][MAX_TOKENS // 2:MAX_TOKENS // 2 + 1]],  # one token
             [plain[1][8:10]],  # two
             [plain[2][8:11]],  # three
             None,  # row 3: no bad_words
             [plain[4][3:4], plain[4][10:12]]]  # sampled: one and two tokens
    text = [None if w is None else ["".join(map(chr, ids)) for ids in w] for w in words]
    for row_words, row_text in zip(words, text):  # the engine bans exactly these token sequences
        if row_words is not None:
            assert bad_word_token_ids(llm.tokenizer, row_text) == row_words
    masked = generate(llm, prompts, [params(text[0]), params(text[1]), params(text[2]), params(),
                                     params(text[4], seed=5)])
    assert masked[3] == plain[3], "a row without bad_words changed"
    for row in (0, 1, 2, 4):
        out, ref = masked[row], plain[row]
        for word in words[row]:
            assert not completions(out, word), (row, word, out)
        # Up to the first bad word the unmasked run completed, masking a token it did not pick
        # changes nothing (for the seeded row too: the same draws, and a race among the rest);
        # there the banned token gives way to another.
        first = min(completions(ref, word)[0] for word in words[row])
        assert out[:first] == ref[:first], (row, first, out, ref)
        assert out[first] != ref[first], (row, first, out, ref)


class Row:
    """What the sampler reads of an engine Request."""

    def __init__(self, params: SamplingParams, output_token_ids=(), bad_word_ids=()):
        self.sampling_params, self.output_token_ids = params, list(output_token_ids)
        self.bad_word_ids, self.prompt_token_ids = [list(w) for w in bad_word_ids], [1, 2, 3]


VOCAB = 4096
BAD = [[5], [7, 9], [1, 2, 11], [20, 21]]
WORDS = ["w"]  # the sampler routes on bad_words being set; the ids are the engine's (Row.bad_word_ids)
# (row, its finite columns), every row greedy; each masked row has a logit of 30 on a column its
# mask removes (PEAKS)
ROWS = [
    (Row(SamplingParams(temperature=0.0)), set(range(VOCAB))),
    (Row(SamplingParams(temperature=0.0, allowed_token_ids=[3, 17, 4000, 4095, 5000])),  # 5000: beyond
     {3, 17, 4000, 4095}),
    (Row(SamplingParams(temperature=0.0, bad_words=WORDS), [4, 7], BAD), set(range(VOCAB)) - {5, 9}),
    (Row(SamplingParams(temperature=0.0, bad_words=WORDS), [7, 1, 2], BAD), set(range(VOCAB)) - {5, 11}),
    (Row(SamplingParams(temperature=0.0, allowed_token_ids=[5, 9, 20, 21, 22], bad_words=WORDS,
                        logit_bias={9: 1.5, 30: 2.0}), [20], BAD), {9, 20, 22}),
    (Row(SamplingParams(temperature=0.0, bad_words=WORDS), [], BAD), set(range(VOCAB)) - {5}),
]
PEAKS = [None, 30, 9, 11, 21, 5]  # the column each row would pick unmasked


def fixed_logits() -> torch.Tensor:
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(0))
    for row, peak in enumerate(PEAKS):
        if peak is not None:
            logits[row, peak] = 30.0
    return logits


def test_gpu_masked_logits_equal_the_cpu_ones():
    rows = [row for row, _ in ROWS]
    logits = fixed_logits()
    on_cpu = constrain_logits(logits.clone(), rows, eos_token_ids=())
    on_gpu = constrain_logits(logits.cuda(), rows, eos_token_ids=()).cpu()
    expected = torch.ones(len(ROWS), VOCAB, dtype=torch.bool)
    for i, (_, finite) in enumerate(ROWS):
        expected[i, sorted(finite)] = False
    assert torch.equal(torch.isneginf(on_cpu), expected)
    assert torch.equal(torch.isneginf(on_gpu), expected)
    assert torch.equal(on_gpu[~expected].view(torch.int32), on_cpu[~expected].view(torch.int32))
    biased = logits.clone()
    biased[4, 9] += 1.5
    biased[4, 30] += 2.0  # masked anyway (not allowed)
    assert torch.equal(on_cpu[~expected].view(torch.int32), biased[~expected].view(torch.int32))


def test_gpu_sampler_picks_the_masked_argmax():
    # On CUDA a batch of greedy rows goes to the fused kernel unless a row asks for more: a masked
    # row skipped there would pick its peak.
    rows = [row for row, _ in ROWS]
    logits = fixed_logits()
    expected = constrain_logits(logits.clone(), rows, eos_token_ids=()).argmax(dim=-1).tolist()
    gpu = Sampler(torch.device("cuda")).sample(logits.cuda(), rows).token_ids
    cpu = Sampler(torch.device("cpu")).sample(logits.clone(), rows).token_ids
    assert gpu == cpu == expected
    assert all(token in finite for token, (_, finite) in zip(gpu, ROWS))
    assert gpu[0] == int(logits[0].argmax())
