"""Configs fail early (issue 43 item 3): `weightsync check` asks every engine of the fleet for its
health, version and access unless told `--offline`, and `WeightSync.preflight()` does the same
before a trainer loads its model: a wrong key and an unreachable engine are both named, at once,
against a real reference engine process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from weightsync import WeightSync
from weightsync.errors import ConfigError
from weightsync.net.server import free_port
from weightsync.testing import sample_state_dict, write_weights_only_model
from weightsync_reference.processes import EngineProcess

KEY = "engine-key-0123456789abcdef"


def _check(cfg: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightsync", "check", *args, str(cfg)],
                          capture_output=True, text=True, timeout=120)


def test_check_and_preflight_contact_every_engine(tmp_path: Path) -> None:
    model = write_weights_only_model(tmp_path / "m", sample_state_dict())
    with EngineProcess(model, name="e", api_key=KEY, log=tmp_path / "e.log") as eng:
        good = {"engines": [{"url": eng.url, "name": "e", "api_key": KEY}]}
        (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
        out = _check(tmp_path / "good.yaml")
        assert out.returncode == 0, out.stderr
        assert f"engine e ({eng.url}): reachable, version 0, access ok" in out.stdout
        assert "1 engines answered" in out.stdout

        gone = f"http://127.0.0.1:{free_port()}"
        bad = {"engines": [{"url": eng.url, "name": "e", "api_key": "wrong-key-0123456789"},
                           {"url": gone, "name": "gone"}]}
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
        out = _check(tmp_path / "bad.yaml")
        errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
        assert out.returncode == 2 and len(errors) == 2, out.stderr
        assert errors[0].startswith(f"error: engine e ({eng.url}): ") and "401" in errors[0]
        assert errors[1].startswith(f"error: engine gone ({gone}): ")
        assert _check(tmp_path / "bad.yaml", "--offline").returncode == 0   # the config is fine

        with WeightSync.from_config(good) as sync:
            assert sync.preflight() == [f"engine e ({eng.url}): reachable, version 0, access ok"]
        with WeightSync.from_config(bad) as sync, pytest.raises(ConfigError) as e:
            sync.preflight()
        assert "engine e" in str(e.value) and "engine gone" in str(e.value)
        assert eng.health()["version"] == 0          # nothing was changed by asking
