"""The plugin registers the `ray` fleet source without importing Ray, `weightsync plugins` lists
it, and opening it where Ray is missing says how to install it. Runs with or without Ray
installed (Ray is hidden from a child interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

HIDE_RAY = "import sys; sys.modules['ray'] = None\n"     # `import ray` then fails as if missing


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", HIDE_RAY + code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_the_ray_source_registers_without_importing_ray() -> None:
    out = _run("import weightsync, weightsync_ray, weightsync_ray.fleet\n"
               "from weightsync.plugins import load_components\n"
               "print(sorted(load_components().fleets.names()))")
    assert out == "['ray', 'registry', 'static']"


def test_weightsync_plugins_lists_it() -> None:
    out = _run("import sys; from weightsync.cli import main\n"
               "sys.argv = ['weightsync', 'plugins', '--json']\nmain()")
    rows = {r["name"]: r for r in json.loads(out)}
    assert "fleet:ray" in rows["ray"]["components"]


def test_opening_it_without_ray_says_how_to_install() -> None:
    out = _run("from weightsync import WeightSync\n"
               "try:\n"
               "    WeightSync.from_config({'fleet': {'kind': 'ray'}})\n"
               "except Exception as e:\n"
               "    print(type(e).__name__, e)\n")
    assert out == ("RayMissing weightsync's Ray components need Ray on this machine: "
                   "pip install weightsync-ray")
