"""What users can turn on against a hostile network path: TLS to the engines (the client checks
the engine's certificate against a CA bundle), and signed payloads (an HMAC key shared by the
trainer and the engines) that make a forged version fail loudly."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import requests
import torch

from weightsync import SyncError, WeightSync
from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync_reference.processes import EngineProcess
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync.wire.frame import frame

KEY = "hmac-key-shared-by-trainer-and-engines"


def make_ca_and_cert(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1 signed by it (openssl, as an operator would)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=weightsync test CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "engine.key",
        "-out", "engine.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "engine.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "ext.cnf", "-out", "engine.pem")
    return d / "ca.pem", d / "engine.pem", d / "engine.key"


def test_tls_engines_are_checked_against_the_ca_bundle(tmp_path: Path) -> None:
    ca, cert, key = make_ca_and_cert(tmp_path)
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    with EngineProcess(model, name="tls", log=tmp_path / "e.log", scheme="https", verify=str(ca),
                       extra_args=["--tls-cert", str(cert), "--tls-key", str(key)]) as eng:
        assert eng.url.startswith("https://")
        for transport in ("http", "shm"):
            cfg = {"engines": [eng.spec()], "transport": {"kind": transport} if transport == "http"
                   else {"kind": "shm", "options": {"device": "cpu"}}, "sync": {"progress": "off"}}
            v = eng.health()["version"] + 1
            new = perturb(sd, v)
            with WeightSync.from_config(cfg) as sync:
                assert sync.push(new, version=v).verified
            got = eng.weights()
            assert all(torch.equal(got[n], t) for n, t in new.items())
        bad = {"engines": [{**eng.spec(), "verify": True}], "sync": {"progress": "off"}}
        with WeightSync.from_config(bad) as sync, pytest.raises(SyncError) as err:
            sync.push(perturb(sd, 9), version=9)       # the system CAs do not know this engine
        assert "cannot connect" in str(err.value) or "certificate" in str(err.value).lower()
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(eng.url + "/health", timeout=5)


def test_signed_payloads_make_a_forged_version_fail_loudly(tmp_path: Path) -> None:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    keyfile = tmp_path / "hmac.key"
    keyfile.write_text(KEY)
    with EngineProcess(model, name="e", log=tmp_path / "e.log",
                       extra_args=["--hmac-key-file", str(keyfile)]) as eng:
        base = {"engines": [eng.spec()], "sync": {"progress": "off"},
                "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
        good = {**base, "sync": {"progress": "off", "hmac_key_file": str(keyfile)}}
        v1 = perturb(sd, 1)
        with WeightSync.from_config(good) as sync:
            assert sync.push(v1, version=1).verified
        # a sender without the key, and one with another key: refused, nothing applied
        wrong = tmp_path / "wrong.key"
        wrong.write_text("not-the-shared-key-0000")
        for cfg, words in ((base, "has no signature"),
                           ({**base, "sync": {"progress": "off", "hmac_key_file": str(wrong)}},
                            "has a wrong signature")):
            with WeightSync.from_config(cfg) as sync, pytest.raises(SyncError) as err:
                sync.push(perturb(sd, 2), version=2)
            assert words in str(err.value) and "nothing was applied" in str(err.value)
            assert eng.health()["version"] == 1
        # a forger on the path: valid round, valid digest, no key
        r = requests.post(eng.url + "/weightsync/begin", json={"version": 2, "lease": 5,
                          "transport": {"kind": "http"}, "encoding": {"kind": "raw"}}, timeout=10)
        rid = r.json()["round"]
        forged = {"model.norm.weight": torch.full_like(sd["model.norm.weight"], 7.0)}
        p = RawEncoding().encode(Bucket(0, list(forged.items()), last=True))
        body = b"".join(bytes(x) for x in frame(p.header(), p.body))
        resp = requests.post(eng.url + "/weightsync/payload", data=body,
                             headers={"X-Weightsync-Round": rid}, timeout=10)
        assert resp.status_code == 400 and "has no signature" in resp.json()["error"]
        requests.post(eng.url + "/weightsync/abort", headers={"X-Weightsync-Round": rid}, timeout=10)
        got = eng.weights()
        assert all(torch.equal(got[n], t) for n, t in v1.items()) and eng.health()["version"] == 1
