"""`load_from_disk` follows the version rules and the HMAC signing of pushes, against real
reference engines: a key holder cannot move an engine back (or relabel its version) without the
operator's `allow_older`, and an engine that holds an HMAC key loads only a checkpoint signed as
the version it is asked to load (so it cannot be jumped to a version no trainer can exceed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
import torch
from safetensors.torch import save_file

from weightsync.wire.signing import checkpoint_signature, sign_checkpoint
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import start_all
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model

KEY = "engine-key-0123456789abc"
HMAC = b"a-shared-hmac-key-0123456789"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("disk")
    sd = sample_state_dict()
    model = write_weights_only_model(d / "m", sd)
    (d / "hmac.key").write_bytes(HMAC)
    plain = EngineProcess(model, name="plain", api_key=KEY, log=d / "plain.log",
                          load_roots=[str(d)])
    signed = EngineProcess(model, name="signed", api_key=KEY, log=d / "signed.log",
                           load_roots=[str(d)], extra_args=["--hmac-key-file", str(d / "hmac.key")])
    try:
        start_all([plain, signed])
        yield {"dir": d, "sd": sd, "plain": plain, "signed": signed}
    finally:
        plain.stop()
        signed.stop()


def checkpoint(d: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    p = d / name
    p.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(p / "model.safetensors"))
    return p


def load(e: EngineProcess, path: Path, version: int, **extra: Any) -> requests.Response:
    return requests.post(e.url + "/weightsync/load_from_disk", timeout=60,
                         json={"path": str(path), "version": version, **extra},
                         headers={"Authorization": f"Bearer {KEY}"})


def same(e: EngineProcess, state: dict[str, torch.Tensor]) -> bool:
    got = e.weights()
    return all(torch.equal(got[n], t) for n, t in state.items())


def test_load_from_disk_never_moves_an_engine_back_unless_told(setup: dict[str, Any]) -> None:
    d, sd, e = setup["dir"], setup["sd"], setup["plain"]
    s1, s2 = perturb(sd, 1), perturb(sd, 2)
    c1, c2 = checkpoint(d, "c1", s1), checkpoint(d, "c2", s2)
    assert load(e, c1, 1).status_code == 200 and load(e, c2, 2).status_code == 200
    r = load(e, c1, 1)                                  # back to 1: refused
    assert r.status_code == 409 and "would move it back" in r.json()["error"]
    r = load(e, c1, 2)                                  # other bytes under the same label
    assert r.status_code == 409 and "allow_older" in r.json()["error"]
    assert e.health()["version"] == 2 and same(e, s2)
    r = load(e, c1, 1, allow_older="yes")
    assert r.status_code == 400 and "allow_older must be true or false" in r.json()["error"]
    r = load(e, c1, 1, allow_older=True)                # the operator's rollback
    assert r.status_code == 200 and e.health()["version"] == 1 and same(e, s1)


def test_an_engine_with_an_hmac_key_loads_only_signed_checkpoints(setup: dict[str, Any]) -> None:
    d, sd, e = setup["dir"], setup["sd"], setup["signed"]
    before = e.weights()
    s3 = perturb(sd, 3)
    c3 = checkpoint(d, "c3", s3)
    r = load(e, c3, 10**9)                              # a key holder without the HMAC key
    assert r.status_code == 400 and "is not signed" in r.json()["error"]
    sign_checkpoint(b"another-key-that-is-long-enough", c3, 3)
    r = load(e, c3, 3)
    assert r.status_code == 400 and "wrong signature" in r.json()["error"]
    sign_checkpoint(HMAC, c3, 3)
    r = load(e, c3, 10**9)                              # signed as 3: not any other version
    assert r.status_code == 400 and "signed as version 3, not 1000000000" in r.json()["error"]
    forged = perturb(sd, 4)                             # the files changed after signing
    save_file({k: v.contiguous() for k, v in forged.items()}, str(c3 / "model.safetensors"))
    r = load(e, c3, 3)
    assert r.status_code == 400 and "other tensors than its signature" in r.json()["error"]
    h = e.health()
    assert h["version"] == 0 and all(torch.equal(e.weights()[n], t) for n, t in before.items())
    # signed properly (in the directory, or sent with the request): loaded, bit for bit
    r = load(e, c3, 4, signature=checkpoint_signature(HMAC, c3, 4))
    assert r.status_code == 200 and e.health()["version"] == 4 and same(e, forged)
    s5 = perturb(sd, 5)
    c5 = checkpoint(d, "c5", s5)
    sign_checkpoint(HMAC, c5, 5)
    r = load(e, c5, 5)
    assert r.status_code == 200 and e.health()["version"] == 5 and same(e, s5)


def test_edge_inputs_on_the_weight_routes_are_4xx_and_lose_nothing(setup: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    """A file symlink out of the load root, a FIFO in it and versions that are not integers in
    range are each a 400 that says why; the engine keeps its weights and version and still
    answers (a FIFO opened without a writer would block a reader forever)."""
    import os
    e, d = setup["plain"], setup["dir"]
    before = e.health()["version"]
    held = e.weights()
    secret = tmp_path / "elsewhere.safetensors"             # tmp_path is not below the root
    save_file({k: v.contiguous() for k, v in perturb(setup["sd"], 7).items()}, str(secret))
    linked = d / "linked"
    linked.mkdir(exist_ok=True)
    (linked / "model.safetensors").symlink_to(secret)
    r = load(e, linked, before + 1)
    assert r.status_code == 400 and "outside" in r.json()["error"], r.text
    fifo_dir = d / "fifo"
    fifo_dir.mkdir(exist_ok=True)
    os.mkfifo(fifo_dir / "model.safetensors")
    r = load(e, fifo_dir, before + 1)
    assert r.status_code == 400 and "not a regular file" in r.json()["error"], r.text
    ok = checkpoint(d, "fine", perturb(setup["sd"], 8))
    hdr = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for bad, why in (("1e400", "must be an integer"), ("2.5", "must be an integer"),
                     ("true", "must be an integer"), (str(2**64), "outside 0..")):
        # the JSON number as written (1e400 parses to inf; requests would not send it)
        body = '{"path": "%s", "version": %s}' % (ok, bad)
        r = requests.post(e.url + "/weightsync/load_from_disk", data=body, headers=hdr, timeout=60)
        assert r.status_code == 400 and why in r.json()["error"], (bad, r.text)
        body = '{"version": %s, "transport": {"kind": "http"}, "encoding": {"kind": "raw"}}' % bad
        r = requests.post(e.url + "/weightsync/begin", data=body, headers=hdr, timeout=10)
        assert r.status_code == 400 and why in r.json()["error"], (bad, r.text)
    assert e.health()["version"] == before
    assert all(torch.equal(e.weights()[n], t) for n, t in held.items())
