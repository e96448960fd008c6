"""The main job: a GRPO run whose rollouts come from live engines. A tiny causal LM learns a
counting task (scored by plain code) on CPU; every rollout is sampled by the engines through one
router URL, with the logprob of every token and the weight version on every sample; the weights
are pushed after every step, verified and probed.

With the reference engine the fleet changes under the run: two engines register with the
trainer's registry, one is stopped halfway and started again, and catches up from its peer before
the next push. Each step prints the mean reward, the sync seconds, the pause window, the
staleness and the train–inference gap; the run ends with the first and last mean reward. A run
of at least `JUDGED_FROM` steps fails (exit 1) unless the reward rose by `MARGIN` (a loop whose
pushes never reach the engines does not); a shorter one reports the change and is not judged. A
PNG of the series and a JSON line per step are written next to the run."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from weightsync_rl.metrics import MetricsLog
from weightsync_rl.report import JUDGED_FROM, MARGIN, first_last, plot, print_step, print_summary

PROMPTS, GROUP, LR, EPOCHS, SEED = 32, 8, 3e-3, 4, 1


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def run_demo(engine: str = "reference", steps: int = 40, workdir: str | None = None,
             mode: str = "sync", push: bool = True, plot_path: str | None = None,
             metrics_path: str | None = None, tensorboard: str | None = None,
             wandb: str | None = None) -> int:
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    png = Path(plot_path) if plot_path else Path.cwd() / f"weightsync-demo-{engine}-{mode}.png"
    jsonl = Path(metrics_path) if metrics_path else png.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)                    # this run's steps only
    log = MetricsLog(jsonl, tensorboard=tensorboard, wandb=wandb)
    print(f"task: count on from a digit (after a, write a+1 .. a+4 mod 10; reward: the fraction "
          f"right), GRPO, {PROMPTS} prompts x {GROUP} samples a step, {steps} steps, {mode} loop"
          + ("" if push else ", no pushes (the control run)"))
    print(f"model: a 2-layer Llama over 16 tokens; engines: {engine} "
          + ("(two, registering with the trainer's registry; one is restarted halfway)"
             if engine == "reference" else "(one, started on this machine)"))
    print(f"metrics: a JSON line per step in {jsonl}"
          + (f", TensorBoard in {tensorboard}" if tensorboard else "")
          + (f", wandb project {wandb}" if wandb else ""), flush=True)
    ok = False
    try:
        ok = _run(engine, steps, work, mode, push, png, log)
    finally:
        log.close()
        if workdir is None and ok:
            shutil.rmtree(work, ignore_errors=True)
        elif workdir is None:               # the engines' logs say why: kept
            print(f"kept the run's directory, with the engines' logs: {work}")
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


def build_demo_model(model_dir: Path) -> torch.nn.Module:
    """The demo's policy: a 2-layer Llama over the task's 16 tokens, saved to `model_dir`. One
    head of 64: vLLM's CPU attention has kernels for head sizes such as 64, not 16."""
    from weightsync_rl.task import VOCAB
    from weightsync_reference.models import build_tiny_model
    torch.manual_seed(0)
    return build_tiny_model(model_dir, "llama", vocab=VOCAB, hidden=64, intermediate=128,
                            heads=1, kv_heads=1)


