"""Batched sampling for the reference engine: requests wait in a queue, a worker takes every
request waiting (up to `max_rows` sequences), prefills them as one left-padded batch and decodes
with a KV cache, one forward pass per token for the whole batch. Each sequence samples with its
own generator (seed + i), so a seed reproduces its tokens.

Weights change only between two decoding steps (the engine's model lock is taken per step), so
every token records the version it was sampled with (`weight_versions`; `weight_version` of the
first, `weight_version_end` of the last). When the version moves between two steps, the batch's
KV cache holds keys and values of the old weights: by default it is dropped and every sequence
(its prompt and the tokens so far) is prefilled again with the new weights before the next token,
so each token's logprob is the forward pass of its own version over the whole sequence. Only an
engine paused with "keep_stale_kv" goes on over the old cache; such samples say so
(`stale_kv`): their tokens after the swap belong to neither version's policy."""

from __future__ import annotations

import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from weightsync.interfaces.sampling import SamplingParams


# "keep" prefills running generations again after a swap; "keep_stale_kv" does not (asked for)
PAUSE_MODES = ("abort", "keep", "keep_stale_kv")


class Aborted(Exception):
    """The engine was paused with mode "abort" while the batch ran."""


@dataclass
class Row:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    versions: list[int] = field(default_factory=list)   # the weight version of each token
    stale_kv: bool = False                  # a token was computed over another version's KV

    @property
    def first(self) -> int | None:
        return self.versions[0] if self.versions else None

    @property
    def last(self) -> int | None:
        return self.versions[-1] if self.versions else None

    def as_dict(self) -> dict[str, Any]:
        return {"output_ids": self.out, "logprobs": self.logprobs,
                "finish_reason": self.finish or "length", "weight_version": self.first,
                "weight_version_end": self.last, "weight_versions": self.versions,
                "stale_kv": self.stale_kv}


@dataclass
class Job:
    rows: list[Row]
    check: Callable[[int], None]            # raises to fail this job when the version moves
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def make_rows(prompt: list[int], params: SamplingParams) -> list[Row]:
    base = params.seed if params.seed is not None else secrets.randbits(62)
    return [Row(list(prompt), params, torch.Generator().manual_seed(base + i)) for i in range(params.n)]


