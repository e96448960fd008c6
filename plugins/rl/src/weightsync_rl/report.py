"""What an RL run prints and plots: a line per step, a summary, and a PNG of the series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightsync_rl.loop import StepStats

MARGIN = 0.15           # the rise of the mean reward (first 3 steps -> last 3) a run must show
WINDOW = 3
JUDGED_FROM = 20        # steps: a shorter run reports the change of its reward, unjudged


def first_last(stats: list[StepStats]) -> tuple[float, float]:
    if not stats:
        return 0.0, 0.0
    w = min(WINDOW, len(stats))
    return (sum(s.reward for s in stats[:w]) / w, sum(s.reward for s in stats[-w:]) / w)


def print_step(st: StepStats, mode: str = "async") -> None:
    """One line a step; what the engines generated during the push only where the loop can
    generate then (async: a sync loop's engines idle through every push by design)."""
    busy = (" | generating during the push: " + ", ".join(f"{k} {v:.0%}" for k, v in st.busy_in_push.items())
            if st.busy_in_push and mode == "async" else "")
    note = f" | {st.error}" if st.error else ""
    print(f"step {st.step:>3}: reward {st.reward:.3f} | {st.samples} samples"
          f"{f' ({st.dropped} stale dropped)' if st.dropped else ''}"
          f"{f' ({st.unknown} of unknown versions)' if st.unknown else ''}"
          f"{f' ({st.mixed} across a swap)' if st.mixed else ''} staleness {st.staleness:.2f}"
          f" | gap mean {st.gap_mean:.2e} max {st.gap_max:.2e} | sync {st.sync_seconds:.3f}s "
          f"pause {st.pause_window:.3f}s{' verified' if st.verified else ''}{busy}{note}",
          flush=True)


def print_summary(stats: list[StepStats], idle: dict[str, float], first: float, last: float,
                  mode: str) -> None:
    if not stats:
        return
    n = len(stats)
    sync = sum(s.sync_seconds for s in stats)
    waited = sum(s.rollout_seconds for s in stats)
    print(f"\n{mode} loop, {n} steps: mean reward {first:.3f} (first {min(WINDOW, n)} steps) -> "
          f"{last:.3f} (last {min(WINDOW, n)})")
    print(f"  sync {sync:.2f}s in all ({sync / n:.3f}s a step), longest pause "
          f"{max(s.pause_window for s in stats):.3f}s, trainer waited {waited:.2f}s for rollouts")
    print(f"  samples trained on {sum(s.samples for s in stats)}, dropped as stale "
          f"{sum(s.dropped for s in stats)}, spanning a swap {sum(s.mixed for s in stats)}, "
          f"mean staleness "
          f"{sum(s.staleness for s in stats) / n:.2f}")
    print(f"  train-inference gap: mean {sum(s.gap_mean for s in stats) / n:.2e}, max "
          f"{max(s.gap_max for s in stats):.2e} |Δ logprob|")
    if idle:
        print("  engines idle (not generating) " + ", ".join(f"{k} {v:.0%}" for k, v in idle.items())
              + " of the run's wall time")
    pushes = [min(s.busy_in_push.values()) for s in stats if s.busy_in_push]
    if pushes and mode == "async":
        print(f"  during pushes the engines generated {sum(pushes) / len(pushes):.0%} of the time "
              f"(mean over pushes of the least busy engine)")
    busy = [min(s.busy_in_push.values()) for s in stats if s.busy_in_push and s.rollouts_in_push]
    if any(s.busy_in_push for s in stats) and mode == "async":
        print(f"  {len(busy)} of {len(stats)} pushes began while the next rollouts were being "
              f"generated" + (f"; through those the engines generated "
                              f"{sum(busy) / len(busy):.0%} of the time" if busy else
                              " (the engines had finished them during training)"))


def plot(stats: list[StepStats], path: Path, title: str) -> str:
    """Reward, sync seconds, pause window, staleness and gap per step, as a PNG at `path`."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped (matplotlib is not installed: pip install 'weightsync-rl[plot]')"
    steps = [s.step for s in stats]
    series: list[tuple[str, list[Any]]] = [
        ("mean reward", [s.reward for s in stats]),
        ("sync seconds / pause window", [(s.sync_seconds, s.pause_window) for s in stats]),
        ("staleness (versions)", [s.staleness for s in stats]),
        ("train-inference gap, max |Δ logprob|", [s.gap_max for s in stats])]
    fig, axes = plt.subplots(len(series), 1, figsize=(7, 9), sharex=True)
    for ax, (name, ys) in zip(axes, series):
        if ys and isinstance(ys[0], tuple):
            ax.plot(steps, [y[0] for y in ys], marker=".", label="sync")
            ax.plot(steps, [y[1] for y in ys], marker=".", label="pause")
            ax.legend()
        else:
            ax.plot(steps, ys, marker=".")
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"weightsync GRPO demo ({title})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)
