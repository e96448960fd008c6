"""Per-step metrics of the RL loop where RL users look: a JSON-lines file (one object a step),
and, as optional extras, TensorBoard (`weightsync-rl[tensorboard]`, through torch's
`SummaryWriter`) and Weights & Biases (`weightsync-rl[wandb]`, `wandb.init` / `run.log`). A name
is that of weightsync's Prometheus series where one exists (`weightsync_version`,
`weightsync_pause_window_seconds`, `weightsync_logprob_gap{engine,stat}`); the loop's own start
with `weightsync_rl_`. TensorBoard and wandb take a series' labels as path parts
(`weightsync_logprob_gap/engine=a/stat=max`)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "step_metrics"]


def step_metrics(st: Any) -> dict[str, float]:
    """A `StepStats` as flat metrics: the loop's numbers and the train–inference gap per engine
    (mean of its versions' means, max of their maxima)."""
    m = {"weightsync_version": st.version, "weightsync_rl_reward": st.reward,
         "weightsync_rl_loss": st.loss, "weightsync_rl_samples": st.samples,
         "weightsync_rl_dropped": st.dropped, "weightsync_rl_mixed": st.mixed,
         "weightsync_rl_unknown": st.unknown, "weightsync_rl_staleness": st.staleness,
         "weightsync_rl_corrected": st.corrected, "weightsync_rl_kl": st.kl,
         "weightsync_rl_rollout_seconds": st.rollout_seconds,
         "weightsync_rl_sync_seconds": st.sync_seconds,
         "weightsync_pause_window_seconds": st.pause_window,
         "weightsync_rl_push_ok": st.push_ok, "weightsync_rl_failed_pushes": st.failed_pushes}
    engines: dict[str, list[dict[str, float]]] = {}
    for key, g in st.gaps.items():
        engines.setdefault(key.rsplit("@", 1)[0], []).append(g)
    for engine, gaps in sorted(engines.items()):
        m[f'weightsync_logprob_gap{{engine="{engine}",stat="mean"}}'] = \
            sum(g["mean"] for g in gaps) / len(gaps)
        m[f'weightsync_logprob_gap{{engine="{engine}",stat="max"}}'] = max(g["max"] for g in gaps)
    return {k: float(v) for k, v in m.items()}


def tag(name: str) -> str:
    """A series name as a TensorBoard / wandb key: labels become path parts."""
    base, _, labels = name.partition("{")
    parts = re.findall(r'(\w+)="([^"]*)"', labels)
    return "/".join([base, *(f"{k}={v}" for k, v in parts)])


class MetricsLog:
    """Where `RLLoop(metrics=...)` writes each step: `jsonl` a file path, `tensorboard` a log
    directory, `wandb` a project name or `wandb.init` keyword arguments. An extra that is not
    installed is refused here, saying what to install, before any step runs."""

    def __init__(self, jsonl: str | Path | None = None, *, tensorboard: str | Path | None = None,
                 wandb: str | dict[str, Any] | None = None) -> None:
        self.file = None
        self.writer: Any = None
        self.run: Any = None
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("TensorBoard logging needs the tensorboard package: pip install "
                                  "'weightsync-rl[tensorboard]'") from None
            self.writer = SummaryWriter(log_dir=str(tensorboard))
        if wandb is not None:
            try:
                import wandb as wb
            except ImportError:
                raise ImportError("wandb logging needs the wandb package: pip install "
                                  "'weightsync-rl[wandb]'") from None
            self.run = wb.init(**({"project": wandb} if isinstance(wandb, str) else wandb))
        if jsonl is not None:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(jsonl, "a", encoding="utf-8")

    def log(self, st: Any) -> dict[str, float]:
        m = step_metrics(st)
        if self.file is not None:
            self.file.write(json.dumps({"step": st.step, "time": time.time(), **m}) + "\n")
            self.file.flush()
        if self.writer is not None:
            for k, v in m.items():
                self.writer.add_scalar(tag(k), v, st.step)
            self.writer.flush()
        if self.run is not None:
            self.run.log({tag(k): v for k, v in m.items()}, step=st.step)
        return m

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
