"""Hook implementations only; components are imported inside the hooks so the plugin imports
without its engine installed."""

from weightsync import hookimpl  # noqa: F401
