"""The verl backend's tests need verl (its own venv: `make test-verl`); without it they skip,
saying so, instead of failing to import."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.checkpoint_engine",
                    reason="verl is not installed here: `make test-verl` sets up its venv")
