"""A trainer process that pushes a version through transport `nixl` and SIGKILLs itself once
bucket 2 is announced (the engines are reading its memory then). Usage: python trainer_script.py
CONFIG_JSON VERSION."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from weightsync import WeightSync
from weightsync.testing import perturb, sample_state_dict
from weightsync_nixl.sending import NixlTransport

_send = NixlTransport.send


def send(self: NixlTransport, payload: Any, engines: Any) -> Any:
    out = _send(self, payload, engines)
    if payload.index == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return out


NixlTransport.send = send  # type: ignore[method-assign]
with WeightSync.from_config(json.loads(sys.argv[1])) as sync:
    sync.push(perturb(sample_state_dict(scale=8), int(sys.argv[2])), version=int(sys.argv[2]))
