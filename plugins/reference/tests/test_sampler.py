"""The reference engine's batched sampler on a real tiny HF model (in process): greedy equals the
model's own greedy, logprobs are the model's, seeds reproduce, filters and stop tokens hold,
requests that arrive together share a batch, and a pause blocks it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from weightsync.interfaces.sampling import SamplingParams
from weightsync_reference.server.sampler import Aborted, BatchingSampler, make_rows, pick, score
from weightsync_reference.models import build_tiny_model, greedy


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return build_tiny_model(Path(tmp_path_factory.mktemp("m")), "llama", vocab=64).eval()


def _sampler(model: torch.nn.Module, gate=lambda k: None) -> BatchingSampler:  # noqa: ANN001
    def locked(fn):  # noqa: ANN001, ANN202
        return fn(7), 7
    return BatchingSampler(model, gate, locked)


def _run(s: BatchingSampler, prompt: list[int], **p: object) -> list:
    return s.run(make_rows(prompt, SamplingParams(**p)), lambda v: None, 60)


def test_greedy_equals_the_model_and_logprobs_are_the_models(model: torch.nn.Module) -> None:
    s = _sampler(model)
    prompt = [3, 9, 27, 5]
    (row,) = _run(s, prompt, temperature=0.0, max_new_tokens=10)
    assert row.out == greedy(model, prompt, 10)
    assert row.finish == "length" and row.first == row.last == 7
    mine = score(model, prompt + row.out)[len(prompt) - 1:]
    assert len(row.logprobs) == 10
    assert max(abs(a - b) for a, b in zip(mine, row.logprobs)) < 1e-4


def test_seeds_reproduce_and_differ_per_sample(model: torch.nn.Module) -> None:
    s = _sampler(model)
    a = _run(s, [1, 2, 3], n=4, seed=11, max_new_tokens=8)
    b = _run(s, [1, 2, 3], n=4, seed=11, max_new_tokens=8)
    assert [r.out for r in a] == [r.out for r in b]
    assert len({tuple(r.out) for r in a}) > 1          # sample i uses seed + i
    c = _run(s, [1, 2, 3], n=1, seed=12, max_new_tokens=8)
    assert c[0].out == a[1].out


def test_top_k_one_is_greedy_and_stop_tokens_end_a_sample(model: torch.nn.Module) -> None:
    s = _sampler(model)
    prompt = [5, 6, 7]
    want = greedy(model, prompt, 6)
    (row,) = _run(s, prompt, top_k=1, temperature=0.7, seed=3, max_new_tokens=6)
    assert row.out == want
    (row,) = _run(s, prompt, temperature=0.0, max_new_tokens=6, stop_token_ids=[want[2]])
    assert row.out == want[:3] and row.finish == "stop"


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([5.0, 4.0, -10.0, -10.0])
    row = make_rows([1], SamplingParams(top_p=0.5, seed=0))[0]
    assert {pick(logits, row)[0] for _ in range(50)} == {0}
    row = make_rows([1], SamplingParams(top_p=0.999, seed=0))[0]
    assert {pick(logits, row)[0] for _ in range(200)} == {0, 1}


def test_concurrent_requests_share_a_batch(model: torch.nn.Module) -> None:
    release = threading.Event()
    first = threading.Event()

    def gate(k: int) -> None:
        first.set()
        release.wait(10)
    s = _sampler(model, gate)
    out: list = []
    ts = [threading.Thread(target=lambda i=i: out.append(_run(s, [i + 1, 2], n=2, max_new_tokens=3)))
          for i in range(4)]
    ts[0].start()
    assert first.wait(10)                  # the first request's batch runs (and is held)
    for t in ts[1:]:
        t.start()
    deadline = threading.Event()
    while s.jobs.qsize() < 3 and not deadline.wait(0.01):
        pass
    release.set()
    for t in ts:
        t.join(30)
    assert len(out) == 4 and all(len(r) == 2 and len(r[0].out) == 3 for r in out)
    assert s.batches == 2                  # the three that waited went as one batch


def test_an_abort_pause_ends_the_batch(model: torch.nn.Module) -> None:
    def gate(k: int) -> None:
        if k == 2:
            raise Aborted()
    (row,) = _run(_sampler(model, gate), [1, 2], max_new_tokens=10)
    assert row.finish == "abort" and len(row.out) == 2
