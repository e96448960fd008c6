"""What the `weightsync` backend accepts, from the vLLM server's environment: vLLM's `--api-key`
covers only `/v1/*`, so its weight-transfer routes need a token of their own, and a reload from
disk must stay below the directories the operator named."""

from __future__ import annotations

import os
from pathlib import Path

from weightsync.errors import PayloadError

TOKEN_ENV = "WEIGHTSYNC_VLLM_TOKEN"
TOKEN_FILE_ENV = "WEIGHTSYNC_VLLM_TOKEN_FILE"
ROOTS_ENV = "WEIGHTSYNC_VLLM_LOAD_ROOTS"
INSECURE_ENV = "WEIGHTSYNC_VLLM_INSECURE"


def insecure() -> bool:
    """The operator chose to run without a token ($WEIGHTSYNC_VLLM_INSECURE=1): a trusted host."""
    return os.environ.get(INSECURE_ENV, "") in ("1", "true", "yes")


def load_token() -> str | None:
    """$WEIGHTSYNC_VLLM_TOKEN, else the first line of $WEIGHTSYNC_VLLM_TOKEN_FILE (None: open)."""
    token = os.environ.get(TOKEN_ENV)
    path = os.environ.get(TOKEN_FILE_ENV)
    if not token and path:
        token = Path(path).read_text().strip()
    if token is not None and token and len(token) < 16:
        raise ValueError(f"${TOKEN_ENV} must be at least 16 characters")
    return token or None


def load_roots() -> list[Path] | None:
    """The directories `load_from_disk` may read below ($WEIGHTSYNC_VLLM_LOAD_ROOTS, separated
    by the OS path separator); None when unset: any directory the server can read."""
    raw = os.environ.get(ROOTS_ENV)
    if not raw:
        return None
    return [Path(p).resolve() for p in raw.split(os.pathsep) if p]


def check_root(path: str, roots: list[Path] | None) -> None:
    """Refuse a checkpoint directory outside every load root (links resolved first)."""
    if roots is None:
        return
    real = Path(path).resolve()
    if not any(real == r or r in real.parents for r in roots):
        raise PayloadError(f"load_from_disk {path!r} is outside ${ROOTS_ENV} "
                           f"({os.pathsep.join(str(r) for r in roots)}); publish the checkpoint "
                           f"below one of them or add its directory to ${ROOTS_ENV}")
