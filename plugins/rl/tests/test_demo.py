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
    reward does not rise and the demo exits 1 saying so (judged: 20 steps)."""
    import os
    out = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--no-push", "--steps", "20",
                          "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    # a run that failed keeps its directory: the engines' logs say why
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("weightsync-demo-")]
    assert f"kept the run's directory, with the engines' logs: {kept}" in out.stdout
    assert (kept / "engine-a.log").stat().st_size > 0
    assert "the reward did not rise by 0.15" in out.stdout
    assert out.stdout.splitlines()[-1] == "demo: FAILED"


def test_a_short_run_reports_its_reward_without_a_verdict(tmp_path):
    """`make demo STEPS=3`: the first lines say what runs, a sync loop's lines show nothing about
    generating during the push (its engines idle then by design), and a run this short reports
    the change of its reward, unjudged, and exits 0; its metrics are a JSON line a step."""
    import json
    png = tmp_path / "p.png"
    out = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--steps", "3",
                          "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("task: count on from a digit") and "3 steps, sync loop" in lines[0]
    assert lines[1].startswith("model: a 2-layer Llama over 16 tokens; engines: reference (two")
    assert lines[2] == f"metrics: a JSON line per step in {png.with_suffix('.jsonl')}"
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == 3 and not any("generating during the push" in ln for ln in out.stdout.splitlines())
    verdict = next(ln for ln in lines if ln.startswith("reward "))
    assert verdict.endswith("over 3 steps; not judged: a run of at least 20 steps must raise it by 0.15")
    assert lines[-1] == "demo: OK"
    rows = [json.loads(x) for x in png.with_suffix(".jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["weightsync_rl_push_ok"] == 1.0 for r in rows)
