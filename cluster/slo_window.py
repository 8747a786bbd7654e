"""A worker's end-to-end latencies over a sliding window, for the SLO autoscaling policies.

TTFT counts from the request's arrival at the ingress: `RoutedRequest.arrival_time` is stamped
when the ingress receives the request, before tokenizing and before Serve's handle queues it for a
free replica slot, and it travels with the request. So the time a request waited at the ingress
(and a failed attempt on another worker) is inside the figure without another channel; wall
clocks of the ingress and worker nodes must agree (NTP), as for the engine's own TTFT.

A request with no first token yet counts with its age so far: in a growing backlog the p90 of
served requests alone lags by the backlog's wait, which is when a scale-up is needed most.

ITL is per finished request: its mean time per output token after the first (what a streaming
client sees between tokens, whatever the stream's chunking).
"""

from __future__ import annotations

import time
from collections import deque


def p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank at or above), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class LatencyWindow:
    def __init__(self, window_s: float):
        self.window_s = window_s
        self._ttfts: deque[tuple[float, float]] = deque()  # (when, seconds)
        self._itls: deque[tuple[float, float]] = deque()
        self._arrivals: dict[str, float] = {}  # requests without a first token: arrival stamp

    def arrived(self, request_id: str, arrival: float) -> None:
        self._arrivals[request_id] = arrival

    def first_token(self, request_id: str, now: float | None = None) -> float:
        """Record the request's TTFT; returns `now` (its first-token time)."""
        now = time.time() if now is None else now
        arrival = self._arrivals.pop(request_id, None)
        if arrival is not None:
            self._ttfts.append((now, max(0.0, now - arrival)))
        return now

    def finished(self, first_token_time: float | None, num_tokens: int, now: float | None = None) -> None:
        if first_token_time is None or num_tokens < 2:
            return
        now = time.time() if now is None else now
        self._itls.append((now, (now - first_token_time) / (num_tokens - 1)))

    def closed(self, request_id: str) -> None:
        """The request left the worker (finished, aborted or failed)."""
        self._arrivals.pop(request_id, None)

    def ttft_p90(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        waiting = [now - arrival for arrival in self._arrivals.values()]
        return p90(self._recent(self._ttfts, now) + waiting)

    def itl_p90(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        return p90(self._recent(self._itls, now))

    def _recent(self, samples: deque[tuple[float, float]], now: float) -> list[float]:
        while samples and now - samples[0][0] > self.window_s:
            samples.popleft()
        return [value for _, value in samples]
