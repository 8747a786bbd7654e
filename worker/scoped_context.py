"""A ContextVar set for the body of a `with` block: the scoped state the worker reads instead of a
bare module global (the step's attention metadata, the tensor-parallel group a model is built for)."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def scoped(var: ContextVar[T], value: T) -> Iterator[T]:
    """Set `var` to `value` inside the block; the previous value comes back after it, error or not."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
