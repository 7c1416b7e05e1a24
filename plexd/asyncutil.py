"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


async def call_maybe_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn` and await the result when it is awaitable: services take plain or async callbacks alike."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result
