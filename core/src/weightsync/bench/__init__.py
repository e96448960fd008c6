"""`weightsync bench`: floors, naive baselines and every installed transport, end to end, on the
same synthetic models (see `harness` for what one run measures)."""

from weightsync.bench.harness import Bench, run_bench
from weightsync.bench.measure import (DELTA_DENSITY, PeakRss, Row, drop_cache, perturbed,
                                      push_detail, timed)
from weightsync.bench.verdicts import bar_chart, cpu_targets, table, verdicts

__all__ = ["DELTA_DENSITY", "Bench", "PeakRss", "Row", "bar_chart", "cpu_targets", "drop_cache",
           "perturbed", "push_detail", "run_bench", "table", "timed", "verdicts"]
