"""An RL loop on weightsync: rollouts from the engines, a GRPO update, a push after every step.

`mode="sync"`: generate with version t, train, push t+1, generate with t+1, ... (the engines idle
while the trainer trains and pushes). `mode="async"`: the rollouts of the next step are generated
while this step trains and its weights are pushed (one step off-policy, as verl's and AReaL's
async loops: the engines keep generating through the push, and pause only for the swap);
samples older than `max_staleness` versions are dropped and counted. A sample whose generation
spans the swap is kept, as AReaL's interruptible generation keeps it: its tokens carry the
logprobs of the version that sampled each of them, which is all the clipped importance ratio
needs, and it counts as old as its first version (`mixed` in the step's stats). Engines prefill such a
generation again with the new weights at the swap (unless paused with a mode that keeps the stale
KV cache), so the gap measures each of its tokens under the version that sampled it; samples
over a stale cache are left out of the gap. Refusing mixed samples instead (`keep_mixed=False`)
costs a second generation of each after every swap. Every step measures the train–inference gap (the trainer's
logprobs of the sampled tokens under the version that generated them, against the engines') per
engine and version, and, when `busy` is given, how much of the push the engines spent generating.

Versions are labels of weights the loop holds, checked against what the engines report, never a
step counter: every push gets a new label (the last one + 1, landed or not) and a snapshot of the
weights it sent, taken before the outcome is known, so a commit whose answer was lost still has
its weights. A step trains the weights of the last label pushed (`StepStats.trained_version`);
staleness is that label minus a sample's version, and `max_staleness` drops samples against it.
A sample of a version the loop did not push (another trainer's) is not trained on and counted
(`unknown`). Policies: engines already ahead when `run` starts (an earlier run pushed them): the
loop's labels go on above the fleet's version and its weights are pushed first, before any
rollout; `max_failed_pushes` pushes in a row that no engine took: `run` raises `PushesFailed`
rather than train on ever older rollouts. Each token's importance weight (trainer over engine)
is corrected as `correction` says (`grpo.correction`: truncated or masked, per token or per
sequence), and every step reports the share of tokens cut and the engine-to-trainer KL.

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
    version: int                             # the label pushed after this step's update
    reward: float
    samples: int
    dropped: int                             # samples older than max_staleness, not trained on
    mixed: int                               # kept samples whose generation spanned a swap
    staleness: float                         # mean of trained_version - sample version (the kept
                                             # samples; none kept: the dropped ones)
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
    trained_version: int = 0                 # the label of the weights this step's update started
                                             # from (the last push's, whether it landed or not)
    unknown: int = 0                         # samples of versions the loop did not push: not
                                             # trained on, no gap measured
    failed_pushes: int = 0                   # pushes in a row no engine took, this step's included
    corrected: float = 0.0                   # share of tokens whose importance weight was cut
    kl: float = 0.0                          # KL(engine || trainer) over the sampled tokens (k3)


class PushesFailed(SyncError):
    """`max_failed_pushes` pushes in a row that no engine took: the loop stops instead of training
    on while the engines generate with weights further and further behind. `report`: the last
    push's report (None: none came back); `stats`: the last step's (None: the push before the
    first rollouts)."""

    def __init__(self, message: str, report: object | None = None,
                 stats: StepStats | None = None) -> None:
        super().__init__(message, report)
        self.stats = stats


def _why(e: BaseException) -> str:
    """A push error in one line: its headline and the first engine's reason."""
    return " ".join(ln.strip() for ln in str(e).splitlines()[:2])


