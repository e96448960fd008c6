"""The base of every contract class (weightsync.testing.contracts, and the engine-process contracts
of weightsync_reference.contracts): overriding a contract test is allowed only with an xfail mark
that says why."""

from __future__ import annotations

__all__ = ["Contract"]


class Contract:
    """Subclassed directly by each contract class; a plugin's subclass inherits its tests."""

    def test_no_silent_overrides(self) -> None:
        """A subclass that overrides a contract test must mark it xfail with a reason."""
        base = next(c for c in type(self).__mro__ if Contract in c.__bases__)
        for name in dir(base):
            if not name.startswith("test_") or name == "test_no_silent_overrides":
                continue
            mine, theirs = getattr(type(self), name), getattr(base, name)
            if mine is not theirs:
                marks = [m.name for m in getattr(mine, "pytestmark", [])]
                assert "xfail" in marks, (f"{type(self).__name__}.{name} overrides a contract test "
                                          f"without @pytest.mark.xfail(reason=...)")
