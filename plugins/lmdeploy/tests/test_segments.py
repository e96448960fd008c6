"""How payloads are cut into LMDeploy calls (no server needed)."""

from __future__ import annotations

import pytest
import torch

from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import PayloadError
from weightsync_lmdeploy.segments import LayerGrouper, flattened_runs


def body(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return RawEncoding().encode(Bucket(0, named, last=True)).body


def test_flattened_runs_are_zero_copy_views_one_dtype_each() -> None:
    named = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(2)),
             ("c", torch.zeros(4, dtype=torch.bfloat16)), ("d", torch.tensor([5]))]
    b = body(named)
    runs = flattened_runs(b)
    assert [r.flat.dtype for r in runs] == [torch.int64, torch.float32, torch.bfloat16]  # wire order
    for r in runs:
        assert r.flat.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert {m.dtype for m in r.metadata} == {r.flat.dtype}
        assert r.metadata[-1].end_idx == r.flat.numel()


def layer(i: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"model.layers.{i}.q.weight", torch.full((2,), float(i))),
            (f"model.layers.{i}.k.weight", torch.full((2,), float(i)))]


def test_layers_straddling_buckets_go_out_whole_and_misc_last() -> None:
    g = LayerGrouper(r"\.layers\.(\d+)\.")
    embed = [("model.embed_tokens.weight", torch.ones(3))]
    b0 = embed + layer(0) + layer(1)[:1]
    b1 = layer(1)[1:] + layer(2) + [("lm_head.weight", torch.ones(3))]
    first = list(g.feed(b0, last=False))
    assert [s.names for s in first] == [[n for n, _ in layer(0)]]
    second = list(g.feed(b1, last=True))
    assert [s.names for s in second] == [[n for n, _ in layer(1)], [n for n, _ in layer(2)],
                                         ["model.embed_tokens.weight", "lm_head.weight"]]


def test_carried_tensors_do_not_pin_the_bucket_body() -> None:
    g = LayerGrouper(r"\.layers\.(\d+)\.")
    src = torch.zeros(8)
    list(g.feed([("model.layers.0.a", src[:4]), ("model.norm.weight", src[4:])], last=False))
    assert all(t.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
               for _, t in g.open + g.misc)


def test_a_layer_that_comes_back_is_refused() -> None:
    g = LayerGrouper(r"\.layers\.(\d+)\.")
    with pytest.raises(PayloadError, match="layer 0 came back"):
        list(g.feed(layer(0) + layer(1) + layer(0), last=True))