class RLLoop:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync: Any,
                 sampler: Sampler, task: Any, params: SamplingParams, *, prompts_per_step: int = 16,
                 mode: str = "sync", max_staleness: int = 1, clip: float = 0.2, epochs: int = 2,
                 busy: Callable[[], dict[str, float]] | None = None, wait: float = 60.0,
                 keep_mixed: bool = True, max_failed_pushes: int | None = 3,
                 correction: str = "token_truncate", correction_cap: float = 5.0,
                 metrics: Any = None) -> None:
        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: use 'sync' or 'async'")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if correction not in grpo.CORRECTIONS:
            raise ValueError(f"correction {correction!r}: use one of {', '.join(grpo.CORRECTIONS)}")
        if correction_cap <= 0:
            raise ValueError("correction_cap must be > 0")
        self.correction, self.correction_cap = correction, correction_cap
        self.metrics = metrics               # a metrics.MetricsLog: each step's stats, as they come
        if max_failed_pushes is not None and max_failed_pushes < 1:
            raise ValueError("max_failed_pushes must be >= 1 (None: never stop)")
        self.model, self.opt, self.sync, self.sampler = model, optimizer, sync, sampler
        self.task, self.params, self.prompts_per_step = task, params, prompts_per_step
        self.mode, self.max_staleness, self.clip, self.epochs = mode, max_staleness, clip, epochs
        self.busy, self.wait, self.max_failed_pushes = busy, wait, max_failed_pushes
        # only the async loop can see a swap during generation (sync generates between pushes)
        self.mixed = "keep" if keep_mixed and mode == "async" else "retry"
        self.label = 0                       # the model's weights at a step's start: the last push's
        self.version = 0                     # the newest version the engines are known to hold
        self.resumed: int | None = None      # the fleet's version the loop went on above, if ahead
        # label -> the weights pushed under it, while a sample of it could still be trained on
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        self._failing: list[tuple[int, str]] = []    # (label, why): pushes in a row no engine took
        self._last_report: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ws-rl-rollouts")
        self.busy_total: dict[str, float] = {}
        self._requests = 0
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
        """Yield each step's stats. Raises PushesFailed after `max_failed_pushes` pushes in a row
        that no engine took (once the step of the last one is yielded)."""
        t0 = time.perf_counter()
        b0 = self.busy() if self.busy else {}
        pending: Future | None = None
        try:
            self._resume()
            pending = self._request(self.version)
            for step in range(1, steps + 1):
                t = time.perf_counter()
                samples = pending.result()
                waited = time.perf_counter() - t
                self._seen(samples)
                if self.mode == "async" and step < steps:
                    # the next step's rollouts are generated while this step trains and its
                    # version is pushed: the engines keep generating through the push and swap
                    # under it; they come from the version the engines hold now (one behind the
                    # trainer when it trains on them), or the next one after the swap
                    pending = self._request(max(0, self.version + 1 - self.max_staleness))
                st = self._train(step, samples, waited)
                st.rollouts_in_push = self.mode == "async" and step < steps and not pending.done()
                self._push(st)
                if self.mode == "sync" and step < steps:
                    pending = self._request(self.version)
                if self.metrics is not None:
                    self.metrics.log(st)
                yield st
                self._stop_if_failing(st)
        finally:
            if pending is not None:
                pending.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self.wall = time.perf_counter() - t0
            if self.busy:
                b1 = self.busy()
                self.busy_total = {k: b1[k] - b0.get(k, 0.0) for k in b1}

    def idle_fraction(self) -> dict[str, float]:
        """Per engine: the share of the loop's wall time it was not generating."""
        return {k: max(0.0, 1 - v / self.wall) for k, v in self.busy_total.items()} if self.wall else {}

    # -- versions ---------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Engines already ahead of the loop (an earlier run pushed them) hold weights the loop
        does not have: its labels go on above the fleet's version, and its own weights are
        pushed before any rollout, so that what it trains on comes from weights it holds. A sync
        that cannot say its fleet's version (no `fleet_version`) is taken to be where the loop is."""
        ask = getattr(self.sync, "fleet_version", None)
        if ask is None:
            return
        known = [v for v in (ask(), getattr(self.sync, "last_version", None)) if v is not None]
        ahead = max(known, default=None)
        if ahead is None or ahead <= self.label:
            return
        self.resumed = self.version = self.label = int(ahead)
        self.snapshots.clear()               # the loop's weights are not what the engines hold
        self._push(None)
        self._stop_if_failing(None)

    def _known(self) -> set[int]:
        """The labels this loop pushed whose samples it could still train on or learn from."""
        return set(self.snapshots) | {v for v, _ in self._failing}

    def _seen(self, samples: list[Sample]) -> None:
        """A sample of a label the loop pushed shows an engine took it, even if the push's answer
        was lost: the engines hold at least that version, and the failures before it are void."""
        known = self._known()
        held = [s.version_end for s in samples if s.version_end in known]
        if held and max(held) > self.version:
            self.version = max(held)
            self._failing = [f for f in self._failing if f[0] > self.version]

    def _stop_if_failing(self, st: StepStats | None) -> None:
        n = self.max_failed_pushes
        if n is None or len(self._failing) < n:
            return
        labels = ", ".join(str(v) for v, _ in self._failing)
        raise PushesFailed(
            f"{len(self._failing)} pushes in a row were taken by no engine (versions {labels}); "
            f"the last: {self._failing[-1][1]}. The engines hold version {self.version}, "
            f"{self.label - self.version} updates behind the trained weights: the loop stops "
            f"rather than train on ever older rollouts (RLLoop's max_failed_pushes={n} sets how "
            f"many failed pushes in a row it allows; None: never stop)", self._last_report, st)

    # -- one step ---------------------------------------------------------------------------------
    def _train(self, step: int, samples: list[Sample], waited: float) -> StepStats:
        now = self.label
        fresh = [s for s in samples if now - s.version <= self.max_staleness]
        stale = [s for s in samples if now - s.version > self.max_staleness]
        unknown = [s for s in fresh if s.version not in self.snapshots
                   or s.version_end not in self.snapshots]
        keep = [s for s in fresh if s.version in self.snapshots and s.version_end in self.snapshots]
        rewards = [self.task.reward(s.prompt_ids, s.token_ids) for s in samples]
        kept_r = [self.task.reward(s.prompt_ids, s.token_ids) for s in keep]
        st = StepStats(step, now + 1, sum(rewards) / max(len(rewards), 1), len(keep), len(stale),
                       sum(s.mixed for s in keep), 0.0, 0.0, 0.0, {}, 0.0, waited, 0.0, 0.0, False,
                       False, trained_version=now, unknown=len(unknown))
        if unknown:
            vs = sorted(({s.version for s in unknown} | {s.version_end for s in unknown})
                        - set(self.snapshots))
            self._note(st, f"{len(unknown)} samples of versions {vs} this loop did not push: "
                           f"not trained on")
        seen = keep or stale
        if seen:
            st.staleness = sum(now - s.version for s in seen) / len(seen)
        if not keep:
            self._note(st, "no sample within max_staleness: nothing to train on")
            return st
        batch = grpo.make_batch(keep, grpo.advantages(keep, kept_r))
        self.model.train()
        proximal = None                          # the trainer's logprobs before this step
        for epoch in range(self.epochs):        # PPO-style passes over the same samples
            loss, lp = grpo.loss(self.model, batch, self.clip, proximal, self.correction_cap,
                                 self.correction)
            if epoch == 0:
                proximal = lp
                self._gaps(keep, batch, lp, st)  # the weights that are still `now`'s
                _, cut = grpo.correction(lp, batch, self.correction, self.correction_cap)
                st.corrected, st.kl = cut["corrected"], cut["kl"]
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            st.loss = float(loss.detach())
        return st

    @staticmethod
    def _note(st: StepStats, msg: str) -> None:
        st.error = msg if st.error is None else f"{st.error}; {msg}"

    @torch.no_grad()
    def _gaps(self, keep: list[Sample], batch: grpo.Batch, lp_now: torch.Tensor, st: StepStats) -> None:
        """The gap under the version that generated each token: the weights being trained (the
        loss's own forward pass) for their label, a kept snapshot for older ones. A sample that
        spans a swap counts under each token's version when its engine prefilled it again with
        the new weights; one generated over a stale KV cache (`Sample.stale_kv`), or whose
        tokens' versions are unknown, is left out: no one version generated those tokens."""
        tv = torch.full_like(batch.mask, -1, dtype=torch.long)   # each sampled token's version
        for i, s in enumerate(keep):
            vs = None if s.stale_kv else s.versions()
            if vs is not None and vs:
                p = len(s.prompt_ids)
                tv[i, p - 1:p - 1 + len(vs)] = torch.tensor(vs)
        if not bool((tv >= 0).any()):
            return
        lp = lp_now.clone()
        for v in sorted(set(tv[tv >= 0].tolist())):
            if v == self.label:
                continue                         # the loss's forward pass ran these weights
            rows = sorted(set((tv == v).nonzero()[:, 0].tolist()))
            lp_v = grpo.token_logprobs(self.model, batch.rows(rows), self.snapshots[v])
            lp[rows] = torch.where(tv[rows] == v, lp_v, lp[rows])
        known = (tv >= 0).float()
        whole = grpo.gap(lp, batch, known)
        st.gap_mean, st.gap_max = whole["mean"], whole["max"]
        for engine in sorted({s.engine for s in keep}):
            mine = torch.tensor([s.engine == engine for s in keep])[:, None]
            for v in sorted(set(tv[(tv >= 0) & mine].tolist())):
                g = grpo.gap(lp, batch, ((tv == v) & mine).float())
                st.gaps[f"{engine}@{v}"] = g
                try:
                    self.sync.record_gap(engine, v, g["mean"], g["max"])
                except AttributeError:
                    pass

    def _push(self, st: StepStats | None) -> None:
        """Push the model as the next label. It lands when an engine took it: committed, or its
        commit's answer was lost and the engine then reported holding it."""
        label = self.label = self.label + 1
        self.snapshots[label] = self._snapshot()     # kept whatever the answer: it may be lost
        before = self.busy() if self.busy and st else {}
        t = time.perf_counter()
        why = None
        try:
            r = self.sync.push(self.model, version=label)
        except SyncError as e:
            r, why = e.report, _why(e)
        seconds = time.perf_counter() - t
        self._last_report = r
        outcomes = list(getattr(r, "engines", {}).values())
        landed = bool(getattr(r, "published", False)) or any(
            o.ok or (o.stage == "commit" and o.version == label) for o in outcomes)
        if landed:
            self.version, self._failing = label, []
        else:
            self._failing.append((label, why or "the sync took it nowhere"))
        # the next step trains `label`: samples older than this are dropped before any snapshot
        for v in [v for v in self.snapshots if v < label - self.max_staleness]:
            del self.snapshots[v]
        if st is None:
            return
        st.version, st.sync_seconds, st.failed_pushes = label, seconds, len(self._failing)
        if why:
            self._note(st, why)
        if self.busy:
            after = self.busy()
            st.busy_in_push = {k: min(1.0, (after[k] - before.get(k, 0.0)) / max(seconds, 1e-9))
                               for k in after if k in before}
        if r is not None:
            st.pause_window, st.push_ok, st.verified = r.pause_window, r.ok, r.verified
