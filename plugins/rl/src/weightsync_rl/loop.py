"""An RL loop on weightsync: rollouts from the engines, a GRPO update, a push after every step.

`mode="sync"`: generate with version t, train, push t+1, generate with t+1, ... (the engines idle
while the trainer trains and pushes). `mode="async"`: the rollouts of the next step are generated
while this step trains and its weights are pushed (one step off-policy, as verl's and AReaL's
async loops: the engines keep generating through the push, and pause only for the swap);
samples older than `max_staleness` versions are dropped and counted. A sample whose generation
spans the swap is kept, as AReaL's interruptible generation keeps it: its tokens carry the
logprobs of the version that sampled each of them, which is all the clipped importance ratio
needs, and it counts as old as its first version (`mixed` in the step's stats; the gap, which
needs one version per sample, skips it). Refusing it instead (`keep_mixed=False`) costs a second
generation of it after every swap. Every step measures the train–inference gap (the trainer's
logprobs of the sampled tokens under the version that generated them, against the engines') per
engine and version, and, when `busy` is given, how much of the push the engines spent generating.

    loop = RLLoop(model, opt, sync, client.sample, CountingTask(), SamplingParams(n=8),
                  mode="async")
    for st in loop.run(steps=24):
        print(st.step, st.reward, st.gap_max, st.sync_seconds)
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from weightsync.errors import SyncError
from weightsync.interfaces.sampling import Sample, SamplingParams
from weightsync_rl import grpo

Sampler = Callable[..., list[Sample]]       # (prompts, params, min_version=...) -> Samples


@dataclass
class StepStats:
    step: int
    version: int                             # the version pushed after this step's update
    reward: float
    samples: int
    dropped: int                             # samples older than max_staleness, not trained on
    mixed: int                               # kept samples whose generation spanned a swap
    staleness: float                         # mean versions between a sample and the trainer
    gap_mean: float
    gap_max: float
    gaps: dict[str, dict[str, float]]        # "engine@version" -> mean, max |Δ logprob|
    loss: float
    rollout_seconds: float                   # the trainer waited this long for its rollouts
    sync_seconds: float
    pause_window: float
    push_ok: bool
    verified: bool
    busy_in_push: dict[str, float] = field(default_factory=dict)   # engine -> fraction
    rollouts_in_push: bool = False           # the next step's rollouts were still being generated
                                             # when the push began (async)
    error: str | None = None


class RLLoop:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync: Any,
                 sampler: Sampler, task: Any, params: SamplingParams, *, prompts_per_step: int = 16,
                 mode: str = "sync", max_staleness: int = 1, clip: float = 0.2, epochs: int = 2,
                 busy: Callable[[], dict[str, float]] | None = None, wait: float = 60.0,
                 keep_mixed: bool = True) -> None:
        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: use 'sync' or 'async'")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.model, self.opt, self.sync, self.sampler = model, optimizer, sync, sampler
        self.task, self.params, self.prompts_per_step = task, params, prompts_per_step
        self.mode, self.max_staleness, self.clip, self.epochs = mode, max_staleness, clip, epochs
        self.busy, self.wait = busy, wait
        # only the async loop can see a swap during generation (sync generates between pushes)
        self.mixed = "keep" if keep_mixed and mode == "async" else "retry"
        self.version = 0                     # what the engines were last pushed (0: the start)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ws-rl-rollouts")
        self.busy_total: dict[str, float] = {}
        self._requests = 0
        self._fresh = True                   # the model's weights are those of self.version
        self.wall = 0.0

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def _request(self, min_version: int) -> Future:
        prompts = self.task.prompts(self.prompts_per_step)
        params = self.params
        if params.seed is not None:           # a seeded run draws new samples every step
            self._requests += 1
            params = params.model_copy(update={"seed": params.seed + self._requests * 100_003})
        return self._pool.submit(self.sampler, prompts, params, min_version=min_version,
                                 wait=self.wait, mixed=self.mixed)

    def run(self, steps: int) -> Iterator[StepStats]:
        t0 = time.perf_counter()
        b0 = self.busy() if self.busy else {}
        pending = self._request(0)
        try:
            for step in range(1, steps + 1):
                t = time.perf_counter()
                samples = pending.result()
                waited = time.perf_counter() - t
                if self.mode == "async" and step < steps:
                    # the next step's rollouts are generated while this step trains and its
                    # version is pushed: the engines keep generating through the push and swap
                    # under it; they come from the version the engines hold now (one behind the
                    # trainer when it trains on them), or the next one after the swap
                    pending = self._request(max(0, self.version + 1 - self.max_staleness))
                st = self._train(step, samples, waited)
                st.rollouts_in_push = self.mode == "async" and step < steps and not pending.done()
                self._push(step, st)
                if self.mode == "sync" and step < steps:
                    pending = self._request(self.version)
                yield st
        finally:
            pending.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self.wall = time.perf_counter() - t0
            if self.busy:
                b1 = self.busy()
                self.busy_total = {k: b1[k] - b0.get(k, 0.0) for k in b1}

    def idle_fraction(self) -> dict[str, float]:
        """Per engine: the share of the loop's wall time it was not generating."""
        return {k: max(0.0, 1 - v / self.wall) for k, v in self.busy_total.items()} if self.wall else {}

    # -- one step ---------------------------------------------------------------------------------
    def _train(self, step: int, samples: list[Sample], waited: float) -> StepStats:
        keep = [s for s in samples if self.version - s.version <= self.max_staleness]
        rewards = [self.task.reward(s.prompt_ids, s.token_ids) for s in samples]
        kept_r = [self.task.reward(s.prompt_ids, s.token_ids) for s in keep]
        st = StepStats(step, step, sum(rewards) / max(len(rewards), 1), len(keep),
                       len(samples) - len(keep), sum(s.mixed for s in keep), 0.0, 0.0, 0.0, {},
                       0.0, waited, 0.0, 0.0, False, False)
        if not keep:
            st.error = "no sample within max_staleness: nothing to train on"
            return st
        st.staleness = sum(self.version - s.version for s in keep) / len(keep)
        batch = grpo.make_batch(keep, grpo.advantages(keep, kept_r))
        self.model.train()
        proximal = None                          # the trainer's logprobs before this step
        for epoch in range(self.epochs):        # PPO-style passes over the same samples
            loss, lp = grpo.loss(self.model, batch, self.clip, proximal)
            if epoch == 0:
                proximal = lp
                self._gaps(keep, batch, lp, st)  # the weights that are still this version's
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self._fresh = False
            st.loss = float(loss.detach())
        return st

    @torch.no_grad()
    def _gaps(self, keep: list[Sample], batch: grpo.Batch, lp_now: torch.Tensor, st: StepStats) -> None:
        """The gap under the version that generated each sample: the current weights for this
        version (the loss's own forward pass), a kept snapshot for older ones. Samples that span
        a swap are left out: no one version generated them."""
        one = [i for i, s in enumerate(keep) if not s.mixed]
        if not one:
            return
        lp = lp_now.clone()
        for v in sorted({keep[i].version for i in one}):
            if v == self.version and self._fresh:
                continue                         # the loss's forward pass ran these weights
            rows = [i for i in one if keep[i].version == v]
            lp[rows] = grpo.token_logprobs(self.model, batch.rows(rows), self.snapshots[v])
        whole = grpo.gap(lp[one], batch.rows(one))
        st.gap_mean, st.gap_max = whole["mean"], whole["max"]
        for key in sorted({(keep[i].engine, keep[i].version) for i in one}):
            rows = [i for i in one if (keep[i].engine, keep[i].version) == key]
            g = grpo.gap(lp[rows], batch.rows(rows))
            st.gaps[f"{key[0]}@{key[1]}"] = g
            try:
                self.sync.record_gap(key[0], key[1], g["mean"], g["max"])
            except AttributeError:
                pass

    def _push(self, step: int, st: StepStats) -> None:
        before = self.busy() if self.busy else {}
        t = time.perf_counter()
        try:
            r = self.sync.push(self.model, version=step)
        except SyncError as e:
            r = e.report
            st.error = str(e).splitlines()[0]
        st.sync_seconds = time.perf_counter() - t
        if self.busy:
            after = self.busy()
            st.busy_in_push = {k: min(1.0, (after[k] - before.get(k, 0.0)) / max(st.sync_seconds, 1e-9))
                               for k in after if k in before}
        if r is not None:
            st.pause_window, st.push_ok, st.verified = r.pause_window, r.ok, r.verified
            if any(o.ok for o in r.engines.values()):
                self.version = step
                self.snapshots[step] = self._snapshot()
                self._fresh = True
        for v in [v for v in self.snapshots if v < self.version - self.max_staleness]:
            del self.snapshots[v]
