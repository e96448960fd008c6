"""A reference engine whose answer to one commit is lost: at version `LOST_ANSWER_AT` (an
environment variable) it commits and then fails the call, as an engine whose reply dies on the
way back would, so the trainer's commit fails while the engine holds the version. Run as
`python lost_answer_engine.py serve ...` (the same arguments as `weightsync serve`)."""

from __future__ import annotations

import os
import sys

from weightsync.cli import main
from weightsync_reference.server import engine as engine_module

_commit = engine_module.ReferenceEngine.commit
LOST_AT = int(os.environ.get("LOST_ANSWER_AT", "2"))


def commit_then_fail(self, rid, version):  # noqa: ANN001, ANN201
    _commit(self, rid, version)
    if version == LOST_AT:
        raise RuntimeError(f"the answer to the commit of version {version} was lost")


engine_module.ReferenceEngine.commit = commit_then_fail

if __name__ == "__main__":
    sys.exit(main())
