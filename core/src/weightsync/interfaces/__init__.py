"""The component kinds: Exporter, Encoding, Transport, Adapter, Fleet, PeerSource. A component is
a class with a `name` (what users type in config) and a pydantic `Options` model; the
orchestrator builds it from config and calls it directly. One module per kind of job."""

from weightsync.interfaces.adapter import Adapter, EngineStatus, LocalEngine
from weightsync.interfaces.base import Alloc, Bounded, Component, NameMap, NoOptions, Payload
from weightsync.interfaces.fleet import Fleet, Member, PeerSource
from weightsync.interfaces.streams import (Encoding, Endpoint, Exporter, Render, Transport,
                                           TransportReceiver)

__all__ = ["Adapter", "Alloc", "Bounded", "Component", "Encoding", "EngineStatus", "Endpoint",
           "Exporter", "Fleet", "LocalEngine", "Member", "NameMap", "NoOptions", "Payload",
           "PeerSource", "Render", "Transport", "TransportReceiver"]
