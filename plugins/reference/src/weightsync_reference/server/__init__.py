"""The reference engine: a real HTTP server that serves a causal LM and receives weights with
weightsync's full control protocol. The embedded default engine, and the reference receiver for
anyone wiring weightsync into their own engine."""

from weightsync_reference.server.engine import ReferenceEngine
from weightsync_reference.server.app import make_server, serve

__all__ = ["ReferenceEngine", "make_server", "serve"]
