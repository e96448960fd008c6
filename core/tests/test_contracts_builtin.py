"""Core's built-ins pass the contract kit."""

from pathlib import Path


from weightsync_reference.adapter import ReferenceAdapter
from weightsync.config import EngineSpec
from weightsync.encodings.cast import CastEncoding
from weightsync.encodings.raw import RawEncoding
from weightsync.exporters.torch import TorchExporter
from weightsync.fleets.peer import HttpPeerSource, new_token
from weightsync.testing import AdapterContract, EncodingContract, ExporterContract, PeerSourceContract, ServingPeer, write_weights_only_model
from weightsync_reference.contracts import TransportContract
from weightsync_reference.processes import EngineProcess
from weightsync.testing.sample import perturb, sample_state_dict
from weightsync.transports.http.sending import HttpTransport


class TestTorchExporter(ExporterContract):
    def make_exporter(self, bucket_bytes):
        return TorchExporter(TorchExporter.Options(bucket_bytes=bucket_bytes))


class TestRawEncoding(EncodingContract):
    def make_encoding(self):
        return RawEncoding()


class TestCastEncoding(EncodingContract):
    def make_encoding(self):
        return CastEncoding(CastEncoding.Options(dtype="bfloat16"))


class TestHttpTransport(TransportContract):
    def make_transport(self, tmp_path):
        return HttpTransport(HttpTransport.Options())


class TestReferenceAdapter(AdapterContract):
    def start_engine(self, tmp_path: Path, model):
        proc = EngineProcess(write_weights_only_model(tmp_path / "m", model), api_key="k3y").start()
        return EngineSpec(url=proc.url, api_key="k3y"), proc.stop

    def make_adapter(self, spec):
        return ReferenceAdapter(ReferenceAdapter.Options(), spec)

    def read_weights(self, spec, names):
        return _read(spec, names)


class TestHttpPeerSource(PeerSourceContract):
    """A reference engine at version 1 serves; shares open as the registry opens them (the
    member's adapter), with a fresh token each."""

    def make_source(self):
        return HttpPeerSource()

    def serving_peer(self, tmp_path):
        from weightsync import WeightSync
        model = write_weights_only_model(tmp_path / "m", sample_state_dict())
        with EngineProcess(model, log=tmp_path / "peer.log") as eng:
            held = perturb(sample_state_dict(), 1)
            with WeightSync.from_config({"engines": [eng.spec()], "sync": {"progress": "off"},
                                         "exporter": {"kind": "torch",
                                                      "options": {"bucket_bytes": 8192}}}) as sync:
                assert sync.push(held, version=1).ok
            adapter = ReferenceAdapter(ReferenceAdapter.Options(), EngineSpec(url=eng.url))

            def share():
                token = new_token()
                opened = adapter.share(token, 600)
                return {"url": eng.url, "token": token, "source": opened.get("source", "http")}
            yield ServingPeer(share=share, weights=held, version=1)


def _read(spec: EngineSpec, names):
    import requests
    from safetensors.torch import load
    r = requests.get(spec.url + "/weights", params={"name": names},
                     headers={"Authorization": f"Bearer {spec.api_key}"}, timeout=30)
    r.raise_for_status()
    return load(r.content)
