"""Core's built-ins pass the contract kit."""

from pathlib import Path

import torch

from weightsync.adapters.reference import ReferenceAdapter
from weightsync.config import EngineSpec
from weightsync.encodings.cast import CastEncoding
from weightsync.encodings.raw import RawEncoding
from weightsync.exporters.torch import TorchExporter
from weightsync.testing import (AdapterContract, EncodingContract, EngineProcess, ExporterContract,
                                TransportContract, write_weights_only_model)
from weightsync.transports.http import HttpTransport


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


def _read(spec: EngineSpec, names):
    import requests
    from safetensors.torch import load
    r = requests.get(spec.url + "/weights", params={"name": names},
                     headers={"Authorization": f"Bearer {spec.api_key}"}, timeout=30)
    r.raise_for_status()
    return load(r.content)
