"""Run with SGLang 0.5.23's code on the path (see test_generate.py): each sampling_params dict of a
/generate body (argv[1], JSON) is built and verified as SGLang's own SamplingParams, and the body's
keys are checked against GenerateReqInput's fields (read from SGLang's source: io_struct.py needs
torchvision to import). Prints one JSON line."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import sglang
from sglang.srt.sampling.sampling_params import SamplingParams


def main() -> None:
    body = json.loads(Path(sys.argv[1]).read_text())
    src = Path(sglang.__file__).parent / "srt" / "managers" / "io_struct.py"
    cls = next(n for n in ast.parse(src.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fields = {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign)}
    known = set(SamplingParams.__struct_fields__)
    parsed, errors = [], []
    for sp in body["sampling_params"]:
        try:
            s = SamplingParams(**sp)
            s.verify(1000)
            s.normalize(None)
            parsed.append({"top_k": s.top_k, "temperature": s.temperature, "top_p": s.top_p,
                           "max_new_tokens": s.max_new_tokens, "sampling_seed": s.sampling_seed,
                           "stop_token_ids": sorted(s.stop_token_ids or [])})
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    print(json.dumps({"unknown_body_keys": sorted(set(body) - fields),
                      "unknown_sampling_keys": sorted({k for sp in body["sampling_params"] for k in sp} - known),
                      "parsed": parsed, "errors": errors, "top_k_all": 1 << 30}))


if __name__ == "__main__":
    main()
