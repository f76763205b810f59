"""Test doubles that count what the code under test asks of them."""

from __future__ import annotations

from typing import Any


class CountingGets(dict):  # type: ignore[type-arg]
    """A dict that counts its ``get`` calls: a prefix cache's key dict, for how many blocks a walk looked up."""

    gets = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.gets += 1
        return super().get(key, default)
