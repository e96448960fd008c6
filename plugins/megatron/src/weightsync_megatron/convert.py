"""Joining one parameter's TP shards into its Hugging Face tensors (`to_hf`), and the inverse that
cuts a rank's shard out of HF tensors (`shard_from_hf`, for loading a checkpoint into a model).

Pure tensor functions: they run on meta tensors too, which is how the exporter learns every output's
shape and dtype before anything moves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Geometry", "shard_from_hf", "to_hf"]


@dataclass(frozen=True)
class Geometry:
    """What a layout conversion needs to know of the model (all global, not per shard)."""

    query_groups: int      # key/value heads (Megatron's num_query_groups)
    heads: int             # attention heads
    head_dim: int          # Megatron's kv_channels
    vocab: int             # the HF vocabulary; Megatron's may be padded past it

    @property
    def per_group(self) -> int:
        return self.heads // self.query_groups


def to_hf(kind: str, shards: list[torch.Tensor], geo: Geometry) -> list[torch.Tensor]:
    """The HF tensors of one parameter from its shards in TP-rank order (one shard: unsplit)."""
    if kind == "copy":
        return [shards[0]]
    if kind == "row":
        return [_cat(shards, 1)]
    if kind == "glu":
        # each shard holds its part of gate then its part of up: a plain concatenation of the
        # shards would interleave them
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_cat([h[0] for h in halves], 0), _cat([h[1] for h in halves], 0)]
    full = _cat(shards, 0)
    if kind == "col":
        return [full]
    if kind == "vocab":
        return [full[:geo.vocab]]
    if kind == "qkv":
        rest = full.shape[1:]
        q_rows, kv = geo.per_group * geo.head_dim, geo.head_dim
        grouped = full.reshape(geo.query_groups, q_rows + 2 * kv, *rest)
        return [grouped[:, :q_rows].reshape(-1, *rest),
                grouped[:, q_rows:q_rows + kv].reshape(-1, *rest),
                grouped[:, q_rows + kv:].reshape(-1, *rest)]
    raise ValueError(f"unknown layout kind {kind!r}")


def shard_from_hf(kind: str, hf: list[torch.Tensor], geo: Geometry, rank: int, size: int,
                  padded_vocab: int | None = None) -> torch.Tensor:
    """Rank `rank`'s shard (of `size`) of the Megatron parameter made of the HF tensors `hf`."""
    if kind == "copy":
        return hf[0]
    if kind == "row":
        return hf[0].chunk(size, dim=1)[rank]
    if kind == "glu":
        return torch.cat([hf[0].chunk(size, dim=0)[rank], hf[1].chunk(size, dim=0)[rank]])
    if kind == "col":
        return hf[0].chunk(size, dim=0)[rank]
    if kind == "vocab":
        t = hf[0]
        pad = (padded_vocab or t.shape[0]) - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        return t.chunk(size, dim=0)[rank]
    if kind == "qkv":
        q, k, v = hf
        rest = q.shape[1:]
        g = geo.query_groups
        fused = torch.cat([q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest)], 1)
        return fused.reshape(-1, *rest).chunk(size, dim=0)[rank]
    raise ValueError(f"unknown layout kind {kind!r}")


def _cat(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)
