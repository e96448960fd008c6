"""The messages of transport `http` beyond the payload POST, for its relay shapes (only adapters
that relay, `RelaysPayloads` and `RelaysFetches`, get them)."""

from __future__ import annotations

from weightsync.interfaces.messages import Message

__all__ = ["ExpectRelay", "FetchPayload", "RelayOutcome"]


class ExpectRelay(Message):
    """A bucket will come through a relay: `body` is what it must be (index, digests, parent,
    children, tokens and the key the engine signs its outcome with;
    weightsync.transports.http.member_relay.Desk.expect)."""

    kind = "http.expect"


class RelayOutcome(Message):
    """The engine's own outcome for relayed bucket `body["index"]`, waiting up to `body["wait"]`
    seconds for it; asked over the engine's own channel, so no relay can hide or forge it."""

    kind = "http.relayed"


class FetchPayload(Message):
    """One payload the engine fetches by reference: `body` is {"header": ..., "fetch": {url,
    token, nbytes, and under "relay" the piece digests, what to offer on, and the trainer's
    fallback copy}}; answered once the engine staged it."""

    kind = "http.fetch"
