"""One place for the ``kv-canary:`` prefix of every error this library raises."""

from __future__ import annotations

from typing import NoReturn


def fail(exc_type: type[Exception], message: str) -> NoReturn:
    raise exc_type(f"kv-canary: {message}")
