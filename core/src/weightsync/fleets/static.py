"""Fleet `static`: the config's `engines:` list, every one a member of every push."""

from __future__ import annotations

from typing import Any

from weightsync.interfaces import Fleet, Member, NoOptions


class StaticFleet(Fleet):
    name = "static"
    Options = NoOptions
    takes_engines = True

    def __init__(self, options: Any = None, engines: list[Any] | None = None) -> None:
        super().__init__(options)
        self._members = [Member(s.name or s.url, s) for s in (engines or [])]

    def members(self) -> list[Member]:
        return list(self._members)
