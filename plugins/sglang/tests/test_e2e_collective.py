"""The distributed route end to end with a real gloo broadcast across processes: the trainer
(rank 0, store master) broadcasts each bucket's flattened bytes while the SGLang stand-in's TP
rank processes receive them through /update_weights_from_distributed (joined through
/init_weights_update_group at rank_offset + tp_rank, PrefixStore(group_name)). Rank 0 is core's
`collective` transport, and separately a rank 0 built with SGLang's own recipe."""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from typing import Any

import pytest
import torch
from weightsync.config import EngineSpec
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import SyncError
from weightsync.exporters.torch import TorchExporter
from weightsync.sync.pipeline import WeightSync
from weightsync.net.server import free_port
from weightsync.testing.sample import perturb
from weightsync.transports.collective import Broadcast, JoinGroup, LeaveGroup, split_payload
from weightsync_sglang.adapter import SGLangAdapter


def _config(engines: list[dict], timeout: float = 30.0, **sync: object) -> dict:
    return {"adapter": "sglang", "engines": engines,
            "transport": {"kind": "collective", "options": {"backend": "gloo", "timeout": timeout,
                                                            "group_name": "ws_sglang"}},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}},
            "sync": {"failure_policy": "continue", **sync}}


def _assert_holds(engine, sd: dict[str, torch.Tensor]) -> None:
    got = engine.weights()
    for n, t in sd.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), f"{engine.name}: {n} differs"


def test_three_versions_bit_exact_over_gloo(start_standin, model_sd) -> None:
    engines = [start_standin(tp_size=1, admin_key="k1"), start_standin(tp_size=2)]
    sd = model_sd
    with WeightSync.from_config(_config([e.spec() for e in engines], timeout=10.0)) as sync:
        for v in (1, 2, 3):
            sd = perturb(sd, v)
            report = sync.push(sd, version=v)
            assert report.ok and report.verified, report.summary()
            for e in engines:
                assert e.weight_version() == str(v)
                _assert_holds(e, sd)
        groups = [e.state()["groups"] for e in engines]
        assert groups[0] == groups[1] and len(groups[0]) == 1
        assert groups[0][0].startswith("ws_sglang_")
    # closing the sync destroys the group on every engine, on every TP rank
    for e in engines:
        st = e.state()
        assert st["groups"] == [] and st["rank_groups"] == [[]] * e.tp_size, st


def test_group_that_never_forms_fails_within_timeout_and_is_cleaned_up(start_standin, model_sd) -> None:
    # the adapter is told tp_size 2 but the server runs 1 rank: rank_offset + 1 never joins, so the
    # group can never form (a real misconfiguration); SGLang's own rendezvous timeout is long
    engine = start_standin(tp_size=1, group_timeout=120.0)
    timeout = 6.0
    t0 = time.monotonic()
    with WeightSync.from_config(_config([engine.spec(tp_size=2)], timeout=timeout)) as sync:
        with pytest.raises(SyncError) as e:
            sync.push(perturb(model_sd, 1), version=1)
        took = time.monotonic() - t0
        assert sync.transport.group is None
    msg = str(e.value)
    assert f"{engine.name} at open" in msg and "did not join collective group" in msg, msg
    # bounded by the transport's timeout, one retry and its grace period, never SGLang's 120 s
    assert took < 4 * timeout + 15, took
    # the engine is not left in a half-formed group: its ranks gave up once the trainer's store
    # went away, and it never moved version
    deadline = time.monotonic() + 60
    while engine.state()["joining"] and time.monotonic() < deadline:
        time.sleep(0.5)
    st = engine.state()
    assert st["joining"] == 0 and st["groups"] == [] and st["rank_groups"] == [[]], st
    assert engine.weight_version() == "default"
    _assert_holds(engine, model_sd)


def _sglang_style_group(port: int, world: int, name: str) -> Any:
    """Rank 0 the way OpenRLHF/slime trainers build it for SGLang: init_custom_process_group with
    a TCPStore master, PrefixStore(group_name) and _new_process_group_helper (no barrier)."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world
    timeout = datetime.timedelta(seconds=30)
    store = TCPStore("127.0.0.1", port, world, is_master=True, timeout=timeout, wait_for_workers=False)
    pg, _ = _new_process_group_helper(world, 0, [], Backend("gloo"), PrefixStore(name, store),
                                      group_name=name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg, store


def _in_threads(fns: list) -> tuple[list[threading.Thread], list[BaseException]]:
    errors: list[BaseException] = []

    def wrap(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        return run
    threads = [threading.Thread(target=wrap(f), daemon=True) for f in fns]
    for t in threads:
        t.start()
    return threads, errors


def test_distributed_route_with_sglang_recipe_trainer_three_versions(start_standin, model_sd) -> None:
    """The adapter's group and update bodies against the stand-in's TP rank processes, with rank 0
    built exactly as SGLang's own RL integrations build it (independent of core's transport):
    rank offsets from TP sizes, the HTTP call in flight while rank 0 broadcasts each bucket's
    flattened bytes, three versions bit-exact."""
    import torch.distributed as dist

    engines = [start_standin(tp_size=1), start_standin(tp_size=2)]
    adapters = [SGLangAdapter(SGLangAdapter.Options(tp_size=e.tp_size), EngineSpec(**e.spec()))
                for e in engines]
    world = 1 + sum(a.group_size() for a in adapters)
    name, port = f"sglang_recipe_{uuid.uuid4().hex[:8]}", free_port()
    infos, offset = [], 1
    for a in adapters:
        infos.append({"master_address": "127.0.0.1", "master_port": port, "rank_offset": offset,
                      "world_size": world, "group_name": name, "backend": "gloo"})
        offset += a.group_size()
    threads, errors = _in_threads([lambda a=a, i=i: a.deliver(JoinGroup(i)) for a, i in zip(adapters, infos)])
    pg, store = _sglang_style_group(port, world, name)
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [e.state()["rank_groups"] for e in engines] == [[[name]], [[name], [name]]]
    exporter, encoding = TorchExporter(TorchExporter.Options(bucket_bytes=4096)), RawEncoding()
    sd = model_sd
    for v in (1, 2, 3):
        sd = perturb(sd, v)
        for a in adapters:
            a.begin(v, {})
        sent = {}
        for bucket in exporter.buckets(sd):
            payload = encoding.encode(bucket)
            data, dtype, specs = split_payload(payload.body, "flat")[0]
            header = payload.header(group_name=name, layout="flat", nbytes=data.numel(), dtype=dtype,
                                    numel=data.numel(), tensors=specs)
            threads, errors = _in_threads([lambda a=a, h=header: a.deliver(Broadcast(h))
                                           for a in adapters])
            dist.broadcast(data, src=0, group=pg)
            for t in threads:
                t.join(60)
            assert not errors, errors
            sent[payload.index] = payload.digest
        for a in adapters:
            assert a.end() == sent          # every bucket acknowledged
            a.commit(v)
        for e in engines:
            assert e.weight_version() == str(v)
            _assert_holds(e, sd)
    for a, i in zip(adapters, infos):
        a.deliver(LeaveGroup(i))
    assert [e.state()["rank_groups"] for e in engines] == [[[]], [[], []]]
    dist.destroy_process_group(pg)
    del store
