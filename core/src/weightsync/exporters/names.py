"""Checking an export's names against the checkpoint an engine serves, before any byte moves, with
an error that shows the first mismatches on both sides and the option that fixes them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from weightsync.wire.frame import read_file_header


class NameMismatchError(ValueError):
    """The exported names are not the engine's: nothing was sent."""


def checkpoint_names(path: str | Path) -> list[str]:
    """The tensor names of a model directory (its safetensors index, else its files' headers),
    or of one .safetensors / .index.json file."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.is_file():
            return _index_names(index)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{p} holds no *.safetensors files and no index")
        return [n for f in files for n in _header_names(f)]
    if p.name.endswith(".index.json"):
        return _index_names(p)
    if p.suffix == ".safetensors":
        return _header_names(p)
    raise FileNotFoundError(f"{p} is neither a model directory nor a .safetensors file or index")


def _index_names(path: Path) -> list[str]:
    return list(json.loads(path.read_text())["weight_map"])


def _header_names(path: Path) -> list[str]:
    return list(read_file_header(path)[1])


def _prefix_fix(extra: Sequence[str], missing: Sequence[str]) -> tuple[str, str] | None:
    """A single prefix rewrite that turns the extra names into exactly the missing ones, if any."""
    if not extra or len(extra) != len(missing):
        return None
    want = set(missing)
    first = extra[0]
    for m in missing[:50]:
        k = 0
        while k < min(len(first), len(m)) and first[-1 - k] == m[-1 - k]:
            k += 1
        src, dst = first[:len(first) - k], m[:len(m) - k]
        if src == dst:
            continue
        if all(e.startswith(src) for e in extra) and {dst + e[len(src):] for e in extra} == want:
            return src, dst
    return None


def _show(names: Sequence[str], limit: int) -> str:
    more = f" ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_names(sent: Iterable[str], expected: Iterable[str], *, where: str,
                hints: Sequence[str] = (), skip: Sequence[str] = (), limit: int = 5) -> None:
    """Raise NameMismatchError unless `sent` and `expected` hold the same names (expected names
    matched by a `skip` regex may be left out)."""
    sent = list(sent)
    skips = [re.compile(p) for p in skip]
    expected = [n for n in expected if not any(p.search(n) for p in skips)]
    have, want = set(sent), set(expected)
    extra = [n for n in sent if n not in want]
    missing = [n for n in expected if n not in have]
    if not extra and not missing:
        return
    lines = [f"the exported tensor names do not match the engine's checkpoint ({where}): "
             f"{len(extra)} would be sent that it does not have, {len(missing)} it has would not "
             f"be sent; nothing was sent"]
    if extra:
        lines.append(f"  sent, not in the checkpoint: {_show(extra, limit)}")
    if missing:
        lines.append(f"  in the checkpoint, not sent: {_show(missing, limit)}")
    fix = _prefix_fix(extra, missing)
    if fix is not None:
        rule = json.dumps([["^" + re.escape(fix[0]), fix[1]]])
        lines.append(f"fix: exporter option rename: {rule}")
    lines += [f"fix: {h}" for h in hints]
    if fix is None and not hints:
        lines.append("fix: map the names with the exporter option `rename` (regex, replacement), "
                     "leave tensors out with `skip`, or pass push(..., name_map=...) "
                     "(weightsync.exporters.torch.split_fused splits fused tensors)")
    raise NameMismatchError("\n".join(lines))
