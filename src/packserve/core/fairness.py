"""Fair share of one model's queue between callers (API keys): a burst from one key queues
behind that key's own requests, not in front of everyone else's.

Stride scheduling: each key has a pass value that grows by 1/weight each time one of its
requests leaves the queue; the next request comes from the waiting key with the lowest pass
(ties: the key that has waited longest). A key that starts waiting joins at the current virtual
time, so a key that was idle cannot bank credit and then starve the others. Pure data: no
asyncio, no clock; the scheduler decides when a slot is free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items queued per key; `pop` takes the next one by weighted round robin over keys."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[T]] = {}
        self._pass: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._vtime = 0.0
        self._arrival = 0  # ties go to the key whose head waited longest
        self._since: dict[str, int] = {}

    def push(self, item: T, key: str = "", weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._pass[key] = max(self._pass.get(key, 0.0), self._vtime)
            self._since[key] = self._arrival
        self._weight[key] = weight
        self._arrival += 1
        queue.append(item)

    def pop(self) -> T:
        """The next item. Raises IndexError when nothing waits."""
        if not self._queues:
            raise IndexError("pop from an empty FairQueue")
        key = min(self._queues, key=lambda k: (self._pass[k], self._since[k]))
        queue = self._queues[key]
        item = queue.popleft()
        self._vtime = self._pass[key]
        self._pass[key] += 1.0 / self._weight[key]
        if queue:
            self._since[key] = self._arrival
            self._arrival += 1
        else:
            self._drop(key)
        return item

    def remove(self, item: T) -> bool:
        """Take `item` out wherever it waits (its caller gave up). False if it is not queued."""
        for key, queue in self._queues.items():
            if item in queue:
                queue.remove(item)
                if not queue:
                    self._drop(key)
                return True
        return False

    def _drop(self, key: str) -> None:
        del self._queues[key]
        del self._since[key]
        # the pass value is kept: a key that comes back at once does not jump the others

    def waiting(self, key: str) -> int:
        queue = self._queues.get(key)
        return len(queue) if queue is not None else 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __contains__(self, item: object) -> bool:
        return any(item in q for q in self._queues.values())

    def __iter__(self) -> Iterator[T]:
        for queue in self._queues.values():
            yield from queue
