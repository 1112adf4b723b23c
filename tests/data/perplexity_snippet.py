"""A small LRU cache with time-based expiry, used as a fixed text for perplexity tests."""

import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ExpiringLRUCache(Generic[K, V]):
    """Keeps at most `capacity` items; an item older than `ttl` seconds is treated as missing."""

    def __init__(self, capacity: int, ttl: float = 60.0, clock=time.monotonic):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K, default: V | None = None) -> V | None:
        entry = self._items.get(key)
        if entry is None:
            self.misses += 1
            return default
        stored_at, value = entry
        if self._clock() - stored_at > self.ttl:
            del self._items[key]
            self.misses += 1
            return default
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: K, value: V) -> None:
        if key in self._items:
            self._items.move_to_end(key)
        self._items[key] = (self._clock(), value)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


if __name__ == "__main__":
    cache: ExpiringLRUCache[str, int] = ExpiringLRUCache(capacity=2, ttl=5.0)
    cache.put("a", 1)
    cache.put("b", 2)
    print(cache.get("a"))
    cache.put("c", 3)
    print(cache.get("b"), len(cache), cache.hit_rate())
