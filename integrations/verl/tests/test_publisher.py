"""The two halves under the verl backend, in one process with real HTTP: a bucket whose bytes
differ from the manifest is caught before anything of it is yielded, and a replica that
registered but never pulls holds a round only until its deadline, and is named."""

from __future__ import annotations

import pytest
import torch
from weightsync.errors import PayloadError

from weightsync_verl.publisher import Publisher
from weightsync_verl.subscriber import Subscriber


@pytest.fixture()
def publisher() -> Publisher:
    p = Publisher(bucket_bytes=4096, lease=5.0)
    yield p
    p.close()


def test_corrupted_bucket_is_refused_before_it_is_yielded(publisher: Publisher) -> None:
    named = {f"w{i}": torch.full((512,), float(i)) for i in range(4)}     # 2 KiB each: 2 per bucket
    publisher.publish(named, 1)
    named["w3"][0] = 99.0                      # bytes change after the manifest was hashed
    sub = Subscriber(publisher.metadata(), "r1")
    got = []
    try:
        with pytest.raises(PayloadError, match="digest"):
            for n, t in sub.pull():
                got.append(n)
        assert got == ["w0", "w1"] and sub.version == 0     # bucket 0 was good; 1 was not
        # the replica told the trainer: the round names it at once instead of waiting it out
        reached, left, missing = publisher.wait(1, timeout=120.0)
        assert reached == [] and missing == [] and "digest" in publisher.failures[1]["r1"]
    finally:
        sub.leave()


def test_a_replica_that_never_pulls_is_named_at_the_deadline(publisher: Publisher) -> None:
    good, idle = Subscriber(publisher.metadata(), "good"), Subscriber(publisher.metadata(), "idle")
    try:
        v = publisher.publish({"w": torch.arange(10.0)})
        assert [n for n, _ in good.pull()] == ["w"]
        reached, left, missing = publisher.wait(v, timeout=1.0)
        assert reached == ["good"] and missing == ["idle"] and left == []
        assert publisher.replicas()["good"]["version"] == v
    finally:
        good.leave()
        idle.leave()


def test_versions_must_grow(publisher: Publisher) -> None:
    publisher.publish({"w": torch.zeros(2)}, 5)
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish({"w": torch.zeros(2)}, 5)


def test_wrong_share_token_is_refused(publisher: Publisher) -> None:
    publisher.publish({"w": torch.zeros(2)})
    bad = {**publisher.metadata(), "token": "x" * 32}
    sub = Subscriber(bad, "r-bad")
    try:
        with pytest.raises(PayloadError, match="401"):
            list(sub.pull())
    finally:
        sub.leave()
