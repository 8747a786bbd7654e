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


def test_a_decode_step_loads_into_the_static_inputs_with_its_padding_and_placeholders():
    """DecodeCudaGraphs.load_step (here on the CPU, where the graphs themselves are not captured):
    one copy of the pinned mirror fills every static input of the graph's batch: the step's rows,
    padding rows that store nothing (slot -1) over a context of 1, and the placeholder tokens taken
    from the previous step's samples. The mirrors alternate, so the step after it finds its own
    values, not the first's."""
    import numpy as np
    import torch

    from kvmesh.worker.cuda_graphs import DecodeCudaGraphs
    from kvmesh.worker.step_broadcast import HostStep

    graphs = DecodeCudaGraphs(model=None, backend=None, kv_caches=[], max_batch_size=32, max_blocks_per_seq=6,
                              max_model_len=96, device=torch.device("cpu"))

    def step(n, width):
        return HostStep(input_ids=np.array([-1] * (n - 1) + [7], dtype=np.int64),
                        positions=np.arange(10, 10 + n, dtype=np.int64),
                        slot_mapping=np.arange(100, 100 + n, dtype=np.int64),
                        query_start_loc=np.arange(n + 1, dtype=np.int64), query_lens=[1] * n,
                        seq_lens=list(range(11, 11 + n)),
                        block_table=np.arange(n * width, dtype=np.int32).reshape(n, width),
                        logits_indices=list(range(n)), num_decode_tokens=n)

    previous = torch.tensor([50, 51, 52, 53, 54], dtype=torch.int64)
    # rows 0-3 wait for the previous step's samples 4, 3, 2, 1; row 4 has its token
    batch = graphs.load_step(step(5, 3), ([0, 1, 2, 3], [4, 3, 2, 1]), previous)
    assert batch == 8
    assert graphs.input_ids[:8].tolist() == [54, 53, 52, 51, 7, 0, 0, 0]
    assert graphs.positions[:5].tolist() == [10, 11, 12, 13, 14]
    assert graphs.slot_mapping[:8].tolist() == [100, 101, 102, 103, 104, -1, -1, -1]
    assert graphs.seq_lens[:8].tolist() == [11, 12, 13, 14, 15, 1, 1, 1]
    assert graphs.block_tables[:5, :3].tolist() == np.arange(15).reshape(5, 3).tolist()
    # the next step, from the other mirror: 17 rows (graph 32), no placeholder
    second = step(17, 6)
    second.input_ids[:] = np.arange(200, 217)
    assert graphs.load_step(second, None, None) == 32
    assert graphs.input_ids[:32].tolist() == list(range(200, 217)) + [0] * 15
    assert graphs.slot_mapping[16:18].tolist() == [116, -1] and graphs.seq_lens[16:18].tolist() == [27, 1]
    assert graphs.block_tables[:17].tolist() == np.arange(17 * 6).reshape(17, 6).tolist()
    assert graphs.next_mirror == 0
