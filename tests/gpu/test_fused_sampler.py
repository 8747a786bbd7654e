"""The sampler's one-launch path (kvmesh.kernels.sample, taken for temperature-only batches on a GPU)
against its general path and against the distribution it must sample, at the real vocabulary size."""

import pytest
import torch

from kvmesh.sampling_params import SamplingParams
from kvmesh.worker.sampler import Sampler

pytestmark = pytest.mark.gpu
VOCAB = 151_936


class Row:  # what the sampler reads of an engine Request
    def __init__(self, params: SamplingParams):
        self.sampling_params, self.generator, self.grammar = params, None, None
        self.prompt_token_ids, self.output_token_ids = [], []


def sampler(fused: bool) -> Sampler:
    s = Sampler(torch.device("cuda"), seed=0)
    s.fused = fused
    return s


def test_greedy_batches_equal_the_general_path():
    torch.manual_seed(0)
    logits = torch.randn(256, VOCAB, device="cuda", dtype=torch.bfloat16)
    logits[3, 17] = logits[3, 150_000] = 30.0  # a tie: the lowest id, as torch.argmax
    rows = [Row(SamplingParams(temperature=0.0, max_tokens=8)) for _ in range(256)]
    fused = sampler(True).sample(logits, rows).token_ids
    assert fused == sampler(False).sample(logits, rows).token_ids
    assert fused[3] == 17


def test_sampled_rows_follow_softmax_over_temperature():
    torch.manual_seed(1)
    ids = torch.randperm(VOCAB)[:16].cuda()  # 16 ids with mass, spread over the vocabulary
    base = torch.randn(16, device="cuda") * 1.5
    rows, t = 8192, 0.6
    logits = torch.full((rows, VOCAB), -30.0, device="cuda", dtype=torch.bfloat16)
    logits[:, ids] = base.bfloat16()
    expected = torch.softmax(base.bfloat16().float() / t, 0) * rows
    reqs = [Row(SamplingParams(temperature=t, max_tokens=8)) for _ in range(rows)]
    for fused in (True, False):
        tokens = torch.tensor(sampler(fused).sample(logits, reqs).token_ids, device="cuda")
        counts = (tokens.unsqueeze(1) == ids.unsqueeze(0)).sum(0).float()
        assert counts.sum().item() == rows  # -30 / 0.6 leaves the rest of the vocabulary ~e^-50 behind
        chi2 = (((counts - expected) ** 2) / expected).sum().item()
        assert chi2 < 37.7, (fused, chi2)  # chi-square, 15 degrees of freedom, p = 0.001


def test_the_general_path_keeps_what_the_kernel_does_not_do():
    """top-p, logprobs and per-request seeds go the general way: a seeded request's tokens do not
    depend on the fused path being there."""
    torch.manual_seed(2)
    logits = torch.randn(8, VOCAB, device="cuda", dtype=torch.bfloat16)
    out = {}
    for fused in (True, False):
        rows = [Row(SamplingParams(temperature=0.8, max_tokens=8, seed=5)) for _ in range(8)]
        for r in rows:
            r.generator = torch.Generator(device="cuda").manual_seed(5)
        out[fused] = sampler(fused).sample(logits, rows).token_ids
    assert out[True] == out[False]
    rows = [Row(SamplingParams(temperature=0.8, max_tokens=8, logprobs=2)) for _ in range(8)]
    result = sampler(True).sample(logits, rows)
    assert result.logprobs is not None and len(result.top_logprobs[0]) == 2


def test_the_pick_kernel_compiles_one_form_whatever_the_seed():
    """A new seed each step: one compiled form serves them all (Triton specializes integer arguments
    on divisibility by 16 unless told not to, and would compile again inside a run). Counted from
    this test's first call: earlier tests in the process may have compiled forms of other shapes
    (a whole tests/gpu run on an H100, s38: 2 before, 2 after)."""
    from kvmesh.kernels.sample import _sample_pick_kernel, sample_from_logits

    logits = torch.randn(4, VOCAB, device="cuda", dtype=torch.bfloat16)
    inv_temperature = torch.full((4,), 1 / 0.6, device="cuda")

    def forms() -> int:
        return sum(len(cache[0]) for cache in _sample_pick_kernel.device_caches.values())

    sample_from_logits(logits, inv_temperature, 12345)
    before = forms()
    for seed in (16, 17, 32, 1, 2**30):
        sample_from_logits(logits, inv_temperature, seed)
    torch.cuda.synchronize()
    assert forms() == before, (before, forms())
