"""Stored /v1/responses responses (`server.responses_store`): what `store: true` keeps, for
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and a later request's `previous_response_id`.

One Ray actor per app, shared by every ingress replica (a response stored through one replica is
found through another), named after the app and detached as the KV event hub is; `kvmesh serve`'s
shutdown kills both. It keeps at most `server.responses_store` responses in memory, the least
recently stored or read dropped first, and none survives the actor. Each is kept with its
conversation: the earlier conversation it continued, its own input items, and its output items,
which is what a request naming it as `previous_response_id` is run after (the earlier
`instructions` are not carried over, as OpenAI's are not).

A response belongs to the API key that stored it (a SHA-256 digest of the key is kept, never the
key): another key finds nothing under its id, so ids cannot be probed across keys. Without API
keys every caller is the same owner. An actor that died comes back empty (max_restarts).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import ray

from kvmesh.cluster.event_hub import NAMESPACE


def store_name(app_name: str) -> str:
    return f"kvmesh-responses-{app_name}"


def owner_of(api_key: str | None) -> str:
    """Whose a stored response is: a digest of the API key it came with ("" without keys)."""
    if not api_key:
        return ""
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


class StoredResponses:
    """The bounded store itself (the actor's state; plain so it is tested without Ray)."""

    def __init__(self):
        self._items: OrderedDict[str, tuple[str, dict, list]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, conversation: list, owner: str, capacity: int) -> None:
        """Keep `response` (under its id) with its conversation; drop the oldest beyond capacity."""
        self._items[response["id"]] = (owner, response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > max(capacity, 0):
            self._items.popitem(last=False)

    def get(self, response_id: str, owner: str) -> tuple[dict, list] | None:
        """(response, conversation) stored by `owner` under the id, else None; a read keeps it."""
        found = self._items.get(response_id)
        if found is None or found[0] != owner:
            return None
        self._items.move_to_end(response_id)
        return found[1], found[2]

    def delete(self, response_id: str, owner: str) -> bool:
        found = self._items.get(response_id)
        if found is None or found[0] != owner:
            return False
        del self._items[response_id]
        return True


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
    try:
        actor = ray.get_actor(store_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
