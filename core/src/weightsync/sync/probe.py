"""The probe: after a commit, engines that can score a sequence score a fixed one and the trainer
compares the logprobs with its own. Digests prove the bytes; the probe proves what the engine
computes with them (a name mapped to the wrong tensor, a layout bug in its load path). In a
multi-rank trainer every rank runs the forward pass (a sharded forward is a collective), and rank 0
compares (`join_probe` is the followers' side)."""

from __future__ import annotations

import logging
from typing import Any, Callable, cast

import torch

from weightsync.config import ProbeSettings
from weightsync.errors import WeightSyncError
from weightsync.interfaces import Adapter, Distrusts, Scores
from weightsync.interfaces.sampling import Unsupported
from weightsync.sync.report import EngineOutcome, SyncReport

log = logging.getLogger("weightsync.sync.probe")


def probe_ids(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(0, vocab, (length,), generator=g)]


def vocab_of(model: Any) -> int | None:
    emb = getattr(model, "get_output_embeddings", None)
    if not callable(emb) or emb() is None:
        return None
    return int(emb().weight.shape[0])


@torch.no_grad()
def trainer_logprobs(model: Any, ids: list[int]) -> list[float]:
    """The trainer's own logprob of each token of `ids` after the first (eval mode, float32)."""
    was = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        x = torch.tensor([ids], device=device)
        lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        return [float(v) for v in lp.gather(1, x[0, 1:, None])[:, 0].cpu()]
    finally:
        model.train(was)


def join_probe(model: Any, settings: ProbeSettings) -> None:
    """A follower rank's part of the probe: the same forward pass as rank 0's, on the same ids."""
    vocab = vocab_of(model) if isinstance(model, torch.nn.Module) else None
    if vocab is not None:
        try:
            trainer_logprobs(model, probe_ids(vocab, settings.length, settings.seed))
        except Exception as e:  # noqa: BLE001 - rank 0 fails the same way and reports it
            log.warning("the probe's forward pass failed on this rank: %s", e)


def _skipped(report: SyncReport, settings: ProbeSettings, why: str,
             outcomes: list[EngineOutcome]) -> None:
    """Not probed: the report says why, and with `mode: on` these engines fail."""
    report.probe = f"skipped: {why}"[:500]
    if settings.mode == "on":
        for o in outcomes:
            o.fail("probe", f"probe: on, but {why}")


def run_probe(model: Any, version: int, adapters: list[Adapter], report: SyncReport,
              settings: ProbeSettings,
              each: Callable[..., tuple[dict[str, Any], dict[str, BaseException]]],
              join: Callable[[], None] = lambda: None) -> None:
    """Probe every engine of `adapters` that committed `version`; write each one's gap into the
    report (`EngineOutcome.probe`) and fail those over the tolerance. `join` is called right
    before the trainer's forward pass (it brings a multi-rank trainer's other ranks in)."""
    if settings.mode == "off":
        return
    vocab = vocab_of(model) if isinstance(model, torch.nn.Module) else None
    if vocab is None:
        _skipped(report, settings, "the pushed model is not a causal LM the trainer can score",
                 [o for o in report.engines.values() if o.ok])
        return
    ids = probe_ids(vocab, settings.length, settings.seed)
    # the default: tight for a float32 model, looser for 16-bit weights
    tolerance = settings.tolerance or (0.05 if next(model.parameters()).dtype == torch.float32 else 0.25)
    targets = [a for a in adapters
               if isinstance(a, Scores) and (seen := report.engines.get(a.engine_name)) is not None
               and seen.ok and seen.version == version]
    answers, fails = each(targets, lambda a: cast(Scores, a).score(ids))
    mine: list[float] = []
    if answers:          # the trainer's forward only when an engine scored (a sharded one is a
        join()           # collective every rank joins: not run for weights-only engines)
        try:
            mine = trainer_logprobs(model, ids)
        except Exception as e:  # noqa: BLE001 - a model that needs its framework's own inputs
            _skipped(report, settings, f"the trainer's model could not score the probe plainly "
                     f"({type(e).__name__}: {e})", [report.engines[a.engine_name] for a in targets])
            return
    unprobed: list[str] = []
    for a in targets:
        o = report.engines[a.engine_name]
        err = fails.get(a.engine_name)
        if isinstance(err, Unsupported) and settings.mode == "auto":
            unprobed.append(a.engine_name)   # this engine runs no model (weights only)
            continue
        if err is not None:
            o.fail("probe", f"the probe could not be scored: {err}")
            continue
        theirs, held = answers[a.engine_name]
        d = [abs(x - y) for x, y in zip(mine, theirs)]
        o.probe = {"version": held, "mean": sum(d) / max(len(d), 1), "max": max(d, default=0.0)}
        if held != version:
            o.fail("probe", f"the probe was scored at version {held}, not {version}")
        elif o.probe["max"] > tolerance:
            o.fail("probe", f"the engine's logprobs differ from the trainer's by up to "
                            f"{o.probe['max']:.4g} (mean {o.probe['mean']:.4g}, tolerance "
                            f"{tolerance:g}): it does not compute with the pushed weights")
        else:
            continue
        if not isinstance(a, Distrusts):
            continue                         # the report says the probe failed; that is all
        try:
            a.distrust(version, o.error or "probe failed")
        except WeightSyncError as e:
            log.warning("%s: could not mark version %d as failing its probe: %s", a.engine_name, version, e)
    report.probe = (f"{len(targets) - len(unprobed)} engines probed with {len(ids)} tokens"
                    + (f"; not probed (they cannot score): {', '.join(unprobed)}" if unprobed else ""))