def _setup(model_dir: Path) -> tuple[Any, Any]:
    model = build_demo_model(model_dir)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def _run(engine: str, steps: int, work: Path, mode: str, push: bool, png: Path,
         log: MetricsLog) -> bool:
    from weightsync import WeightSync
    from weightsync.plugins import load_components
    from weightsync_rl.loop import RLLoop
    from weightsync_rl.rollout import RolloutClient
    from weightsync_rl.task import CountingTask
    from weightsync_rl.rollout import RolloutRouter, SamplingParams
    from weightsync_rl.rollout.remote import RouterClient

    components = load_components()
    adapter = components.adapters.get(engine)
    launcher = components.launchers.get(engine)
    model, opt = _setup(work / "model")
    fleet = engine == "reference"
    key = "demo-fleet-key-0123456789"
    config: dict[str, Any] = {
        "adapter": engine, "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}},
        "sync": {"progress": "off", "failure_policy": "continue"}}
    if mode == "async" and "keep" in adapter.pause_modes:
        # generation that spans the swap freezes for it and goes on with the new weights
        # (the loop keeps such samples) instead of being aborted and generated again
        config["sync"]["pause_mode"] = "keep"
    started: dict[str, Any] = {}
    if fleet:
        config["fleet"] = {"kind": "registry", "options": {"lease": 2.0, "api_key": key}}
    else:
        print(f"starting {engine} on the demo model ...", flush=True)
        started["engine"] = launcher.launch_local(work / "model", work, "engine")
        config["engines"] = [started["engine"].spec]
    ok = True
    with WeightSync.from_config(config, components=components) as sync:
        def launch(name: str) -> None:
            url = sync.fleet_url
            assert url is not None              # a registry fleet's
            args = ["--fleet", url, "--fleet-key", key]
            started[name] = launcher.launch_local(work / "model", work, name, extra_args=args)
        if fleet:
            for n in ("engine-a", "engine-b"):
                launch(n)
            _wait(lambda: len(sync.fleet.members()) == 2, 30)
        client = RolloutClient.of(sync)
        router_key = secrets.token_urlsafe(24)          # the demo's own caller only
        with RolloutRouter(client, api_key=router_key) as router:
            print(f"engines: {', '.join(started)}; rollouts through the router at {router.url}"
                  + (f"; fleet registry at {sync.fleet_url}" if fleet else "") + f"; workdir {work}")
            rc = RouterClient(router.url, api_key=router_key)
            loop = RLLoop(model, opt, sync if push else _NoPush(sync), rc.sample,
                          CountingTask(seed=1), SamplingParams(n=GROUP, temperature=1.0,
                                                               max_new_tokens=4, seed=SEED),
                          prompts_per_step=PROMPTS, mode=mode, epochs=EPOCHS,
                          busy=lambda: _busy(sync, components),
                          # the control run's pushes never land on purpose: it must not stop
                          max_failed_pushes=3 if push else None, metrics=log)
            stats = []
            stop_at = steps // 2
            # the step size decays linearly to 0 over the run: at a constant one the policy
            # passed its peak reward and fell back (sync 0.91 -> 0.67, one step off-policy
            # 0.63 -> 0.15 over the last 20 of 40 steps)
            decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(0.0, 1 - i / steps))
            try:
                for st in loop.run(steps):
                    decay.step()
                    stats.append(st)
                    print_step(st, mode)
                    ok &= st.error is None or not push
                    # the control run (no pushes) has no version for engine-b to catch up to
                    if fleet and push and st.step == stop_at:
                        ok &= _restart(started, launch, sync, st.step)
            finally:
                for e in started.values():
                    e.stop()
    first, last = first_last(stats)
    rose = last - first >= MARGIN
    judged = len(stats) >= JUDGED_FROM
    ok &= rose or not judged
    print_summary(stats, loop.idle_fraction(), first, last, mode)
    print(f"plot: {plot(stats, png, f'{engine}, {mode}')}")
    if not judged:
        print(f"reward {first:.3f} -> {last:.3f} ({last - first:+.3f}) over {len(stats)} steps; "
              f"not judged: a run of at least {JUDGED_FROM} steps must raise it by {MARGIN}")
    elif not rose:
        print(f"the reward did not rise by {MARGIN}: {first:.3f} -> {last:.3f}")
    return ok


def _busy(sync: Any, components: Any) -> dict[str, float]:
    """Seconds each engine has spent generating (engines whose sampler reports it)."""
    from weightsync_rl.rollout import sampler_for
    out = {}
    for a in sync.adapters:
        try:
            b = sampler_for(a, components).busy_seconds()
        except Exception:  # noqa: BLE001 - an engine that does not answer is left out
            continue
        if b is not None:
            out[a.engine_name] = b
    return out


def _restart(started: dict[str, Any], launch: Callable[[str], None], sync: Any, step: int) -> bool:
    started["engine-b"].stop()               # SIGTERM: it deregisters
    print(f"        engine-b stopped after step {step}; engine-a serves the rollouts alone")
    launch("engine-b")
    caught = _wait(lambda: any(m.name == "engine-b" and m.version == step
                               for m in sync.fleet.members()), 60)
    print(f"        engine-b started again at version 0 and caught up to version {step} from its "
          f"peer (digests checked)" if caught else "        engine-b did not catch up in time")
    return caught


class _NoPush:
    """A loop whose pushes never reach the engines (`--no-push`): the control run that must fail."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync

    def push(self, model: Any, version: int) -> None:
        return None

    def record_gap(self, *a: Any) -> None:
        self.sync.record_gap(*a)
