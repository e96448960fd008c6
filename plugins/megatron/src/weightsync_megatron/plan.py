"""The plan of one export, the same on every rank: each Megatron parameter of the whole model (a
unit), who sends it (TP/expert-TP rank 0 of the first data-parallel replica of the stage and EP rank
holding it), how its shards join and which HF tensors it becomes, with their shapes and dtypes.

Each rank describes the units it sends; one all-gather of those descriptions (JSON bytes in a
tensor, no pickle) gives every rank the whole plan, so the point-to-point moves that follow pair up
without further talk. A rank that cannot describe its parameters says so in the same exchange, and
every rank raises the same error instead of some waiting forever."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from .convert import Geometry, to_hf
from .names import ARCHITECTURES, TOP, Rule

__all__ = ["Plan", "Ranks", "Unit", "expert_index", "geometry_of", "make_plan", "model_chunks",
           "spread"]

_SPLIT_DIM = {"col": 0, "qkv": 0, "glu": 0, "vocab": 0, "row": 1}


@dataclass(frozen=True)
class Ranks:
    """This rank's place: global rank, and the global ranks of its TP and expert-TP groups."""

    me: int
    tp: tuple[int, ...]
    etp: tuple[int, ...]
    dense_sender: bool     # TP rank 0 of data-parallel replica 0: sends the non-expert units
    expert_sender: bool    # expert-TP rank 0 of expert-data-parallel replica 0: sends experts
    ep_rank: int
    ep_size: int
    tp_group: Any = None
    etp_group: Any = None

    @classmethod
    def current(cls) -> "Ranks":
        """From Megatron's parallel state; a single process when torch.distributed is not set up."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return cls(0, (0,), (0,), True, True, 0, 1)
        from megatron.core import parallel_state as ps
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("the megatron exporter needs Megatron's parallel state: call "
                               "megatron.core.parallel_state.initialize_model_parallel first")
        tp, etp = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
        return cls(dist.get_rank(), tuple(dist.get_process_group_ranks(tp)),
                   tuple(dist.get_process_group_ranks(etp)),
                   ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_data_parallel_rank(with_context_parallel=True) == 0,
                   ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0,
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                   tp, etp)

    def group(self, expert: bool) -> tuple[int, ...]:
        return self.etp if expert else self.tp

    def process_group(self, expert: bool) -> Any:
        return self.etp_group if expert else self.tp_group


@dataclass(frozen=True)
class Unit:
    """One Megatron parameter of the whole model."""

    id: str                                   # global Megatron name (global layer and expert)
    key: tuple[int, ...]                      # the export order
    kind: str
    expert: bool
    sender: int                               # global rank
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]   # (HF name, dtype, shape)
    group: tuple[int, ...] = ()               # the TP (expert-TP) group the sender gathers in

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * getattr(torch, d).itemsize for _, d, s in self.outputs)

    def to_json(self) -> list[Any]:
        return [self.id, list(self.key), self.kind, self.expert, self.sender,
                [[n, d, list(s)] for n, d, s in self.outputs], list(self.group)]

    @classmethod
    def from_json(cls, j: list[Any]) -> "Unit":
        return cls(j[0], tuple(j[1]), j[2], j[3], j[4], tuple((n, d, tuple(s)) for n, d, s in j[5]),
                   tuple(j[6]))


@dataclass
class Plan:
    units: list[Unit]
    local: dict[str, torch.Tensor]           # this rank's shard of each unit it holds, by id
    geometry: Geometry
    device: torch.device
    ranks: Ranks


def model_chunks(model: Any) -> list[Any]:
    """Model chunks (a list under virtual pipelining), unwrapped from DDP / Float16Module."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for c in chunks:
        while not hasattr(c, "decoder") and hasattr(c, "module"):
            c = c.module
        if not hasattr(c, "decoder") or not hasattr(c, "config"):
            raise TypeError(f"the megatron exporter takes a Megatron-core GPTModel (or a list of "
                            f"model chunks), not a {type(c).__name__}")
        out.append(c)
    return out


def geometry_of(chunk: Any, vocab: int | None) -> Geometry:
    cfg = chunk.config
    heads = cfg.num_attention_heads
    return Geometry(cfg.num_query_groups or heads, heads, cfg.kv_channels or cfg.hidden_size // heads,
                    vocab if vocab is not None else int(chunk.vocab_size))


def expert_index(layer: Any, local: int, ranks: Ranks) -> int:
    indices = getattr(layer.mlp.experts, "local_expert_indices", None)
    if indices is not None:
        return int(indices[local])
    n = layer.mlp.experts.num_local_experts
    return ranks.ep_rank * n + local


