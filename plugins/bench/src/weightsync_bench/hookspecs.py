"""The bench's own hook, added to weightsync's plugin manager through `add_hookspecs` (pytest's
`pytest_addhooks` pattern). A plugin that measures itself implements it with
`@hookimpl(optionalhook=True)`, so the plugin still loads where the bench is not installed."""

from __future__ import annotations

from typing import Any, Callable

from weightsync.hookspecs import hookspec

__all__ = ["register_bench_rows"]


@hookspec
def register_bench_rows(register: Callable[[Callable[[Any, dict[str, Any]], None]], None]) -> None:
    """Register extra rows for `weightsync bench`: each callable gets the running
    `weightsync_bench.Bench` and its LLM-shaped model, and appends its `Row`s to `bench.rows`
    (and any conclusions to `bench.extra_targets`), so a plugin measures itself next to core."""
