"""Transport `http`, both halves: the trainer's sending half (`sending`), its relay shapes
(`relay` for members that take bodies in requests, `fetch` for members that fetch them by
reference), the member halves that engines embed (`member_relay`, `member_fetch`, `landing`) and
what both sides agree on (`pieces`)."""

from weightsync.transports.http.messages import ExpectRelay, FetchPayload, RelayOutcome

__all__ = ["ExpectRelay", "FetchPayload", "RelayOutcome"]