def _describe(chunks: list[Any], arch: str, ranks: Ranks, geo: Geometry
              ) -> tuple[list[Unit], dict[str, torch.Tensor]]:
    """The units this rank sends, and its shard of every unit it holds."""
    from .names import parse
    table = ARCHITECTURES[arch]
    mine: list[Unit] = []
    local: dict[str, torch.Tensor] = {}
    order = {k: i for i, k in enumerate([*TOP, *table])}
    for chunk in chunks:
        tied = bool(getattr(chunk, "share_embeddings_and_output_weights", False))
        for name, p in chunk.named_parameters():
            layer, key, expert = parse(name)
            if tied and key == "output_layer.weight":
                continue                     # HF writes the tied head once, as the embedding
            rule: Rule | None = TOP.get(key) if layer is None else table.get(key)
            if rule is None:
                raise ValueError(f"{arch}: parameter {name!r} is not in the megatron exporter's "
                                 f"table for this architecture; is the model a {arch}?")
            _check_split(name, p, rule, ranks)
            g_layer = chunk.decoder.layers[layer].layer_number - 1 if layer is not None else 0
            g_expert = expert_index(chunk.decoder.layers[layer], expert, ranks) if expert is not None else 0
            uid = name if layer is None else f"decoder.layers.{g_layer}.{key}" + (
                f"#{g_expert}" if expert is not None else "")
            section = 0 if key.startswith("embedding") else 1 if layer is not None else (
                2 if key.startswith("decoder") else 3)
            local[uid] = p.detach()
            if not (ranks.expert_sender if rule.expert else ranks.dense_sender):
                continue
            size = len(ranks.group(rule.expert)) if rule.kind != "copy" else 1
            metas = [torch.empty(p.shape, dtype=p.dtype, device="meta")] * size
            outs = to_hf(rule.kind, metas, geo)
            names = [t.format(layer=g_layer, expert=g_expert) for t in rule.hf]
            mine.append(Unit(uid, (section, g_layer, order[key], g_expert), rule.kind, rule.expert,
                             ranks.me, tuple((n, str(o.dtype).removeprefix("torch."), tuple(o.shape))
                                             for n, o in zip(names, outs)), ranks.group(rule.expert)))
    return mine, local


def _check_split(name: str, p: torch.Tensor, rule: Rule, ranks: Ranks) -> None:
    """The parameter is split the way the table says (a table written for another layout fails
    here, not as wrong bytes in an engine)."""
    if len(ranks.group(rule.expert)) == 1 or not hasattr(p, "tensor_model_parallel"):
        return                               # unsplit, or built without initialization
    split = bool(p.tensor_model_parallel)
    want = _SPLIT_DIM.get(rule.kind)
    if (want is None) == split or (split and getattr(p, "partition_dim", want) != want):
        raise ValueError(f"parameter {name!r}: the table says {rule.kind!r} but Megatron marks it "
                         f"tensor_model_parallel={split}, partition_dim="
                         f"{getattr(p, 'partition_dim', None)}")


def make_plan(model: Any, arch: str, vocab: int | None) -> Plan:
    """Every rank calls this with its own chunks; every rank gets the same units."""
    chunks = model_chunks(model)
    ranks = Ranks.current()
    geo = geometry_of(chunks[0], vocab)
    device = next(chunks[0].parameters()).device
    try:
        mine, local = _describe(chunks, arch, ranks, geo)
        said: Any = [u.to_json() for u in mine]
    except (ValueError, TypeError) as e:
        mine, local, said = [], {}, {"error": f"rank {ranks.me}: {e}"}
    everyone = all_gather_json(said, device)
    errors = [s["error"] for s in everyone if isinstance(s, dict)]
    if errors:
        raise ValueError("; ".join(errors))
    units = sorted((Unit.from_json(j) for s in everyone for j in s), key=lambda u: u.key)
    seen: dict[str, int] = {}
    for u in units:
        for n, _, _ in u.outputs:
            if n in seen:
                raise ValueError(f"{n!r} is sent by both rank {seen[n]} and rank {u.sender}; "
                                 f"is Megatron's parallel state the one the model was built with?")
            seen[n] = u.sender
    return Plan(units, local, geo, device, ranks)


def spread(units: list[Unit]) -> list[Unit]:
    """`senders: all`: each unit sent by the member of its group that has sent the fewest bytes
    so far (ties: the lowest rank), so every rank of a TP or expert-TP group sends, not only its
    first; the same on every rank (plan order, whole-plan counts)."""
    load: dict[int, int] = {}
    out = []
    for u in units:
        who = min(u.group or (u.sender,), key=lambda r: (load.get(r, 0), r))
        load[who] = load.get(who, 0) + u.nbytes
        out.append(replace(u, sender=who))
    return out


def all_gather_json(obj: Any, device: torch.device) -> list[Any]:
    """`obj` of every rank of the default group, as JSON (one process: just `obj`)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    most = int(max(int(s.item()) for s in sizes))
    buf = torch.zeros(most, dtype=torch.uint8, device=device)
    buf[:data.numel()] = data
    bufs = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)]
