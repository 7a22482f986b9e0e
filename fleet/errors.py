"""The one exception hierarchy of fleet. No HTTP here: gateway/errors.py maps ErrorCode to a status.

    ServingError (code)
    ├── InvalidInput            INVALID_ARG   bad JSON, shape, datatype, unknown input
    ├── TooLarge                TOO_LARGE     a body (or upload, or job line) over its byte limit
    ├── ModelNotFound           UNKNOWN_MODEL unknown model name (HTTP 404, gRPC NOT_FOUND, as tritonserver 2.51)
    ├── VersionNotFound         NOT_FOUND     known model, unknown version
    ├── NotFound                NOT_FOUND     a resource that is not there (a job, a region)
    │   └── ModelUnloaded       NOT_FOUND     a model unloaded since it was loaded (as tritonserver 2.51)
    ├── ModelNotReady           UNAVAILABLE   a loaded model no ready worker serves now / version not ready
    ├── QueueFull               UNAVAILABLE   max_queue_size reached
    ├── RequestTimeout          UNAVAILABLE   queue timeout (Triton REJECT)
    ├── DeadlineExceeded        DEADLINE_EXCEEDED  the gateway gave up waiting for a reply
    ├── BrokerUnavailable       UNAVAILABLE   Redis cannot be reached
    ├── Unsupported             UNSUPPORTED   a feature fleet does not do (yet)
    ├── ConfigError             INVALID_ARG   a malformed or inconsistent config.pbtxt
    ├── Unauthenticated         UNAUTHENTICATED  a missing or wrong API key
    ├── PermissionDenied        PERMISSION_DENIED  an API that is switched off (model control without keys)
    └── InferenceFailed         INTERNAL      the model raised or returned garbage
        └── PoisonRequest       INTERNAL      the request crashed its model instance every time it ran

Errors cross Redis as data (`code`, `message`); `from_code` rebuilds them.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    INTERNAL = "INTERNAL"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    TOO_LARGE = "TOO_LARGE"
    # A model name the repository does not have. Its own code because the protocols answer it differently:
    # HTTP 400 (INVALID_ARG, as Triton's current core), gRPC NOT_FOUND (what tritonserver 2.51 answers).
    UNKNOWN_MODEL = "UNKNOWN_MODEL"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNKNOWN = "UNKNOWN"


class ServingError(Exception):
    """Base of every error fleet reports to a caller; `message` is what the client sees."""

    code: ErrorCode = ErrorCode.UNKNOWN
    retry_after_s: int | None = None  # sent as Retry-After: the condition is expected to pass

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidInput(ServingError):
    code = ErrorCode.INVALID_ARG


class TooLarge(ServingError):
    """A request body, upload or job line over its configured byte limit (HTTP 413)."""

    code = ErrorCode.TOO_LARGE


class ModelNotFound(ServingError):
    code = ErrorCode.UNKNOWN_MODEL

    def __init__(self, name: str) -> None:
        super().__init__(f"Request for unknown model: '{name}' is not found")


class VersionNotFound(ServingError):
    code = ErrorCode.NOT_FOUND

    def __init__(self, name: str, version: str) -> None:
        super().__init__(f"Request for unknown model: '{name}' version {version} is not found")


class NotFound(ServingError):
    code = ErrorCode.NOT_FOUND


class ModelUnloaded(NotFound):
    """A repository model loaded once and unloaded since: Triton's NOT_FOUND, never a 503 to retry on."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Request for unknown model: '{name}' has no available versions")


class NotReadyYet(ServingError):
    """The resource exists but is not in the state the request needs (a job's results before it ends)."""

    code = ErrorCode.FAILED_PRECONDITION


class ModelNotReady(ServingError):
    code = ErrorCode.UNAVAILABLE


class QueueFull(ServingError):
    code = ErrorCode.UNAVAILABLE
    retry_after_s = 1

    def __init__(self, message: str = "Exceeds maximum queue size") -> None:
        super().__init__(message)


class Overloaded(ServingError):
    """The gateway holds as many requests as it may (`max_in_flight`): come back shortly."""

    code = ErrorCode.UNAVAILABLE
    retry_after_s = 1


class RequestTimeout(ServingError):
    code = ErrorCode.UNAVAILABLE

    def __init__(self, message: str = "Request timeout expired") -> None:
        super().__init__(message)


class SequenceLost(ServingError):
    """The worker holding a live sequence (and its state) is gone; the client restarts the sequence."""

    code = ErrorCode.UNAVAILABLE


class DeadlineExceeded(ServingError):
    code = ErrorCode.DEADLINE_EXCEEDED


class BrokerUnavailable(ServingError):
    code = ErrorCode.UNAVAILABLE


class ControlNotAllowed(ServingError):
    """Model load/unload outside explicit model control (Triton answers UNAVAILABLE)."""

    code = ErrorCode.UNAVAILABLE


class Unsupported(ServingError):
    code = ErrorCode.UNSUPPORTED


class ConfigError(ServingError):
    code = ErrorCode.INVALID_ARG


class Unauthenticated(ServingError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(ServingError):
    code = ErrorCode.PERMISSION_DENIED


class InferenceFailed(ServingError):
    code = ErrorCode.INTERNAL


class PoisonRequest(InferenceFailed):
    """The request crashed its model instance each time it ran alone: its message goes to the dead
    letters instead of being tried again (it would only crash the next instance too)."""

    def __init__(self, attempts: int, detail: str = "") -> None:
        last = f" (last: {detail})" if detail else ""
        super().__init__(f"the request crashed the model instance {attempts} times; "
                         f"moved to the dead letters{last}")
        self.attempts = attempts


def from_code(code: str, message: str) -> ServingError:
    """Rebuild an error that crossed Redis as data; unknown codes become INTERNAL."""
    err = ServingError(message)
    try:
        err.code = ErrorCode(code)
    except ValueError:
        err.code = ErrorCode.INTERNAL
    return err
