"""The batch sizes CUDA graphs are captured at (worker/cuda_graphs.py; capture itself runs in tests/gpu)."""

from kvmesh.worker.cuda_graphs import batch_size_ladder


def test_ladder_small_powers_then_every_16_up_to_the_largest():
    assert batch_size_ladder(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(1) == [1]


def test_every_batch_up_to_the_largest_has_a_graph_at_most_16_rows_larger():
    sizes = batch_size_ladder(100)
    for n in range(1, 101):
        padded = next(b for b in sizes if b >= n)
        assert padded - n < 16
