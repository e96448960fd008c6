"""`weightsync bench`: floors, naive baselines and every installed transport, end to end, on the
same synthetic models (see `harness` for what one run measures)."""

from .harness import Bench, run_bench
from .measure import DELTA_DENSITY, PeakRss, Row, drop_cache, perturbed, push_detail, timed
from .verdicts import bar_chart, cpu_targets, table, verdicts

__all__ = ["DELTA_DENSITY", "Bench", "PeakRss", "Row", "bar_chart", "cpu_targets", "drop_cache",
           "perturbed", "push_detail", "run_bench", "table", "timed", "verdicts"]
