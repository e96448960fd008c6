"""The bench's own hook, `register_bench_rows`: added to weightsync's plugin manager by the bench
plugin (`add_hookspecs`); a plugin's rows land in the run's rows and targets."""

from __future__ import annotations

import argparse
import tempfile

import torch

from weightsync import hookimpl, make_plugin_manager
from weightsync_bench import Bench, Row, cpu_targets, hookspecs, timed


def test_the_bench_adds_its_hook_to_the_installed_manager() -> None:
    pm = make_plugin_manager()
    assert pm.get_plugin("bench") is not None
    assert hasattr(pm.hook, "register_bench_rows")
    assert "disk_delta" in [i.plugin_name for i in pm.hook.register_bench_rows.get_hookimpls()]


def test_hook_register_bench_rows() -> None:
    """A plugin's bench rows are found through the hook and land in the run's rows and targets."""
    def copy_row(bench: Bench, model: dict[str, torch.Tensor]) -> None:
        n = sum(t.numel() * t.element_size() for t in model.values())
        row = timed("copy (plugin)", "reference", n, 1, lambda: {k: t.clone() for k, t in model.items()},
                    bench.repeat, log=bench.log)
        bench.rows.append(row)
        bench.extra_targets["copy_plugin"] = {"value": row.bytes, "target": None, "met": None}

    class Plugin:
        @hookimpl
        def register_bench_rows(self, register):
            register(copy_row)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.add_hookspecs(hookspecs)
    pm.register(Plugin(), name="copy-row-plugin")
    assert Bench.plugin_rows(pm) == [copy_row]
    bench = Bench(argparse.Namespace(size="1MiB", receivers=1, bucket="1MiB", repeat=2,
                                     workdir=tempfile.gettempdir()), log=lambda line: None)
    for fn in Bench.plugin_rows(pm):
        fn(bench, {"w": torch.ones(512, 512, dtype=torch.bfloat16)})
    assert [type(r) for r in bench.rows] == [Row] and len(bench.rows[0].runs) == 2
    assert cpu_targets(bench, {r.name: r for r in bench.rows})["copy_plugin"]["value"] == 512 * 512 * 2


