import json
import struct

import pytest
import torch
from safetensors.torch import load

from weightsync.errors import PayloadError
from weightsync.testing import sample_state_dict
from weightsync.wire.frame import frame, pack, unframe, unpack


def test_payload_body_is_a_valid_safetensors_file():
    sd = sample_state_dict()
    body = pack(list(sd.items()))
    loaded = load(bytes(body.numpy()))
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v)


def test_offsets_are_aligned_and_views_are_zero_copy():
    sd = sample_state_dict()
    body = pack(list(sd.items()))
    named, _ = unpack(body)
    for name, t in named:
        if t.numel():
            assert t.data_ptr() % t.element_size() == 0
            assert body.data_ptr() <= t.data_ptr() < body.data_ptr() + body.numel()


def test_cast_on_pack_converts_only_floats():
    sd = {"f": torch.randn(5), "i": torch.arange(3)}
    named = dict(unpack(pack(list(sd.items()), cast=torch.bfloat16))[0])
    assert named["f"].dtype == torch.bfloat16 and torch.equal(named["f"], sd["f"].bfloat16())
    assert named["i"].dtype == torch.int64


def _body_with_header(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("header,data,msg", [
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "do not match"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 16, "do not match"),
    ({"x": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "malformed"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}}, b"\0" * 8, "must be integers"),
    ({"x": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8, "must be integers"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}}, b"\0" * 8, "must be integers"),
    ({"x": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, b"\0" * 8, "negative dimension"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": [1]}, b"\0" * 8,
     "__metadata__ is not an object"),
])
def test_bad_headers_are_refused(header, data, msg):
    with pytest.raises(PayloadError, match=msg):
        unpack(_body_with_header(header, data))


def test_truncated_and_garbage_bodies():
    with pytest.raises(PayloadError, match="truncated"):
        unpack(b"\x01\x02")
    with pytest.raises(PayloadError, match="does not fit"):
        unpack(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(PayloadError, match="not valid JSON"):
        unpack(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(PayloadError, match="JSON list, not an object"):
        unpack(struct.pack("<Q", 2) + b"[]")


def test_frame_round_trip():
    body = torch.arange(10, dtype=torch.uint8)
    parts = frame({"index": 3}, body)
    header, got = unframe(b"".join(bytes(p) for p in parts))
    assert header == {"index": 3} and bytes(got) == bytes(range(10))


def test_read_file_header_is_safetensors_own_reading_and_refuses_a_bad_header(tmp_path) -> None:
    """The one parser of safetensors file headers agrees with the safetensors library on a real
    file, and a header length past the file or a header that is not a JSON object is refused
    with a sentence, not an exception from struct or json."""
    import struct

    import pytest
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from weightsync.errors import PayloadError
    from weightsync.wire.frame import read_file_header

    good = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.int16).reshape(2, 3), "b": torch.ones(4)}, good,
              metadata={"format": "pt"})
    start, header, meta = read_file_header(good)
    assert meta == {"format": "pt"} and set(header) == {"a", "b"}
    with safe_open(good, "pt") as f:
        for name in header:
            a, b = header[name]["data_offsets"]
            raw = good.read_bytes()[start + a: start + b]
            assert raw == f.get_tensor(name).numpy().tobytes()
    long = tmp_path / "long.safetensors"
    long.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(PayloadError, match="does not fit"):
        read_file_header(long)
    listed = tmp_path / "list.safetensors"
    listed.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(PayloadError, match="not a JSON object"):
        read_file_header(listed)
