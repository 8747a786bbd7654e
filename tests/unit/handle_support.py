"""A stand-in for Serve's deployment handle of the workers, for the ingress's code without a
cluster: `handle.options(stream=True).generate.remote(routed)` runs each attempt's script in turn
(the real handle and worker are exercised by the integration tests)."""

from __future__ import annotations

import asyncio


class Handle:
    """Each attempt's script is a list of TokenDeltas, exceptions (raised) and asyncio.Events
    (waited for: a worker still generating); `response` is the class of each attempt's answer."""

    def __init__(self, *attempts, response: type[Response] | None = None):
        self.attempts = list(attempts)
        self.response = response or Response
        self.avoided = []  # routed.avoid_workers as each attempt saw it
        self.routed = []  # the RoutedRequest of each attempt
        self.responses: list[Response] = []

    def options(self, stream):
        return self

    @property
    def generate(self):
        return self

    def remote(self, routed):
        self.avoided.append(list(routed.avoid_workers))
        self.routed.append(routed)
        self.responses.append(self.response(self.attempts.pop(0)))
        return self.responses[-1]


class Response:
    def __init__(self, script):
        self.script = script
        self.cancelled = False  # cancel() called: Serve cancels the worker's generator

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, asyncio.Event):
                await item.wait()
                continue
            yield item

    def cancel(self):
        self.cancelled = True
