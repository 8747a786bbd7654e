"""The worker deployment: one Serve replica = one Ray actor that owns one GPU (or CPUs in tests)
and runs one Engine in a child process (engine_process.py; `replicas.engine_process: false` runs it on a
thread of the replica instead): the same EngineCore loop (engine_core.py) behind either transport,
driven by an EngineLoop (engine_loop.py).

`generate(RoutedRequest)` is an async generator of TokenDeltas; when its caller goes away (client
disconnect, cancel) the generator is closed and the request is aborted on the engine, freeing its
KV blocks. A publisher task sends the engine's numbered KV event batches and the worker's load to
the KV event hub, which every router copy reads. Custom metrics also go to Serve's autoscaling
metrics.

Health is the engine's, not the actor's (a frozen engine child leaves the actor's event loop
running): when the engine dies, the health check fails (Serve replaces the replica), the load report
says unhealthy at once (/health and every router copy drop the worker), and each request it held or
is sent afterwards ends in EngineUnavailable, which the ingress retries on another worker while the
client has seen no token. An engine that has requests and finishes no step for
`replicas.engine_stall_timeout_s` is reported `stalled` (routers rank it last, so it drains) until
it steps again; past KVMESH_STALL_TIMEOUT_S the health check fails too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from ray import serve

from kvmesh.cluster import autoscaling
from kvmesh.cluster.engine_loop import EngineUnavailable, coalesce
from kvmesh.cluster.event_hub import get_or_create_hub
from kvmesh.cluster.messages import ModelInfo, RoutedRequest
from kvmesh.cluster.slo_window import LatencyWindow
from kvmesh.protocol import EngineRequest
from kvmesh.serve_config import ServeConfig, parse_config

logger = logging.getLogger("kvmesh.cluster")

STALL_TIMEOUT_S = float(os.environ.get("KVMESH_STALL_TIMEOUT_S", "60"))
# An idle worker still reports its load this often: its heartbeat, "at least every second" in
# docs/METRICS.md with room for a busy event loop (a router ranks a worker silent for 3 s last).
HEARTBEAT_S = 0.5
LEAVE_TIMEOUT_S = 5.0  # at shutdown, how long the worker waits for the hub to take its goodbye


def worker_id_of_this_replica() -> str:
    return serve.get_replica_context().replica_id.unique_id


class KVWorker:
    def __init__(self, config: dict):
        from kvmesh.cluster.engine_loop import EngineLoop, EngineThread
        from kvmesh.cluster.engine_process import EngineProcess

        self.config: ServeConfig = parse_config(config)
        self.worker_id = worker_id_of_this_replica()
        self.engine_stall_timeout_s = self.config.replicas.engine_stall_timeout_s
        device = self.config.engine.device
        num_threads = None
        if device == "cpu" or (device == "auto" and not _has_gpu()):
            num_threads = max(1, int(self.config.replicas.num_cpus or 1))
        engine_config = self.config.engine_config(worker_id=self.worker_id)
        window = self.config.autoscaling.window_s
        if self.config.replicas.engine_process:
            transport = EngineProcess(engine_config, num_threads=num_threads)
        else:
            from kvmesh.worker.engine import Engine
            if num_threads:
                import torch
                torch.set_num_threads(num_threads)
            transport = EngineThread(Engine(engine_config))
        self.loop = EngineLoop(transport, asyncio.get_running_loop(), ttft_window_s=window)
        self.latency = LatencyWindow(window)  # end-to-end TTFT / ITL for the SLO policies
        self._wake = asyncio.Event()
        self.loop.on_progress = self._wake.set
        self.hub = get_or_create_hub(self.config.app_name)
        self._publisher = asyncio.get_running_loop().create_task(self._publish_forever())
        logger.info("kvmesh worker %s ready: %s", self.worker_id, self.loop.info.model_name)

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, routed: RoutedRequest):
        request = EngineRequest(routed.request_id, list(routed.prompt_token_ids),
                                routed.sampling_params, routed.arrival_time or time.time(),
                                block_hashes=routed.block_hashes if routed.hash_block_size else None,
                                hash_block_size=routed.hash_block_size, cache_salt=routed.cache_salt,
                                priority=routed.priority)
        stream = self.loop.submit(request)
        self.latency.arrived(routed.request_id, request.arrival_time)
        interval = self.config.server.stream_interval
        finished, sent_first = False, False
        first_token_time, num_tokens = None, 0
        # n > 1: the sequences' deltas interleave, so each goes out as it is (no merging)
        single = routed.sampling_params.num_sequences == 1
        try:
            while True:
                # Everything the engine produced since the last read goes out as one item: at
                # high load a stream item per token per step would cost more than the step. After
                # the first token, an item waits for `stream_interval` tokens (or the finish).
                delta = coalesce(await stream.get(), stream) if single else await stream.get()
                while single and sent_first and not delta.finished and len(delta.token_ids) < interval:
                    delta = coalesce(delta.followed_by(await stream.get()), stream)
                delta.worker_id = self.worker_id  # gRPC's GenerateResponse.worker_id
                if delta.retryable:
                    if delta.token_ids:  # tokens made before the engine died still reach the client
                        yield dataclasses.replace(delta, finish_reason=None, error=None, retryable=False)
                    finished = True
                    raise EngineUnavailable(self.worker_id, delta.error)
                finished, sent_first = delta.finished, sent_first or bool(delta.token_ids)
                if delta.token_ids and first_token_time is None:
                    first_token_time = self.latency.first_token(routed.request_id)
                num_tokens += len(delta.token_ids)
                if finished:
                    self.latency.finished(first_token_time, num_tokens)
                yield delta
                if finished:
                    return
        finally:
            self.latency.closed(routed.request_id)
            if not finished:  # the caller went away: free the request's KV blocks now
                self.loop.abort(routed.request_id)

    async def model_info(self) -> ModelInfo:
        return self.loop.info

    def current_load(self):
        return self.loop.report(self.engine_stall_timeout_s)

    # ---- Serve hooks -------------------------------------------------------------------------

    async def check_health(self):
        if not self.loop.is_alive():
            raise RuntimeError(f"worker {self.worker_id}: {self.loop.failure_message()}")
        stalled = self.loop.stalled_for()
        if stalled > STALL_TIMEOUT_S:
            raise RuntimeError(f"engine step of {self.worker_id} has run {stalled:.0f} s "
                               f"(limit {STALL_TIMEOUT_S:.0f} s): no progress")

    def record_autoscaling_stats(self) -> dict:
        load = self.loop.load
        free_ratio = load.kv_free_blocks / load.kv_total_blocks if load.kv_total_blocks else 1.0
        return {autoscaling.KV_FREE_RATIO: free_ratio,
                autoscaling.TTFT_P90: self.latency.ttft_p90(),
                autoscaling.ITL_P90: self.latency.itl_p90(),
                autoscaling.ONGOING: float(self.loop.num_streams),
                autoscaling.WAITING: float(load.waiting),
                autoscaling.RUNNING: float(load.running)}

    async def __del__(self):
        """Serve's graceful shutdown, after the drain (Serve awaits an async __del__): stop
        publishing, leave the hub, then stop the engine. Leaving at once, rather than being
        dropped after SILENCE_S without a heartbeat, is what lets /health say scaled_to_zero as
        soon as the last replica is gone; and the engine stops only once the hub no longer lists
        the worker, so no router copy sees it unhealthy on its way out."""
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            try:
                await asyncio.wait_for(self.hub.remove_worker.remote(self.worker_id), LEAVE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 (the hub drops a silent worker after SILENCE_S)
                logger.warning("kvmesh worker %s: leaving the KV event hub failed: %r", self.worker_id, e)
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()

    # ---- KV events and load to the hub -------------------------------------------------------

    def _stats(self) -> dict:
        s = vars(self.loop.stats).copy()
        s["ttft_p90_s"] = self.loop.ttft_p90()
        return s

    async def _announce(self):
        """Register with the hub by a snapshot of the (empty) cache, so loads and metrics of this
        worker are known before its first KV event."""
        try:
            snap = await self.loop.snapshot()
            await self.hub.publish_snapshot.remote(snap, self.current_load(), self._stats())
        except Exception as e:
            logger.warning("kvmesh worker %s: announcing to the KV event hub failed: %r", self.worker_id, e)

    async def _stepped_or(self, timeout_s: float) -> None:
        """Wait for the engine's next step, or timeout_s, whichever comes first."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _publish_forever(self):
        interval = self.config.routing.load_report_interval_s
        block_size = self.config.engine.block_size
        last_load_sent = 0.0  # when the last report was sent (its start)
        await self._announce()
        while True:
            # idle: still report the load now and then (it is the worker's heartbeat)
            await self._stepped_or(last_load_sent + HEARTBEAT_S - time.monotonic())
            batches = self.loop.take_kv_batches()
            now = time.monotonic()
            # With no KV event, only the load is due, and not before `interval`; a KV batch
            # produced meanwhile goes out at once (it is what other router copies route on).
            deadline = last_load_sent + interval
            while not batches and now < deadline:
                await self._stepped_or(deadline - now)
                batches = self.loop.take_kv_batches()
                now = time.monotonic()
            last_load_sent = now
            try:
                # Stamped now: an idle engine's load does not change, but routers must still see
                # the heartbeat (a load that stops changing marks a stalled replica, router/routing_state.py).
                ok = await self.hub.publish.remote(batches, self.current_load(), self._stats(), block_size)
                if not ok:
                    snap = await self.loop.snapshot()
                    await self.hub.publish_snapshot.remote(snap, self.current_load(), self._stats())
            except Exception as e:  # the hub restarts on failure; the next publish resyncs
                logger.warning("kvmesh worker %s: publishing KV events failed: %r", self.worker_id, e)
                await asyncio.sleep(0.5)
                self.hub = get_or_create_hub(self.config.app_name)


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False
