"""The component kinds: Exporter, Encoding, Transport, Adapter, Fleet, PeerSource, Launcher; the
messages a transport delivers through an adapter; the capabilities an adapter may have. A
component is a class with a `name` (what users type in config) and a pydantic `Options` model;
the orchestrator builds it from config and calls it directly. One module per kind of job."""

from weightsync.interfaces.adapter import AckedRound, Adapter, EngineStatus, HttpAdapter
from weightsync.interfaces.base import Alloc, Bounded, Component, NameMap, NoOptions, Payload
from weightsync.interfaces.capabilities import (ChecksAccess, Distrusts, JoinsGroups,
                                                PullsFromPeers, RelaysFetches, RelaysPayloads, ReloadsFromDisk,
                                                Scores, ServesPayloads, SharesRounds,
                                                SharesWeights)
from weightsync.interfaces.fleet import Fleet, Member, PeerHosting, PeerSource
from weightsync.interfaces.launcher import Launcher, LocalEngine
from weightsync.interfaces.messages import Announce, Message
from weightsync.interfaces.streams import (Encoding, Endpoint, Exporter, Render, Stages, Transport,
                                           TransportReceiver)

__all__ = ["AckedRound", "Adapter", "Alloc", "Announce", "Bounded", "ChecksAccess", "Component",
           "Distrusts", "Encoding", "EngineStatus", "Endpoint", "Exporter", "Fleet", "HttpAdapter", "JoinsGroups", "Launcher",
           "LocalEngine", "Member", "Message", "NameMap", "NoOptions", "Payload", "PeerHosting", "PeerSource",
           "PullsFromPeers", "RelaysFetches", "RelaysPayloads", "ReloadsFromDisk", "Render",
           "Scores", "ServesPayloads", "SharesRounds", "SharesWeights", "Stages", "Transport", "TransportReceiver"]
