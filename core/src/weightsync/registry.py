"""Name -> component class, per kind. A duplicate name is an error naming both modules."""

from __future__ import annotations

from typing import Generic, TypeVar

from .errors import PluginError

C = TypeVar("C")


class Registry(Generic[C]):
    def __init__(self, kind: str, base: type[C], failed: dict[str, str] | None = None) -> None:
        self.kind, self.base = kind, base
        self._classes: dict[str, type[C]] = {}
        self.failed = failed if failed is not None else {}

    def add(self, cls: type[C]) -> None:
        """The `register` callback handed to plugins."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise PluginError(f"{cls!r} is not a {self.base.__name__}; register a subclass of "
                              f"weightsync.{self.base.__name__}")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{cls.__module__}.{cls.__qualname__} has no `name` class attribute")
        other = self._classes.setdefault(name, cls)
        if other is not cls:
            raise PluginError(f"{self.kind} {name!r} is registered by both "
                              f"{other.__module__}.{other.__qualname__} and "
                              f"{cls.__module__}.{cls.__qualname__}; uninstall one of them or "
                              f"limit loading with WEIGHTSYNC_PLUGINS")

    def get(self, name: str) -> type[C]:
        try:
            return self._classes[name]
        except KeyError:
            msg = f"unknown {self.kind} {name!r}; installed: {sorted(self._classes)}"
            if self.failed:
                msg += "; plugins that failed to import: " + ", ".join(
                    f"{k} ({v})" for k, v in sorted(self.failed.items()))
            raise PluginError(msg) from None

    def names(self) -> list[str]:
        return sorted(self._classes)

    def items(self) -> list[tuple[str, type[C]]]:
        return sorted(self._classes.items())

    def __contains__(self, name: object) -> bool:
        return name in self._classes
