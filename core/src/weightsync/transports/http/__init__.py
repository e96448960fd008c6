"""Transport `http`: the trainer's sending half (`sending`) and relay shapes (`relay`, `fetch`),
the member halves engines embed (`member_relay`, `member_fetch`, `landing`), and `pieces`."""

from weightsync.transports.http.messages import ExpectRelay, FetchPayload, RelayOutcome

__all__ = ["ExpectRelay", "FetchPayload", "RelayOutcome"]
