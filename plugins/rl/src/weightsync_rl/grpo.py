"""GRPO on Samples: group-relative advantages, the trainer's logprobs of the sampled tokens, and
the clipped importance-ratio loss against the engines' logprobs (the behaviour policy).

Samples of one prompt form a group; each sample's advantage is its reward minus the group's mean,
over the group's standard deviation. The loss is PPO's clipped surrogate per token, averaged over
the tokens of the batch, decoupled from the behaviour policy for samples that are a version old
(see `loss`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.func import functional_call

from weightsync.interfaces.sampling import Sample


@dataclass
class Batch:
    """Samples as padded tensors: prompt + completion ids, which positions are completion tokens,
    the engines' logprobs there, and one advantage per sample."""

    ids: torch.Tensor            # [B, T]
    mask: torch.Tensor           # [B, T-1] float: 1 where position t predicts a sampled token
    engine_lp: torch.Tensor      # [B, T-1] the engine's logprob of that token (0 elsewhere)
    attention: torch.Tensor      # [B, T] 1 on real tokens (right padding)
    advantages: torch.Tensor     # [B]
    # the distribution each sample's engine logprobs are of (`Sample.temperature`, `top_k`,
    # `top_p`): the trainer's side is computed the same way, or the gap measures the sampling
    # settings and the importance ratio is wrong
    temperature: torch.Tensor    # [B]
    top_k: torch.Tensor          # [B] long, 0: no top-k filter
    top_p: torch.Tensor          # [B], 1: no top-p filter

    def rows(self, idx: list[int]) -> "Batch":
        """The same batch cut to samples `idx`."""
        return Batch(self.ids[idx], self.mask[idx], self.engine_lp[idx], self.attention[idx],
                     self.advantages[idx], self.temperature[idx], self.top_k[idx], self.top_p[idx])


def advantages(samples: list[Sample], rewards: list[float], eps: float = 1e-4) -> list[float]:
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.prompt_index, []).append(i)
    out = [0.0] * len(samples)
    for idx in groups.values():
        r = torch.tensor([rewards[i] for i in idx])
        a = (r - r.mean()) / (r.std(unbiased=False) + eps) if len(idx) > 1 else torch.zeros(1)
        for i, v in zip(idx, a.tolist()):
            out[i] = v
    return out


def make_batch(samples: list[Sample], advs: list[float]) -> Batch:
    seqs = [s.prompt_ids + s.token_ids for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    att = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1)
    lp = torch.zeros(len(seqs), width - 1)
    for i, (s, x) in enumerate(zip(samples, seqs)):
        ids[i, :len(x)] = torch.tensor(x)
        att[i, :len(x)] = 1
        p, n = len(s.prompt_ids), len(s.token_ids)
        mask[i, p - 1:p - 1 + n] = 1
        lp[i, p - 1:p - 1 + n] = torch.tensor(s.logprobs)
    return Batch(ids, mask, lp, att, torch.tensor(advs, dtype=torch.float32),
                 torch.tensor([s.temperature for s in samples], dtype=torch.float32),
                 torch.tensor([s.top_k for s in samples], dtype=torch.long),
                 torch.tensor([s.top_p for s in samples], dtype=torch.float32))


def processed(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [B, L, V] of the distribution an engine reports for rows sampled with
    these settings: logits over the row's temperature, then (where the engine's logprobs are of
    the filtered distribution) the tokens outside its top-k and its top-p nucleus removed and
    the rest renormalised, as vLLM's `processed_logprobs` are."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))   # 0: greedy, raw
    x = logits.float() / t[:, None, None]
    if bool((top_k > 0).any()):
        k = top_k.clamp(min=1, max=x.shape[-1])
        kth = torch.sort(x, -1, descending=True).values.gather(
            -1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
        x = torch.where((top_k[:, None, None] > 0) & (x < kth), float("-inf"), x)
    if bool((top_p < 1).any()):
        order = torch.sort(x, -1, descending=True)
        probs = torch.softmax(order.values, -1)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None, None]   # past the nucleus
        drop = torch.zeros_like(drop).scatter(-1, order.indices, drop)
        x = torch.where(drop, float("-inf"), x)
    return torch.log_softmax(x, -1)