def pick(logits: torch.Tensor, row: Row) -> tuple[int, float]:
    """One token for `row` from its last-position logits (float32), and its logprob under the
    temperature-scaled distribution before the top-k / top-p filters."""
    p = row.params
    if p.temperature == 0:
        lp = torch.log_softmax(logits, -1)
        tok = int(lp.argmax())
        return tok, float(lp[tok])
    lp = torch.log_softmax(logits / p.temperature, -1)
    probs = lp.exp()
    if p.top_k and p.top_k < probs.numel():
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        order = torch.sort(probs, descending=True)
        keep = (order.values.cumsum(0) - order.values) < p.top_p * probs.sum()
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order.indices[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    tok = int(torch.multinomial(probs, 1, generator=row.generator))
    return tok, float(lp[tok])


def _left_padded(seqs: list[list[int]], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and positions of `seqs` as one left-padded batch."""
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class BatchingSampler:
    """The engine's generation worker. `step_gate` is called before every forward pass: it
    blocks while the engine is paused ("keep") and raises Aborted for "abort"; `locked` runs a
    function of the version held under the engine's model lock (so the weights cannot change
    between reading the version and the forward pass) and returns (its result, version);
    `stale_kv_ok()` says the last pause asked to go on over the old KV cache across a swap."""

    def __init__(self, module: torch.nn.Module, step_gate: Callable[[int], None],
                 locked: Callable[[Callable[[int], Any]], tuple[Any, int]],
                 stale_kv_ok: Callable[[], bool] = lambda: False, max_rows: int = 64) -> None:
        self.module = module
        self.step_gate = step_gate
        self.locked = locked
        self.stale_kv_ok = stale_kv_ok
        self.reprefills = 0                  # batches prefilled again after a swap (in /info)
        self.max_rows = max_rows
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.tokens = 0                      # generated so far (reported in /info)
        self.batches = 0
        self.busy = 0.0                      # seconds spent generating (not paused), all batches
        self._since: float | None = None     # start of the running stretch of generation
        threading.Thread(target=self._loop, name="ws-sampler", daemon=True).start()

    def run(self, rows: list[Row], check: Callable[[int], None], timeout: float) -> list[Row]:
        job = Job(rows, check)
        self.jobs.put(job)
        if not job.done.wait(timeout):
            job.error = TimeoutError(f"generation did not finish within {timeout:g}s")
            raise job.error
        if job.error is not None:
            raise job.error
        return rows

    def _loop(self) -> None:
        while True:
            jobs = [self.jobs.get()]
            n = len(jobs[0].rows)
            while n < self.max_rows:
                try:
                    j = self.jobs.get_nowait()
                except queue.Empty:
                    break
                jobs.append(j)
                n += len(j.rows)
            try:
                self._resume_clock()
                self._batch(jobs)
            except BaseException as e:  # noqa: BLE001 - handed to every waiting request
                for j in jobs:
                    if j.error is None:
                        j.error = e
            finally:
                self._stop_clock()
                for j in jobs:
                    j.done.set()

    def _resume_clock(self) -> None:
        self._since = time.monotonic()

    def _stop_clock(self) -> None:
        if self._since is not None:
            self.busy += time.monotonic() - self._since
            self._since = None

    def busy_seconds(self) -> float:
        """Seconds spent generating so far, the running stretch included (paused time is not
        generating: the idle fraction of an RL loop counts it as idle)."""
        since = self._since
        return self.busy + (time.monotonic() - since if since is not None else 0.0)

    @torch.no_grad()
    def _batch(self, jobs: list[Job]) -> None:
        live = [j for j in jobs if j.error is None]
        rows = [r for j in live for r in j.rows]
        owner = [j for j in live for _ in j.rows]
        if not rows:
            return
        self.batches += 1
        device = next(self.module.parameters()).device
        ids, mask, pos = _left_padded([r.prompt for r in rows], device)
        for r in rows:
            if r.params.max_new_tokens == 0:
                r.finish = "length"
        state: dict[str, Any] = {"cache": None, "version": None, "ids": ids, "mask": mask,
                                 "pos": pos}

        def forward(version: int) -> Any:
            if state["version"] is not None and version != state["version"]:
                if self.stale_kv_ok():
                    for r in rows:
                        r.stale_kv = r.stale_kv or (r.finish is None and bool(r.out))
                else:                        # the cache is the old weights': prefill again
                    self.reprefills += 1
                    state["ids"], state["mask"], state["pos"] = _left_padded(
                        [r.prompt + r.out for r in rows], device)
                    state["cache"] = None
            state["version"] = version
            out = self.module(input_ids=state["ids"], attention_mask=state["mask"],
                              position_ids=state["pos"], past_key_values=state["cache"],
                              use_cache=True)
            state["cache"] = out.past_key_values
            return out

        steps = max(r.params.max_new_tokens for r in rows)
        for k in range(steps):
            try:
                self._stop_clock()           # a pause is not generation
                self.step_gate(k)
                self._resume_clock()
            except Aborted:
                for r in rows:
                    r.finish = r.finish or "abort"
                return
            out, version = self.locked(forward)
            logits = out.logits[:, -1].float().cpu()
            nxt = torch.zeros(len(rows), 1, dtype=torch.long)
            for i, r in enumerate(rows):
                if r.finish is not None or owner[i].error is not None:
                    continue
                try:
                    owner[i].check(version)
                except Exception as e:  # noqa: BLE001 - fails this request only
                    owner[i].error = e
                    continue
                tok, lp = pick(logits[i], r)
                r.out.append(tok)
                r.logprobs.append(lp)
                r.versions.append(version)
                nxt[i, 0] = tok
                self.tokens += 1
                if tok in r.params.stop_token_ids:
                    r.finish = "stop"
                elif len(r.out) >= r.params.max_new_tokens:
                    r.finish = "length"
            if all(r.finish is not None or o.error is not None for r, o in zip(rows, owner)):
                return
            state["ids"] = nxt.to(device)
            state["mask"] = torch.cat([state["mask"], torch.ones(len(rows), 1, dtype=torch.long,
                                                                 device=device)], 1)
            state["pos"] = state["pos"][:, -1:] + 1


@torch.no_grad()
def score(module: torch.nn.Module, ids: list[int]) -> list[float]:
    """The logprob of each token of `ids` after the first, given the tokens before it."""
    device = next(module.parameters()).device
    x = torch.tensor([ids], device=device)
    lp = torch.log_softmax(module(input_ids=x).logits[0, :-1].float(), -1)
    return [float(v) for v in lp.gather(1, x[0, 1:, None].to(lp.device))[:, 0].cpu()]
