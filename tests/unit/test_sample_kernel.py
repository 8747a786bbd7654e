"""The fused sampling kernel (kvmesh.kernels.sample) on the CPU, under Triton's interpreter
(TRITON_INTERPRET=1, in a child process: the variable must be set before triton is imported). The
same kernel at full size on a GPU: tests/gpu/test_fused_sampler.py."""

import textwrap

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, math, torch
    from kvmesh.kernels.sample import sample_from_logits
    out = {}
    # greedy rows (inverse temperature 0): torch.argmax, the lowest id of a tie, across blocks
    torch.manual_seed(0)
    logits = torch.randn(4, 2100)
    logits[1, 7] = logits[1, 2090] = 50.0          # a tie: 7 wins
    logits[2, 2049] = 60.0                         # the maximum in the second block
    logits[3] = 1.0                                # every logit tied: id 0
    out["greedy"] = sample_from_logits(logits, torch.zeros(4), 0).tolist()
    out["greedy_chunks"] = sample_from_logits(logits, torch.zeros(4), 0, chunk=1024).tolist()
    out["argmax"] = torch.argmax(logits, dim=-1).tolist()
    out["bf16"] = sample_from_logits(logits.bfloat16(), torch.zeros(4), 0).tolist()
    out["bf16_argmax"] = torch.argmax(logits.bfloat16(), dim=-1).tolist()  # rounding can make ties
    # sampled rows: softmax(logit / T) over three ids in two blocks, the rest ruled out
    rows, t = 150, 0.7
    logits = torch.full((rows, 2100), -1e4)
    logits[:, 3], logits[:, 1500], logits[:, 2099] = 1.0, 0.5, 0.0
    a = sample_from_logits(logits, torch.full((rows,), 1 / t), 1234, chunk=1024).tolist()
    out["counts"] = [a.count(i) for i in (3, 1500, 2099)]
    out["expected"] = (torch.softmax(torch.tensor([1.0, 0.5, 0.0]) / t, 0) * rows).tolist()
    out["same_seed"] = sample_from_logits(logits[:32], torch.full((32,), 1 / t), 1234, chunk=1024).tolist() == a[:32]
    out["other_seed"] = sample_from_logits(logits[:32], torch.full((32,), 1 / t), 99, chunk=1024).tolist() != a[:32]
    # chunks of 2,048 ids read 1,024 a turn: ids in different turns and chunks, each at its mass
    rows, ids = 240, (100, 700, 1500, 2500, 4999)
    logits = torch.full((rows, 5000), -1e4)
    for i, v in zip(ids, (1.0, 0.8, 0.6, 0.4, 0.2)):
        logits[:, i] = v
    b = sample_from_logits(logits, torch.full((rows,), 1 / t), 77, chunk=2048).tolist()
    out["wide_counts"] = [b.count(i) for i in ids]
    out["wide_expected"] = (torch.softmax(torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2]) / t, 0) * rows).tolist()
    try:
        sample_from_logits(logits, torch.zeros(rows), 0, chunk=1500)
    except ValueError as e:
        out["bad_chunk"] = str(e)
    # all the mass on one id, the last of its chunk, the rest -inf (no nan from -inf - -inf), and
    # the same with the id alone in the last chunk
    lone = torch.full((64, 3000), float("-inf")); lone[:32, 2047] = 3.0; lone[32:, 2999] = -5.0
    out["lone"] = sample_from_logits(lone, torch.full((64,), 1 / t), 5, chunk=1024).tolist()
    # a greedy row and a sampled row in one launch
    mixed = torch.full((2, 2100), -1e4); mixed[:, 5], mixed[:, 6] = 1.0, 0.9
    out["mixed_greedy"] = sample_from_logits(mixed, torch.tensor([0.0, 1.0]), 7).tolist()[0]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
    return run_interpreted(SCRIPT)


def test_greedy_rows_are_torch_argmax_with_the_lowest_id_on_ties(result):
    assert result["greedy"] == result["greedy_chunks"] == result["argmax"]  # one chunk or three
    assert result["greedy"][1:] == [7, 2049, 0]
    assert result["bf16"] == result["bf16_argmax"]  # read in the logits' own dtype
    assert result["mixed_greedy"] == 5


def test_sampled_rows_follow_softmax_over_temperature(result):
    counts, expected = result["counts"], result["expected"]
    assert sum(counts) == 150  # nothing outside the three ids with mass
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001


def test_ids_in_every_turn_and_chunk_are_drawn_at_their_mass(result):
    counts, expected = result["wide_counts"], result["wide_expected"]
    assert sum(counts) == 240
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom, p = 0.001


def test_a_chunk_that_is_not_a_multiple_of_1024_ids_is_refused(result):
    assert result["bad_chunk"] == "chunk must be a positive multiple of 1024, got 1500"


def test_the_seed_picks_the_stream(result):
    assert result["same_seed"] and result["other_seed"]


def test_a_row_with_one_id_of_mass_always_picks_it(result):
    assert result["lone"] == [2047] * 32 + [2999] * 32
