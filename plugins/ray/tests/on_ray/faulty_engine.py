"""A reference engine with a load path that is wrong on purpose, for the probe's Ray test: after
every commit it scales one weight, as an engine whose own load path mangles a tensor would hold
other values than the bytes it staged and verified. An engine actor starts it through
`EngineLaunch(command=[...])` as `python faulty_engine.py serve ...` (the arguments of
`weightsync serve`). A copy of plugins/rl/tests/faulty_engine.py: a test folder's files are not
importable from another's."""

from __future__ import annotations

import sys

from weightsync.cli import main
from weightsync_reference.server import engine as engine_module

CORRUPTED = "model.layers.0.mlp.down_proj.weight"
_commit = engine_module.ReferenceEngine.commit


def commit_then_corrupt(self, rid, version):  # noqa: ANN001, ANN201
    _commit(self, rid, version)
    with self.model_lock:
        self.model.store.get(CORRUPTED).mul_(3.0)


engine_module.ReferenceEngine.commit = commit_then_corrupt

if __name__ == "__main__":
    sys.exit(main())
