"""`weightsync demo`, the README's main job: an RL run whose rollouts come from live engines."""

from __future__ import annotations

import subprocess
import sys


def test_demo_main_job_is_an_rl_run_whose_reward_rises(tmp_path):
    """The README's main job: GRPO whose rollouts two engine processes sample through the router
    (one engine stopped and started again mid-run, catching up from its peer), a verified push
    every step; exit 0 only if the reward rose by the margin; the plot is written and the
    temporary directory removed. Run one step off-policy (`--async`): samples at most one
    version behind the trainer."""
    import os
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    png = tmp_path / "run.png"
    out = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--async", "--plot", str(png)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == 40 and all(" verified" in ln and "pause " in ln for ln in steps)
    stale = [float(ln.split("staleness ")[1].split()[0]) for ln in steps]
    assert max(stale) <= 1.0 and max(stale[2:]) > 0             # at most one version behind
    assert any("caught up to version 20 from its peer" in ln for ln in lines)
    summary = next(ln for ln in lines if ln.startswith("async loop, 40 steps: mean reward"))
    first, last = (float(x) for x in summary.split("reward ")[1].replace("(first 3 steps) ->", "")
                   .replace("(last 3)", "").split())
    assert last - first >= 0.15 and lines[-1] == "demo: OK"
    assert png.stat().st_size > 10_000 and f"plot: {png}" in lines
    assert [p for p in tmp_path.iterdir() if p.name.startswith("weightsync-demo-")] == []


def test_demo_fails_when_the_pushes_never_reach_the_engines(tmp_path):
    """The control run: the same loop without pushes keeps sampling the first weights; the
    reward does not rise and the demo exits 1 saying so."""
    out = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--no-push", "--steps", "6",
                          "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the reward did not rise by 0.15" in out.stdout
    assert out.stdout.splitlines()[-1] == "demo: FAILED"
