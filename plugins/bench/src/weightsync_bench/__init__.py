"""`weightsync bench`: floors, naive baselines and every installed transport, end to end, on the
same synthetic models (see `harness` for what one run measures). Its own distribution
(`weightsync-bench`): core never imports it; it adds the `bench` command and the
`register_bench_rows` hook through core's hooks."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync_bench.harness import Bench, run_bench
    from weightsync_bench.measure import (DELTA_DENSITY, PeakRss, Row, drop_cache, perturbed,
                                          push_detail, timed)
    from weightsync_bench.verdicts import bar_chart, cpu_targets, table

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version

_LAZY = {"Bench": "weightsync_bench.harness",
         "run_bench": "weightsync_bench.harness",
         "DELTA_DENSITY": "weightsync_bench.measure",
         "PeakRss": "weightsync_bench.measure",
         "Row": "weightsync_bench.measure",
         "drop_cache": "weightsync_bench.measure",
         "perturbed": "weightsync_bench.measure",
         "push_detail": "weightsync_bench.measure",
         "timed": "weightsync_bench.measure",
         "bar_chart": "weightsync_bench.verdicts",
         "cpu_targets": "weightsync_bench.verdicts",
         "table": "weightsync_bench.verdicts"}
# `verdicts` (the function) is not among them: the package's attribute of that name is its module


def __getattr__(name: str) -> Any:
    """The names load on first use, so the plugin's hooks (and `weightsync --help`) do not import
    torch."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["Bench", "DELTA_DENSITY", "PeakRss", "Row", "bar_chart", "cpu_targets", "drop_cache",
           "perturbed", "push_detail", "run_bench", "table", "timed"]
