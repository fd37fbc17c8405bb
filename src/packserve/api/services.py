"""What routes reach: one app's scheduler, telemetry and embedding batchers, through a FastAPI
dependency (`ServicesDep`). `create_app` makes them once and stores them on `app.state`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from packserve import backends
from packserve.api.access import CALLER, check_keep_alive, may_call
from packserve.api.asgi import REQUEST_ID
from packserve.api.batching import Batchers
from packserve.api.calls import Call, off_loop
from packserve.auth import KeyLimits
from packserve.config import ModelSpec, SloConfig
from packserve.core.compute import TICKET, Gates
from packserve.core.lease import Lease
from packserve.core.request import Inputs
from packserve.core.scheduler import Scheduler
from packserve.errors import InvalidRequest, ModelNotFound
from packserve.metrics.telemetry import Telemetry
from packserve.types import Task


@dataclass(frozen=True)
class Services:
    """The objects one app's routes share; made once by `create_app`."""

    scheduler: Scheduler
    telemetry: Telemetry
    batchers: Batchers = field(default_factory=Batchers)
    limits: KeyLimits = field(default_factory=KeyLimits)  # each API key's own limits
    gates: Gates = field(default_factory=Gates)  # compute turns by deadline, per device
    slo: SloConfig = field(default_factory=SloConfig)  # per model type; a model's slo_s wins

    @contextlib.asynccontextmanager
    async def call(self, model: str, task: Task, inputs: Inputs | None = None,
                   keep_alive: float | None = None) -> AsyncIterator[Call]:
        """A call of `model` for `task` on behalf of the request being served: a lease of
        the model, used through the `Call` this yields. `inputs` are held to the model's
        max_inputs and max_input_tokens. Raises PackserveErrors (see `api.errors`).

        The engine calls made through the `Call` compete for their device's compute by
        deadline: the request's arrival here plus its SLO (`core.compute`). `keep_alive`: the
        request's (Ollama's), for admin keys only where keys are configured."""
        arrived = time.monotonic()
        caller = CALLER.get()
        if keep_alive is not None:
            check_keep_alive(model)
        spec = self.spec_of(model)
        inputs = inputs or Inputs(())
        if len(inputs.texts) > spec.max_inputs:
            raise InvalidRequest(f"model {model!r} takes at most {spec.max_inputs} texts per "
                                 f"request (its max_inputs); this one has {len(inputs.texts)}",
                                 param=inputs.param)
        if caller is not None:
            self.limits.admit(caller)  # RateLimited (429) before the request takes a slot
        used = 0
        slo_s = spec.slo_s or self.slo.of(task)
        try:
            async with self.scheduler.acquire(
                    model, task, request_id=REQUEST_ID.get(),
                    key=caller.name if caller else "",
                    weight=caller.weight if caller else 1.0, slo_s=slo_s,
                    keep_alive=keep_alive) as lease:
                gate = self.gates.of(lease.runner.device)
                ticket = gate.ticket(model, slo_s, arrived)
                token = TICKET.set(ticket)  # travels into the engine's worker thread
                try:
                    with lease.runner.working(arrived + slo_s, slo_s):
                        await _check_input_tokens(lease, spec, inputs)
                        yield Call(lease, self.batchers, self.scheduler.recover)
                finally:
                    used = lease.prompt_tokens + lease.completion_tokens
                    self.telemetry.count_compute_wait(model, task, ticket.waited_s)
                    with contextlib.suppress(ValueError):  # closed from another context
                        TICKET.reset(token)
        finally:
            if caller is not None:
                self.limits.release(caller, used)

    def spec_of(self, model: str) -> ModelSpec:
        """The catalog entry of `model`, if the request being served may call it."""
        caller = CALLER.get()
        if caller is not None and (not caller.may_call(model)
                                   or model not in self.scheduler.model_names()):
            # The same answer whether the model is missing or out of scope: a key learns
            # nothing about models it may not call.
            raise ModelNotFound(
                f"model {model!r} does not exist or you have no access to it; key "
                f"{caller.name!r} may call: {', '.join(self.visible_models()) or 'no model'}",
                param="model")
        spec = self.scheduler.spec_of(model)
        assert isinstance(spec, ModelSpec)  # the server's entries: the core holds them as Served
        return spec

    def visible_models(self) -> list[str]:
        """The catalog names the request being served may call (all of them without keys)."""
        return [name for name in self.scheduler.model_names() if may_call(name)]


def check_engine(spec: ModelSpec, fields: Sequence[str] = (), *,
                 token_ids: str | None = None) -> None:
    """Refuse, before any load, what the engine of `spec` does not honour: generation fields
    beyond OpenAI's (`fields`, as the request names them) and inputs given as token ids
    (`token_ids`: the field that holds them)."""
    engine = backends.get(spec.backend)
    for name in fields:
        if name.rpartition(".")[2] not in engine.sampling:
            honour = sorted(engine.sampling)
            raise InvalidRequest(
                f"model {spec.name!r} is served by engine {engine.name!r}, which does not "
                f"honour {name}" + (f" (it honours {', '.join(honour)})" if honour else "")
                + "; leave it out, or serve the model with backend = \"llama-server\"",
                param=name)
    if token_ids is not None and not engine.token_ids:
        raise InvalidRequest(f"{token_ids} is token ids, but model {spec.name!r} is served by "
                             f"engine {engine.name!r}, which takes text, not token ids",
                             param=token_ids)


async def services(request: Request) -> Services:
    """The app's Services. Async, so that FastAPI runs it on the loop, not in a thread."""
    found: Services = request.app.state.services
    return found


ServicesDep = Annotated[Services, Depends(services)]


async def _check_input_tokens(lease: Lease, spec: ModelSpec, inputs: Inputs) -> None:
    texts = [*inputs.also] if inputs.token_counts else [*inputs.texts, *inputs.also]
    if spec.max_input_tokens is None or not (texts or inputs.token_counts):
        return
    tokens = sum(inputs.token_counts)
    if texts:
        tokens += sum(await off_loop(lease.runner.count_tokens, texts))
    if tokens > spec.max_input_tokens:
        raise InvalidRequest(f"this request's input is {tokens} tokens; model {spec.name!r} "
                             f"takes at most {spec.max_input_tokens} per request (its "
                             f"max_input_tokens)", param=inputs.param)
