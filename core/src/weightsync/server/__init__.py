"""The reference engine: a real HTTP server that serves a causal LM and receives weights with
weightsync's full control protocol. The embedded default engine, and the reference receiver for
anyone wiring weightsync into their own engine."""

from .engine import ReferenceEngine
from .app import make_server, serve

__all__ = ["ReferenceEngine", "make_server", "serve"]
