"""`weightsync bench`: floors, naive baselines and every installed transport, end to end, on the
same synthetic models (see `harness` for what one run measures). Its own distribution
(`weightsync-bench`): core never imports it; it adds the `bench` command and the
`register_bench_rows` hook through core's hooks."""

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version

from weightsync_bench.harness import Bench, run_bench
from weightsync_bench.measure import (DELTA_DENSITY, PeakRss, Row, drop_cache, perturbed,
                                      push_detail, timed)
from weightsync_bench.verdicts import bar_chart, cpu_targets, table, verdicts

__all__ = ["DELTA_DENSITY", "Bench", "PeakRss", "Row", "bar_chart", "cpu_targets", "drop_cache",
           "perturbed", "push_detail", "run_bench", "table", "timed", "verdicts"]
