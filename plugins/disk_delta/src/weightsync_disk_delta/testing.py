"""Helpers shared by this plugin's tests and benchmark: a tiny model trained with a real
optimizer, and a bit-exact comparison."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import pytest


class Trainer:
    """A tiny Llama saved in bf16 (what the engines start from), trained in fp32 master weights
    with AdamW and published as bf16, like a mixed-precision RL trainer: real optimizer steps,
    so which elements change is real, and the learning rate sets how many."""

    def __init__(self, model_dir: Path, lr: float = 3e-6, seed: int = 0, **arch) -> None:
        from weightsync_reference.models import build_tiny_model
        self.model: Any     # a transformers causal LM (build_tiny_model types it as a Module)
        self.model = build_tiny_model(model_dir, "llama", dtype="bfloat16", seed=seed, **arch).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed + 1)
        self.data = torch.randint(3, self.model.config.vocab_size, (4, 17), generator=g)

    def step(self) -> None:
        torch.set_num_threads(1)       # a tiny model: threads only add contention on small hosts
        self.model.train()
        loss = self.model(input_ids=self.data, labels=self.data).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict[str, torch.Tensor]:
        """The published weights: bf16 copies of the fp32 master weights."""
        return {n: t.detach().to(torch.bfloat16) for n, t in self.model.state_dict().items()}


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ (or are missing on one side); [] means bit-equal."""
    bad = sorted(set(a) ^ set(b))
    for n in set(a) & set(b):
        x, y = a[n], b[n]
        if x.dtype != y.dtype or x.shape != y.shape or \
                not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            bad.append(n)
    return bad


def publish_config(root: Path, **enc) -> dict:
    """A trainer-side config that publishes into `root` with the delta encoding."""
    return {"encoding": {"kind": "delta", "options": enc},
            "transport": {"kind": "disk_delta", "options": {"root": str(root)}},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}},
            "sync": {"progress": "off"}}


def weights_only(model_dir: Path, out: Path) -> Path:
    """A copy of a model's safetensors without config.json: a reference engine on it starts fast
    (no transformers) and holds the same tensors."""
    import shutil
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).glob("*.safetensors"):
        shutil.copy(f, out / f.name)
    return out


def raw_manifest(root: Path, version: int) -> dict:
    """A published manifest as plain JSON (to inspect or to tamper with in tests)."""
    import json
    return json.loads((Path(root) / "versions" / f"v{version:08d}" / "manifest.json").read_bytes())


def write_manifest(root: Path, version: int, manifest: dict) -> None:
    import json
    (Path(root) / "versions" / f"v{version:08d}" / "manifest.json").write_text(json.dumps(manifest))


HOOK_CALLS: list[str] = []


def record_hook(path: str) -> None:
    """A before_read/after_write hook for tests: records every path it is called with."""
    HOOK_CALLS.append(path)


def small_model(seed: int = 0, n: int = 12) -> dict[str, torch.Tensor]:
    """`n` small bf16 tensors (and one fp32), the shapes of a model's matrices and norms."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(48, 64, generator=g).to(torch.bfloat16) for i in range(n - 1)}
    out["norm.weight"] = torch.randn(32, generator=g)
    return out


def next_version(state: dict[str, torch.Tensor], seed: int, density: float = 0.01
                 ) -> dict[str, torch.Tensor]:
    """`state` with about `density` of every tensor's elements changed (a trainer's step)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in state.items():
        t = t.clone()
        flat = t.view(-1)
        k = max(1, int(density * flat.numel()))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        flat[idx] = flat[idx] + torch.randn(k, generator=g).to(t.dtype)
        out[n] = t
    return out


def publish(root: Path, states: dict[int, dict[str, torch.Tensor]], keep_full: int = 100,
            **enc) -> None:
    """Publish `states` (version -> tensors) in order into `root`: the first full, then deltas."""
    from weightsync import WeightSync
    cfg = publish_config(root, **enc)
    cfg["transport"]["options"]["keep_full"] = keep_full
    with WeightSync.from_config(cfg) as sync:
        for v, sd in sorted(states.items()):
            assert sync.push(sd, version=v).ok


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / "versions" / f"v{version:08d}"


def rewrite_shard(root: Path, version: int, file: str, data: bytes) -> None:
    """Replace a shard's bytes and make the manifest's size and checksum match them, as a
    publisher that corrupted them before hashing would."""
    import xxhash
    (version_dir(root, version) / file).write_bytes(data)
    m = raw_manifest(root, version)
    for s in m["shards"]:
        if s["file"] == file:
            s["bytes"], s["xxh3"] = len(data), xxhash.xxh3_128(data).hexdigest()
    write_manifest(root, version, m)


def shard_arrays(root: Path, version: int, file: str) -> dict[str, torch.Tensor]:
    """The arrays of a published shard (copies)."""
    from weightsync.wire.frame import unpack
    data = bytearray((version_dir(root, version) / file).read_bytes())
    return {n: t.clone() for n, t in unpack(data)[0]}


def set_shard_arrays(root: Path, version: int, file: str, arrays: dict[str, torch.Tensor]) -> None:
    """Rewrite a shard from `arrays` (checksum fixed, see rewrite_shard)."""
    from weightsync.wire.frame import pack
    body = pack(sorted(arrays.items()))
    rewrite_shard(root, version, file, bytes(body.numpy()))


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    from weightsync.wire.bucket import tensor_digest
    return {n: tensor_digest(n, t) for n, t in state.items()}


def whole_version(local: Path, states: dict[int, dict[str, torch.Tensor]]) -> int | None:
    """The version the local checkpoint holds after recovery, checked bit for bit against the
    published one (AssertionError when it is not one whole version)."""
    from .local import LocalCheckpoint
    lc = LocalCheckpoint(local)
    with lc.locked():
        v = lc.version
        if v is None:
            assert lc.data_dir() is None, "no version, but a data directory is linked"
            return None
        assert v in states, f"the local checkpoint holds version {v}, which was never published"
        got = {n: t for n, t in lc.tensors().items()}
        assert bit_equal(got, states[v]) == [], f"the local checkpoint is not whole version {v}"
        assert lc.verify() == []
        d = lc.data_dir()
        assert d is not None and not [p.name for p in d.iterdir() if p.name.startswith(".")
                                      or p.name == "journal"], "leftovers in the data directory"
    return v


KERNEL_PATHS = ["numba", "numba-python-hash", "numpy"]


def use_kernel_path(path: str, monkeypatch: "pytest.MonkeyPatch") -> None:
    """numba's kernels feeding the xxHash C state, numba's kernels hashing through Python in
    chunks (where the xxhash package exports no C functions), or numpy/torch without numba."""
    from weightsync.wire import digests as hashing

    from . import kernels
    monkeypatch.setattr(kernels, "JIT", path != "numpy")
    if path == "numpy":
        assert kernels.jit() is None
    else:
        assert kernels.jit() is not None, "numba is installed in the test environment"
    if path == "numba-python-hash":
        monkeypatch.setattr(hashing, "_loaded", True)
        monkeypatch.setattr(hashing, "_lib", None)
        assert hashing.Digest(b"").address is None