def token_logprobs(model: torch.nn.Module, batch: Batch,
                   weights: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """[B, T-1]: the model's logprob of each next token under the distribution its engine
    reported (`processed`); with `weights` (a snapshot of another version's parameters) the same
    model computes with those instead."""
    kw: dict[str, Any] = {"input_ids": batch.ids, "attention_mask": batch.attention}
    out = functional_call(model, dict(weights), (), kw) if weights is not None else model(**kw)
    lp = processed(out.logits[:, :-1], batch.temperature, batch.top_k, batch.top_p)
    lp = lp.gather(2, batch.ids[:, 1:, None])[..., 0]
    # a prompt token outside a row's top-k / top-p has no probability there: -inf, which would
    # make NaN of the masked sums; only sampled tokens count (always kept), so the rest is 0
    return torch.where(batch.mask > 0, lp, torch.zeros_like(lp))


CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


def correction(prox: torch.Tensor, batch: Batch, mode: str = "token_truncate",
               cap: float = 5.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Rollout correction: the importance weight [B, T-1] of each sampled token, trainer over
    engine (proximal / behaviour), as verl's and TRL's options name them: `token_truncate`
    caps each token's ratio at `cap` (truncated IS), `token_mask` drops tokens above it,
    `sequence_*` do the same with the sequence's ratio (the product over its tokens) for every
    token of the sequence (masked IS at `sequence_mask`), `none` weighs every token 1. With the
    weights: the share of tokens whose weight was cut (`corrected`), and the KL from the engine's
    policy to the trainer's over the sampled tokens (`kl`, the k3 estimator: never negative)."""
    if mode not in CORRECTIONS:
        raise ValueError(f"correction {mode!r}: use one of {', '.join(CORRECTIONS)}")
    m = batch.mask
    log_r = (prox - batch.engine_lp) * m
    if mode.startswith("sequence"):
        log_r = log_r.sum(1, keepdim=True).expand_as(log_r)
    r = torch.exp(log_r.clamp(max=50.0))
    over = (r > cap) & (m > 0)
    if mode.endswith("truncate"):
        w = r.clamp(max=cap)
    elif mode.endswith("mask"):
        w = torch.where(over, torch.zeros_like(r), r)
    else:
        w, over = torch.ones_like(r), torch.zeros_like(over)
    n = m.sum().clamp(min=1)
    d = (batch.engine_lp - prox) * m                 # log(engine / trainer) per token
    kl = ((torch.exp(d) - 1 - d) * m).sum() / n
    return w * m, {"corrected": float(over.sum() / n), "kl": float(kl)}


def loss(model: torch.nn.Module, batch: Batch, clip: float = 0.2,
         proximal: torch.Tensor | None = None, cap: float = 5.0,
         mode: str = "token_truncate") -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate loss and the trainer's logprobs it was computed from (detached).

    Decoupled as AReaL's PPO is for off-policy samples: the ratio that is clipped is against the
    `proximal` policy (the trainer's own logprobs at the start of the step; the first pass's,
    when None), and each token is weighted by proximal / behaviour (the engine's logprobs) as
    `correction` says (`mode`, `cap`; by default capped at `cap`). On-policy samples have a
    weight of 1 (the two agree up to the gap), so this is plain PPO; a sample one version old is
    corrected instead of clipped away."""
    lp = token_logprobs(model, batch)
    prox = lp.detach() if proximal is None else proximal
    ratio = torch.exp(lp - prox) * batch.mask
    weight, _ = correction(prox, batch, mode, cap)
    adv = batch.advantages[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv) * weight
    return (per_token * batch.mask).sum() / batch.mask.sum().clamp(min=1), lp.detach()


def gap(trainer_lp: torch.Tensor, batch: Batch, only: torch.Tensor | None = None
        ) -> dict[str, float]:
    """|Δ logprob| between the trainer and the engines over the sampled tokens (those of them
    where `only` is 1, when given): mean and max."""
    m = batch.mask if only is None else batch.mask * only
    d = (trainer_lp - batch.engine_lp).abs() * m
    n = m.sum().clamp(min=1)
    return {"mean": float(d.sum() / n), "max": float(d.max()) if m.any() else 0.0}
