"""The driver-state codec: exact round trips, strict decoding, clear refusals."""

import json
import math

import ml_dtypes
import numpy as np
import pytest

from jaxckpt import CodecError
from jaxckpt.core import codec


def roundtrip(value):
    text = codec.dumps(value)
    json.loads(text)  # plain JSON, no NaN/Infinity tokens
    assert "NaN" not in text and "Infinity" not in text
    return codec.loads(text)


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -7, 2**100, 1.5, -0.0, 1e-310, 0.1 + 0.2, "", "héllo \x00",
        [], (), [1, (2, 3)], ((),), {"a": 1}, {1: "int key", (1, 2): "tuple key", None: 0},
        {"__jaxckpt__": "not a tag"}, {"nested": {"__jaxckpt__": 1, "x": [b"\x00\xff"]}},
        b"", b"\x00\x01\xfe", bytearray(b"abc"),
    ],
)
def test_plain_values_round_trip_with_their_types(value):
    out = roundtrip(value)
    if isinstance(value, bytearray):
        value = bytes(value)
    assert out == value
    assert type(out) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, out) == math.copysign(1, value)


@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_special_floats(special):
    out = roundtrip([special])[0]
    assert (math.isnan(out) and math.isnan(special)) or out == special


def test_tuple_and_list_stay_distinct_inside_structures():
    out = roundtrip({"t": (1, [2, (3,)]), "l": [1, (2,)]})
    assert type(out["t"]) is tuple and type(out["t"][1]) is list and type(out["t"][1][1]) is tuple


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint32", "int64", "bool",
                                   "complex64", "float16"])
def test_arrays_round_trip_bitwise(dtype):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 4)) * 100).astype(dtype)
    out = roundtrip({"a": arr})["a"]
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()
    out[0, 0] = 0  # decoded arrays are writable copies


def test_bfloat16_and_zero_size_and_scalar_arrays():
    bf = np.arange(5, dtype=ml_dtypes.bfloat16)
    out = roundtrip([bf, np.zeros((0, 3), np.float32), np.array(7, np.int16)])
    assert out[0].dtype == bf.dtype and out[0].tobytes() == bf.tobytes()
    assert out[1].shape == (0, 3)
    assert out[2].shape == () and out[2].dtype == np.int16


def test_numpy_scalars_keep_their_dtype():
    out = roundtrip([np.float32(1.25), np.int64(-3), np.bool_(True), np.uint8(255)])
    assert [type(v) for v in out] == [np.float32, np.int64, np.bool_, np.uint8]
    assert out == [1.25, -3, True, 255]


def test_numpy_rng_states_round_trip():
    state = np.random.default_rng(5).bit_generator.state
    assert roundtrip(state) == state
    legacy = np.random.RandomState(3).get_state(legacy=False)
    out = roundtrip(legacy)
    assert out["state"]["key"].tobytes() == legacy["state"]["key"].tobytes()


def test_torch_tensor_in_loader_state_round_trips():
    torch = pytest.importorskip("torch")
    state = {"sampler": {"generator": torch.ByteTensor([1, 2, 3]), "yielded": 4},
             "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}
    out = roundtrip(state)
    assert torch.equal(out["sampler"]["generator"], state["sampler"]["generator"])
    assert out["bf"].dtype == torch.bfloat16 and torch.equal(out["bf"], state["bf"])


class Opaque:
    pass


@pytest.mark.parametrize(
    "value, path",
    [
        ({"loader": {"it": Opaque()}}, "$['loader']['it']"),
        ([1, {2, 3}], "$[1]"),
        ({"f": lambda: 0}, "$['f']"),
        ({"a": np.array([object()], dtype=object)}, "$['a']"),
        ({"s": np.zeros(2, dtype=[("x", "i4")])}, "$['s']"),
    ],
)
def test_unsupported_values_name_their_path_and_the_fix(value, path):
    with pytest.raises(CodecError) as info:
        codec.dumps(value)
    assert path in str(info.value)
    assert "state_dict" in str(info.value) or "safely" in str(info.value)


def test_oversized_array_is_refused_with_advice(monkeypatch):
    monkeypatch.setattr(codec, "MAX_ARRAY_BYTES", 1024)
    with pytest.raises(CodecError, match="too large.*checkpointed array state"):
        codec.dumps({"big": np.zeros(1000, np.float32)})


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"__jaxckpt__": "pickle", "data": "gASV"}', "unknown tag 'pickle'"),
        ('{"__jaxckpt__": "bytes", "data": "***"}', "invalid base64"),
        ('{"__jaxckpt__": "ndarray", "dtype": "float32", "shape": [4], "data": "AAAA"}',
         "payload has 3 bytes, expected 16"),
        ('{"__jaxckpt__": "ndarray", "dtype": "object", "shape": [1], "data": ""}', "dtype"),
        ('{"__jaxckpt__": "float", "value": "__import__(\'os\')"}', "invalid special float"),
        ("{not json", "not valid JSON"),
    ],
)
def test_malformed_or_foreign_payloads_are_rejected(text, message):
    with pytest.raises(CodecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        codec.loads(text)
