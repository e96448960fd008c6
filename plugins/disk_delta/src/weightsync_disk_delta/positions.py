"""Changed positions, stored as gaps. Positions are strictly ascending, so each one is stored as
its distance from the previous one: at 1 % density the gaps average 100, so most fit one byte.

    idx     int32 (int64 past 2**31 elements) positions, as they are
    gap8    uint8 gaps; 0 marks a gap above 255, taken in order from `far`
    gap16   uint16 gaps (stored as int16: the same bits, a dtype every reader knows); 0 marks
            a gap above 65535, taken in order from `far`

`encode` picks the smallest form; `decode` validates, so a corrupt payload cannot write out of
place: every gap is at least 1 (so positions ascend), no gap is larger than the tensor (so the
running position cannot overflow), and every position is inside the tensor."""

from __future__ import annotations

import numpy as np
import torch

from weightsync.errors import PayloadError

from . import kernels

FORMS = {"gap8": (np.uint8, 255), "gap16": (np.uint16, 65535)}
_STORED = {np.uint8: np.uint8, np.uint16: np.int16}
_TORCH_STORED = {"gap8": torch.uint8, "gap16": torch.int16}


def arrays_of(form: str) -> list[str]:
    """The array suffixes a form occupies next to the values."""
    if form == "idx":
        return ["idx"]
    if form in FORMS:
        return [form, "far"]
    raise PayloadError(f"unknown positions form {form!r}")


def encode(idx: torch.Tensor, numel: int, over: tuple[int, int] | None = None
           ) -> tuple[str, dict[str, torch.Tensor]]:
    """(form, suffix -> array) of ascending int64 positions, in the fewest bytes. `over`: how
    many gaps exceed 255 and 65535, when the caller counted them already (kernels.scan does)."""
    far_t = np.int32 if numel < 2**31 else np.int64
    far_size = np.dtype(far_t).itemsize
    p = idx.numpy()
    n = p.size
    if over is None:
        g = np.diff(p, prepend=-1)
        over = (int(np.count_nonzero(g > 255)), int(np.count_nonzero(g > 65535)))
    best, best_bytes = "idx", n * far_size
    for (form, (t, _)), escapes in zip(FORMS.items(), over):
        nbytes = n * np.dtype(t).itemsize + far_size * escapes
        if nbytes < best_bytes:
            best, best_bytes = form, nbytes
    if best == "idx":
        return best, {"idx": torch.from_numpy(p.astype(far_t))}
    t, top = FORMS[best]
    small, far = kernels.gaps(p, top, t, far_t, over[0] if best == "gap8" else over[1])
    return best, {best: torch.from_numpy(small.view(_STORED[t])), "far": torch.from_numpy(far)}


def decode(name: str, form: str, parts: dict[str, torch.Tensor], count: int, numel: int) -> torch.Tensor:
    """Ascending int64 positions, checked: `count` of them (at most `numel`), all inside `numel`."""
    if count > numel:
        raise PayloadError(f"tensor {name!r}: {count} changed positions in a tensor of {numel} "
                           f"elements; the payload is corrupted")
    if form == "idx":
        idx = parts["idx"]
        if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1 or idx.numel() != count:
            raise PayloadError(f"tensor {name!r}: malformed positions ({idx.dtype} {list(idx.shape)})")
        idx = idx.to(torch.int64)
        if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= numel
                            or not bool((idx[1:] > idx[:-1]).all())):
            raise PayloadError(f"tensor {name!r}: sparse delta positions are out of range 0..{numel - 1} "
                               f"or not ascending; the payload is corrupted")
        return idx
    if form not in FORMS:
        raise PayloadError(f"tensor {name!r}: unknown positions form {form!r}")
    t, _ = FORMS[form]
    small, far = parts[form], parts["far"]
    if small.dtype != _TORCH_STORED[form] or small.dim() != 1 or small.numel() != count \
            or far.dtype not in (torch.int32, torch.int64) or far.dim() != 1:
        raise PayloadError(f"tensor {name!r}: malformed {form} positions ({small.dtype} "
                           f"{list(small.shape)}, escapes {far.dtype} {list(far.shape)})")
    pos = kernels.ungap(small.numpy().view(t), far.numpy(), numel)
    if pos is None:
        raise PayloadError(f"tensor {name!r}: {form} positions do not match their escapes or run "
                           f"past the tensor's {numel} elements; the payload is corrupted")
    return torch.from_numpy(pos)
