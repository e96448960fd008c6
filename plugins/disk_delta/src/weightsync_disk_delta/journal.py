"""The redo journal of a delta applied in place, in a data directory of the host-local checkpoint:

    journal/changes.safetensors   per tensor its positions (in the delta's compact form) and new
                                  values, or the whole new tensor (`NAME::full`)
    journal/journal.json          {"old": state, "new": state, "pos": {name: positions form}}
    journal/undo.safetensors      the values the write replaced (`NAME::old`); written only when
                                  a written delta failed its digests, before they are put back

The journal is written under a temporary name and renamed to `journal` (the commit point). A
replay after a crash either finishes the delta (no undo record) or finishes putting the old
values back (an undo record). Journals of earlier releases held the old values with the new
ones (`NAME::old` in changes.safetensors) and are still read. Everything read back is checked
against the state it belongs to, like a published delta."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from weightsync.errors import PayloadError

from . import positions
from .change import Change, check_changes
from .layout import fsync_dir, unique_tag, write_file
from .schema import LocalState, explain, numel_of
from .shards import arrays_of

JOURNAL = "journal"
UNDO = "undo.safetensors"


@dataclass
class Journal:
    old: dict[str, Any] | None           # the state before (None: a first-format journal)
    new: dict[str, Any]                  # the state after
    changes: dict[str, Change]
    undo: dict[str, torch.Tensor] | None  # replaced values, when known
    undoing: bool = False                # an undo record: the delta failed, put the old back


def commit(d: Path, changes: dict[str, Change], old: dict[str, Any], new: dict[str, Any],
           fsync: bool) -> None:
    """Write the journal of `changes` and rename it into place (the commit point)."""
    arrays: dict[str, torch.Tensor] = {}
    forms: dict[str, str] = {}
    for n, c in changes.items():
        if c.idx is None:
            arrays[n + "::full"] = c.vals.contiguous()
            continue
        forms[n] = c.form
        arrays.update({n + "::" + k: a.contiguous() for k, a in c.stored.items()})
        arrays[n + "::val"] = c.vals.contiguous()
    tmp = d / f".journal-{unique_tag()}"
    tmp.mkdir()
    save_file(arrays, str(tmp / "changes.safetensors"))
    write_file(tmp / "journal.json", json.dumps({"old": old, "new": new, "pos": forms}).encode(), fsync)
    if fsync:
        with open(tmp / "changes.safetensors", "rb+") as f:
            os.fsync(f.fileno())
        fsync_dir(tmp)
    os.rename(tmp, d / JOURNAL)                 # the commit point
    if fsync:
        fsync_dir(d)


def save_undo(d: Path, replaced: dict[str, torch.Tensor], fsync: bool) -> None:
    """Record the replaced values in the journal before they are put back, so a crash while
    putting them back is finished by the next replay."""
    j = d / JOURNAL
    tmp = j / f".undo-{unique_tag()}"
    save_file({n + "::old": t.contiguous() for n, t in replaced.items()}, str(tmp))
    if fsync:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.rename(tmp, j / UNDO)
    if fsync:
        fsync_dir(j)


def drop(d: Path) -> None:
    done = d / f".journal-done-{unique_tag()}"
    os.rename(d / JOURNAL, done)
    shutil.rmtree(done, ignore_errors=True)


def _state(raw: Any, what: str) -> dict[str, Any]:
    try:
        return LocalState.model_validate(raw).model_dump()
    except ValidationError as e:
        raise PayloadError(f"the journal's {what} state is malformed ({explain(e)})") from None


def load(d: Path) -> Journal:
    """The committed journal of `d`, every part checked against the states it holds;
    PayloadError when anything does not fit."""
    j = d / JOURNAL
    try:
        body = json.loads((j / "journal.json").read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise PayloadError(f"the journal cannot be read ({e})") from None
    if not isinstance(body, dict):
        raise PayloadError("the journal is not a JSON object")
    if "new" not in body:                 # the first format: the new state only, no undo
        body = {"old": None, "new": body}
    old = None if body.get("old") is None else _state(body["old"], "old")
    new = _state(body["new"], "new")
    forms = body.get("pos") or {}
    if not isinstance(forms, dict):
        raise PayloadError("the journal's positions forms are malformed")
    arrays = arrays_of(bytearray((j / "changes.safetensors").read_bytes()), "the journal")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, a in arrays.items():
        n, _, suffix = key.rpartition("::")
        parts.setdefault(n, {})[suffix] = a
    changes: dict[str, Change] = {}
    undo: dict[str, torch.Tensor] = {}
    for n, ps in parts.items():
        info = new["tensors"].get(n)
        if info is None:
            raise PayloadError(f"the journal changes tensor {n!r}, which its state does not have")
        if "old" in ps:
            undo[n] = ps.pop("old")
        if "full" in ps:
            changes[n] = Change(None, ps.pop("full"))
        else:
            form = forms.get(n, "idx")
            vals = ps.pop("val", None)
            if vals is None or not isinstance(form, str) or \
                    set(ps) != set(positions.arrays_of(form)):
                raise PayloadError(f"the journal's entry of tensor {n!r} is incomplete")
            idx = positions.decode(n, form, ps, vals.numel(), numel_of(info["shape"]))
            changes[n] = Change(idx, vals, dict(ps), form)
    check_changes(changes, new["tensors"], new["version"])
    undoing = (j / UNDO).exists()
    if undoing:          # only the tensors written before the failure have a record
        rec = arrays_of(bytearray((j / UNDO).read_bytes()), "the journal's undo record")
        undo = {k.rpartition("::")[0]: a for k, a in rec.items()}
        if not set(undo) <= set(changes):
            raise PayloadError("the journal's undo record names tensors it did not change")
        changes = {n: changes[n] for n in undo}
    known = old is not None and set(undo) == set(changes)
    if known:
        assert old is not None
        check_changes({n: Change(changes[n].idx, undo[n]) for n in changes}, old["tensors"],
                      old["version"])
    elif undoing:
        raise PayloadError("the journal's undo record does not cover its changes")
    return Journal(old, new, changes, undo if known else None, undoing)
