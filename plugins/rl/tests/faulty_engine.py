"""A reference engine with a load path that is wrong on purpose, for the probe's tests: after
every commit it scales one weight, as an engine whose own load path mangles a tensor would hold
other values than the bytes it staged and verified. Run as `python faulty_engine.py serve ...`
(the same arguments as `weightsync serve`)."""

from __future__ import annotations

import sys

from weightsync.cli import main
from weightsync_reference.server import engine as engine_module

_commit = engine_module.ReferenceEngine.commit


def commit_then_corrupt(self, rid, version):  # noqa: ANN001, ANN201
    _commit(self, rid, version)
    with self.model_lock:
        name = "model.layers.0.mlp.down_proj.weight"
        self.model.store.get(name).mul_(3.0)


engine_module.ReferenceEngine.commit = commit_then_corrupt

if __name__ == "__main__":
    sys.exit(main())
