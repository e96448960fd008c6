"""End to end across processes: this process is the trainer; engines are reference-engine
processes serving a real tiny Llama. Runs over every installed core transport."""

import threading

import pytest
import torch

from weightsync import SyncError, WeightSync
from weightsync.plugins import load_components
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import start_all
from weightsync_reference.models import build_tiny_model, greedy

INSTALLED = load_components().transports
TRANSPORTS = [t for t in ("http", "shm", "collective") if t in INSTALLED]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e") / "model"
    build_tiny_model(d, "llama", hidden=64, intermediate=256, layers=4)
    return d


@pytest.fixture
def engines(model_dir, tmp_path):
    procs = start_all([EngineProcess(model_dir, name=f"engine{i}", log=tmp_path / f"engine{i}.log")
                       for i in range(2)])
    yield procs
    for p in procs:
        p.stop()


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(3, model.config.vocab_size, (4, 17), generator=g)
    model.train()
    model(input_ids=data, labels=data).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def config(transport, engines, **sync):
    return {"transport": transport, "engines": [e.spec() for e in engines],
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 64 * 1024}},
            "sync": {"progress": "off", **sync}}


def assert_bit_exact(engine, model):
    got = engine.weights()
    for n, t in model.state_dict().items():
        assert torch.equal(got[n], t), f"{engine.name}: {n} differs"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_three_versions_into_two_engines_bit_exact(transport, model_dir, engines):
    from weightsync_reference.models import load_trainer_model
    model = load_trainer_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with WeightSync.from_config(config(transport, engines)) as sync:
        for v in (1, 2, 3):
            train_step(model, opt, v)
            report = sync.push(model, version=v)
            assert report.ok and report.verified and report.version == v, report.summary()
            assert report.buckets > 1 and report.wire_bytes >= report.logical_bytes
            for e in engines:
                assert e.health()["version"] == v
                assert_bit_exact(e, model)
    prompt = [1, 11, 23, 5]
    want = greedy(model, prompt, 6)
    for e in engines:
        assert e.generate(prompt, 6)["output_ids"] == want


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_killed_mid_push_then_restarted(transport, model_dir, engines):
    """engine1 is SIGKILLed while buckets are streaming: the push fails for it alone, engine0 ends
    at a whole version (bit-exact), and after a restart the next push reaches both."""
    from weightsync_reference.models import load_trainer_model
    model = load_trainer_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    victim, survivor = engines[1], engines[0]
    killed = threading.Event()

    def kill_midway(name, t):
        if name.startswith("model.layers.2.") and not killed.is_set():
            killed.set()
            victim.kill()
        return [(name, t)]

    with WeightSync.from_config(config(transport, engines)) as sync:
        train_step(model, opt, 1)
        assert sync.push(model, version=1).verified
        train_step(model, opt, 2)
        with pytest.raises(SyncError) as e:
            sync.push(model, version=2, name_map=kill_midway)
        report = e.value.report
        assert killed.is_set()
        assert not report.engines[victim.name].ok and victim.name in str(e.value)
        # collective: the broken broadcast is resent to the survivor through a rebuilt group
        assert report.engines[survivor.name].ok
        assert survivor.health()["version"] == 2
        assert_bit_exact(survivor, model)
        victim.start()
        assert victim.health()["version"] == 0
        train_step(model, opt, 3)
        report = sync.push(model, version=3)
        assert report.ok and report.verified, report.summary()
        for e in engines:
            assert e.health()["version"] == 3
            assert_bit_exact(e, model)
