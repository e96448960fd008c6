"""Exceptions. Every message says what was wrong and what to do, so callers can print it as is."""

from __future__ import annotations

__all__ = ["ConfigError", "EngineError", "EngineUnavailable", "EngineUnreachable", "PayloadError",
           "PluginError", "SyncError", "TransportError", "WeightSyncError"]


class WeightSyncError(Exception):
    """Base class of every error weightsync raises on purpose."""


class PluginError(WeightSyncError):
    """A component could not be found, registered or built."""


class ConfigError(WeightSyncError):
    """The configuration is invalid or names a combination that cannot work."""


class EngineError(WeightSyncError):
    """An engine refused or failed a request; carries the engine's name and, for an HTTP answer,
    its status (a 4xx is the request's fault, a 5xx the engine's)."""

    def __init__(self, engine: str, message: str, status: int | None = None) -> None:
        super().__init__(f"engine {engine}: {message}")
        self.engine, self.detail, self.status = engine, message, status


class EngineUnavailable(EngineError):
    """The engine did not answer (down, wrong URL, timeout)."""


class EngineUnreachable(EngineUnavailable):
    """No connection, so no answer: an idempotent call may be retried on a fresh connection."""


class PayloadError(WeightSyncError):
    """A payload cannot be applied: unknown tensor, wrong shape or dtype, corrupted bytes."""


class TransportError(WeightSyncError):
    """The transport could not carry a payload (peer missing, timeout, broken group)."""


class SyncError(WeightSyncError):
    """A push did not reach every engine verified; `report` says which did."""

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report
