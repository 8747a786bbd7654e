"""The follower ranks of a tensor-parallel engine: processes 1..N-1, started by rank 0's Engine.

Each one joins the group (through a file: worker/tensor_parallel.py init_group), builds its shard of the model from the full
checkpoint, sizes its KV pool with the others, builds a ModelRunner (capturing its CUDA graphs in
step with rank 0's) and then runs every step rank 0 broadcasts until told to stop. The collectives
of start-up happen in the same order on every rank: group, KV sizing, graph capture.

Processes are started with the `spawn` method (CUDA cannot be used in a forked child) and as
daemons, so they end with the process of rank 0 when it exits; a follower also exits within a second
of rank 0's process dying without exiting (a SIGKILL), which daemons alone do not cover. A follower
that fails logs its traceback and exits, which ends rank 0's next collective with an error (or its
timeout, tensor_parallel.COLLECTIVE_TIMEOUT).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time

import torch

from kvmesh.config import EngineConfig

logger = logging.getLogger("kvmesh.engine")


class Followers:
    def __init__(self, config: EngineConfig, rendezvous: str, num_threads: int):
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(target=follower_main, args=(config, rank, rendezvous, num_threads),
                            name=f"kvmesh-tp-rank{rank}", daemon=True)
            for rank in range(1, config.tensor_parallel_size)]
        for process in self.processes:
            process.start()

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the followers to exit (after rank 0 broadcast stop); kill the ones that do not."""
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("tensor-parallel follower %s did not stop; killing it", process.name)
                process.kill()
                process.join(timeout_s)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)


def follower_main(config: EngineConfig, rank: int, rendezvous: str, num_threads: int) -> None:
    from kvmesh.worker.kv_sizing import num_kv_blocks
    from kvmesh.worker.kv_cache import kv_cache_torch_dtype
    from kvmesh.worker.model_builder import build_model, resolve_device_dtype
    from kvmesh.worker.model_runner import ModelRunner
    from kvmesh.worker.tensor_parallel import destroy_group, init_group, rank_device

    _exit_with_parent(os.getppid())
    torch.set_num_threads(num_threads)
    device, dtype = resolve_device_dtype(config.device, config.dtype)
    device = rank_device(device, rank)
    try:
        tp = init_group(rank, config.tensor_parallel_size, rendezvous, device)
        loaded = build_model(config.model, device, dtype, config.seed, tp=tp, quantization=config.quantization)
        max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                            loaded.config.max_position_embeddings)
        blocks = num_kv_blocks(config, loaded.config, device, kv_cache_torch_dtype(config.kv_cache_dtype, dtype), tp)
        runner = ModelRunner(loaded.model, loaded.config, blocks, config.block_size, device, dtype,
                             config.attention_backend, config.seed, max_model_len,
                             enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs, tp=tp,
                             kv_cache_dtype=config.kv_cache_dtype,
                             max_num_batched_tokens=config.max_num_batched_tokens)
        runner.follow()
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        raise
    finally:
        destroy_group()


def _exit_with_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Exit when rank 0's process is gone (this process is then re-parented). The main thread may
    be blocked in a collective that never ends; collectives release the GIL, so this thread runs."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="kvmesh-tp-parent-watch", daemon=True).start()
