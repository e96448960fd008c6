"""The walk of one push: which folders of weightsync a `WeightSync.push` over http into one
reference engine enters, in order of first entry, and how many calls go back into a folder that
is already on the call stack (a layer calling up into the one that called it).

    python benchmarks/structure/push_walk.py

Profiles every Python call of the trainer's process (its threads included) during the first
push; module-level code (imports) is left out. Modules of other distributions count under their
package's name (the reference adapter is `weightsync_reference`)."""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import weightsync
from weightsync_reference.models import build_tiny_model, load_trainer_model
from weightsync_reference.processes import running


def folder_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "weightsync":
        return parts[0]
    return "(root)" if len(parts) <= 2 else parts[1]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="weightsync-walk-"))
    build_tiny_model(tmp / "m")
    model = load_trainer_model(tmp / "m")
    order: list[str] = []
    functions: set[tuple[str, str]] = set()
    back: dict[str, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("weightsync") \
                or frame.f_code.co_name == "<module>":
            return
        functions.add((module, frame.f_code.co_name))
        me = folder_of(module)
        if me not in order:
            order.append(me)
        stack, f = [], frame.f_back
        while f is not None:
            m = f.f_globals.get("__name__", "")
            if m.startswith("weightsync"):
                stack.append(folder_of(m))
            f = f.f_back
        if stack and stack[0] != me and me in stack[1:]:
            path = " -> ".join(reversed(stack[:stack.index(me, 1) + 1])) + " -> " + me
            back[path] = back.get(path, 0) + 1

    with running(tmp / "m", tmp, 1) as engines:
        config = {"transport": "http", "adapter": "reference",
                  "engines": [{"url": engines[0].url}]}
        sync = weightsync.WeightSync.from_config(config)
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            sync.push(model, version=1)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)   # type: ignore[arg-type]
            sync.close()
    print(f"{len({m for m, _ in functions})} modules, {len(functions)} functions")
    print("root modules of core entered:",
          sorted({m for m, _ in functions if m.startswith("weightsync.") and m.count(".") == 1}))
    print("folders in order of first entry:", " -> ".join(order))
    print("calls back into a folder already on the stack:", sum(back.values()))
    for path, n in sorted(back.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {n:4d}  {path}")


if __name__ == "__main__":
    main()
