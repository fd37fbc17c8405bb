"""The error hierarchy. Each class maps to one HTTP status and one OpenAI error `type`."""

from __future__ import annotations


class PackserveError(Exception):
    """Base class: `status` is the HTTP status, `type` the OpenAI error type."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def headers(self) -> dict[str, str]:
        return {}


class ConfigError(PackserveError):
    """The config file or flags are invalid. Raised at start; never reaches a client."""

    status = 500
    type = "config_error"


class InvalidRequest(PackserveError):
    """The request is malformed or asks for something impossible."""

    status = 400
    type = "invalid_request_error"


class InputTooLong(InvalidRequest):
    code = "context_length_exceeded"


class TaskNotSupported(InvalidRequest):
    code = "task_not_supported"


class Forbidden(PackserveError):
    """The caller's key may not do what the request asks (an admin's field with a plain key)."""

    status = 403
    type = "permission_error"


class ModelNotFound(PackserveError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class Conflict(PackserveError):
    """An admin action that the model's current state forbids (unloading a busy model...)."""

    status = 409
    type = "conflict_error"


class _RetryLater(PackserveError):
    def __init__(self, message: str, *, retry_after_s: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = max(1, int(retry_after_s))

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class QueueFull(_RetryLater):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class RateLimited(_RetryLater):
    """An API key over one of its own limits (requests per second, concurrent requests,
    tokens per minute)."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ModelUnavailable(_RetryLater):
    """The model failed to load and is cooling down, or memory did not free up in time."""

    status = 503
    type = "model_unavailable"
    code = "model_unavailable"


class EngineCrashed(ModelUnavailable):
    """The engine serving the request died under it (a runner process that exited or was
    killed): 503, and the next request finds the engine started again."""

    code = "engine_crashed"


class NeverFits(PackserveError):
    """The model's footprint exceeds what its device can ever give it."""

    status = 507
    type = "insufficient_memory"
    code = "model_too_large"


class PinsDoNotFit(ConfigError):
    """Pinned models do not fit their device budget together. Raised at start."""


class ModelOutputInvalid(PackserveError):
    """The model finished but its output does not satisfy the requested JSON schema."""

    status = 502
    type = "invalid_model_output"
