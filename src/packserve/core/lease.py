"""What a request holds while it uses a model: the boundary between the scheduler and the
handlers that run requests (`api/`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from packserve.core.backend import Runner
from packserve.types import Task


@dataclass
class Lease:
    """What a request holds while it uses a model. `runner` is valid until the lease ends.

    The handler records the tokens it reports to the client with `count_tokens`; they travel
    in the request's RequestEvent.
    """

    model: str
    task: Task
    runner: Runner
    prompt_tokens: int = 0
    completion_tokens: int = 0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    first_token_at: float | None = None  # a stream's first text went out (its clock's time)

    def count_tokens(self, prompt: int, completion: int = 0) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def first_token(self) -> None:
        """A stream sent its first text now (time to first token, in the RequestEvent)."""
        if self.first_token_at is None:
            self.first_token_at = self.clock()
