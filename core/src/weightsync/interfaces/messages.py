"""Messages: what a transport's sending half tells the engine side through the one adapter member
`Adapter.deliver`; the receiving half of the same transport parses them inside the engine. A
transport that needs a new engine-side verb defines a Message subclass; adapters stay as they are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

__all__ = ["Announce", "Message"]


@dataclass(frozen=True)
class Message:
    """One message to one engine. `kind` names it on the wire ("<transport>.<verb>"); `body` is
    JSON; `wait` is how many seconds the engine may take to answer (None: the adapter's payload
    timeout). What `deliver` returns is the engine's JSON answer ({} when it has none)."""

    kind: ClassVar[str] = ""
    body: Mapping[str, Any] = field(default_factory=dict)
    wait: float | None = None

    def wire(self) -> dict[str, Any]:
        """The message as JSON: {"kind": ..., "body": {...}}."""
        return {"kind": self.kind, "body": dict(self.body)}


class Announce(Message):
    """A payload whose body travels out of band: `body` is its header; answered with its digest."""

    kind = "announce"
