"""Stored /v1/responses responses (`server.responses_store`): what `store: true` keeps, for
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` (of a
background response) and a later request's `previous_response_id`.

One Ray actor per app, shared by every ingress replica (a response stored through one replica is
found through another), named after the app and detached as the KV event hub is; `kvmesh serve`'s
shutdown kills both. It keeps at most `server.responses_store` responses in memory, the least
recently stored or read dropped first, and none survives the actor. Each is kept with its input
items: the earlier conversation it continued and its own input (what GET .../input_items lists);
with its output items once it finished (completed or incomplete), they are its conversation, what a
request naming it as `previous_response_id` is run after (the earlier `instructions` are not carried
over, as OpenAI's are not).

A `background: true` response is stored queued as it starts; its runner (a task of the ingress
replica that took it) touches it every second and stores its end, unless it was cancelled, deleted or
dropped meanwhile, which the touch tells it so that it stops. A runner silent for STALE_S (its
replica died) leaves the response failed.

A response belongs to the API key that stored it (a SHA-256 digest of the key is kept, never the
key): another key finds nothing under its id, so ids cannot be probed across keys. Without API
keys every caller is the same owner. An actor that died comes back empty (max_restarts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import OrderedDict

import ray

from kvmesh.cluster.event_hub import NAMESPACE, kill_named


def store_name(app_name: str) -> str:
    return f"kvmesh-responses-{app_name}"


def owner_of(api_key: str | None) -> str:
    """Whose a stored response is: a digest of the API key it came with ("" without keys)."""
    if not api_key:
        return ""
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


STALE_S = 15.0  # a background response whose runner has not touched it this long has lost it
RUNNING = ("queued", "in_progress")
FINISHED = ("completed", "incomplete")  # what can be continued


@dataclasses.dataclass
class _Entry:
    owner: str
    response: dict
    inputs: list  # the earlier conversation and its input
    background: bool = False
    touched: float = 0.0  # a background response: when its runner last said it runs
    cancelled: bool = False


class StoredResponses:
    """The bounded store itself (the actor's state; plain so it is tested without Ray). `clock`:
    the monotonic time, for a background response's liveness."""

    def __init__(self, clock=time.monotonic):
        self._items: OrderedDict[str, _Entry] = OrderedDict()
        self._clock = clock

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, inputs: list, owner: str, capacity: int, background: bool = False) -> None:
        """Keep `response` (under its id) with its input items; drop the oldest beyond capacity."""
        self._items[response["id"]] = _Entry(owner, response, inputs, background, self._clock())
        self._items.move_to_end(response["id"])
        while len(self._items) > max(capacity, 0):
            self._items.popitem(last=False)

    def get(self, response_id: str, owner: str) -> tuple[dict, list | None] | None:
        """(response, its conversation: None unless it finished) stored by `owner` under the id, else
        None; a read keeps it. A background response whose runner stopped touching it (its ingress
        replica died) is failed."""
        entry = self._found(response_id, owner)
        if entry is None:
            return None
        self._items.move_to_end(response_id)
        if entry.response.get("status") in RUNNING and self._clock() - entry.touched > STALE_S:
            entry.response = {**entry.response, "status": "failed", "error": {
                "code": "server_error", "message": f"the ingress replica running it stopped (no word from it "
                                                   f"in {STALE_S:g} s)"}}
        done = entry.response.get("status") in FINISHED
        return entry.response, [*entry.inputs, *entry.response.get("output", [])] if done else None

    def inputs(self, response_id: str, owner: str) -> list | None:
        """The input items of `owner`'s response (the earlier conversation and its input), else None."""
        entry = self._found(response_id, owner)
        return None if entry is None else entry.inputs

    def delete(self, response_id: str, owner: str) -> bool:
        if self._found(response_id, owner) is None:
            return False
        del self._items[response_id]
        return True

    def touch(self, response_id: str, response: dict | None = None) -> bool:
        """A background response's runner: it still runs (its response now `response`, if given).
        Whether it should stop: cancelled, deleted or dropped."""
        entry = self._items.get(response_id)
        if entry is None or entry.cancelled:
            return True
        entry.touched = self._clock()
        if response is not None:
            entry.response = response
        return False

    def finish(self, response: dict) -> bool:
        """A background response's end; False (and nothing kept) if it was cancelled, deleted or dropped."""
        entry = self._items.get(response["id"])
        if entry is None or entry.cancelled:
            return False
        entry.response = response
        return True

    def cancel(self, response_id: str, owner: str) -> dict | str | None:
        """Cancel a background response: the response as it now stands ("cancelled" unless it had
        ended), "not_background" for a response that was not one, None if there is none."""
        entry = self._found(response_id, owner)
        if entry is None:
            return None
        if not entry.background:
            return "not_background"
        if entry.response.get("status") in RUNNING:
            entry.cancelled = True
            entry.response = {**entry.response, "status": "cancelled"}
        return entry.response

    def _found(self, response_id: str, owner: str) -> _Entry | None:
        entry = self._items.get(response_id)
        return entry if entry is not None and entry.owner == owner else None


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1)
class ResponseStore(StoredResponses):
    """The app's StoredResponses as an actor (calls run one at a time: no lock needed)."""

    def count(self) -> int:
        return len(self)


def get_or_create_store(app_name: str):
    """The app's store actor handle (created detached on first use). Safe to call concurrently."""
    return ResponseStore.options(name=store_name(app_name), namespace=NAMESPACE, get_if_exists=True,
                                 lifetime="detached").remote()


def kill_store(app_name: str) -> bool:
    return kill_named(store_name(app_name))
