"""A safe, exact JSON codec for driver state: never pickle, never evaluate.

Owns: encoding the values that stateful objects, RNGs and counters hand us (dict, list, tuple,
int, float including nan/inf/-0.0, str, bool, None, bytes, small NumPy arrays and scalars,
small torch tensors) into plain JSON, and decoding them back to equal values of the same
types. Anything else is refused with a ``CodecError`` naming its path and the fix.

Tagged values are single-key-free dicts carrying the reserved key ``"__jaxckpt__"``; a user
dict that happens to use that key is itself stored in tagged form, so decoding is never
ambiguous. Decoding accepts only the tags below; an unknown tag is an error, not a guess.

Must not import: jax, orbax. torch is touched only when a value is already a torch tensor
(encode) or a checkpoint holds one (decode), and only via ``sys.modules``/lazy import.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from typing import Any

import numpy as np

from ..errors import CodecError

__all__ = ["encode", "decode", "dumps", "loads", "MAX_ARRAY_BYTES"]

TAG = "__jaxckpt__"
#: Arrays larger than this belong in the checkpointed array state, not in JSON.
MAX_ARRAY_BYTES = 64 * 1024 * 1024

_FIX = ("Store only JSON-like values (dict/list/tuple/str/int/float/bool/None), bytes and "
        "small NumPy arrays in state_dict(); put large arrays in the checkpointed state "
        "instead, and convert custom objects to dicts.")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, path: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except Exception as exc:  # binascii.Error, UnicodeEncodeError
        raise CodecError(f"{path}: invalid base64 payload in checkpoint: {exc}") from exc


def _dtype_from_name(name: str, path: str) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except TypeError:
        try:  # bfloat16, float8_*: registered with NumPy by ml_dtypes
            import ml_dtypes

            dtype = np.dtype(getattr(ml_dtypes, name))
        except Exception as exc:
            raise CodecError(f"{path}: unknown array dtype {name!r} in checkpoint") from exc
    # Only plain numeric/bool dtypes: object arrays could smuggle in references to code.
    numeric = dtype.kind in "biufc" or dtype.type.__module__.startswith("ml_dtypes")
    if dtype.hasobject or dtype.fields is not None or not numeric:
        raise CodecError(f"{path}: array dtype {name!r} is not allowed in a checkpoint")
    return dtype


def _encode_array(arr: np.ndarray, path: str) -> dict[str, Any]:
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise CodecError(f"{path}: NumPy array of dtype {arr.dtype} cannot be stored safely. "
                         + _FIX)
    if arr.nbytes > MAX_ARRAY_BYTES:
        raise CodecError(
            f"{path}: array of {arr.nbytes} bytes is too large for driver state (limit "
            f"{MAX_ARRAY_BYTES}). Put it in the checkpointed array state instead.")
    data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
    return {TAG: "ndarray", "dtype": arr.dtype.name, "shape": list(arr.shape),
            "data": _b64(data.tobytes())}


def encode(value: Any, path: str = "$") -> Any:
    """Turn ``value`` into plain JSON data (exactly reversible with :func:`decode`)."""
    # bool before int: bool is an int subclass.
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and type(value) is int:
        return value
    if type(value) is float:
        if math.isfinite(value):
            return value
        return {TAG: "float", "value": repr(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {TAG: "bytes", "data": _b64(bytes(value))}
    if isinstance(value, dict):
        if all(type(k) is str for k in value) and TAG not in value:
            return {k: encode(v, f"{path}[{k!r}]") for k, v in value.items()}
        items = []
        for k, v in value.items():
            if isinstance(k, (dict, list)):
                raise CodecError(f"{path}: dict key {k!r} is not hashable data. " + _FIX)
            items.append([encode(k, f"{path}.key({k!r})"), encode(v, f"{path}[{k!r}]")])
        return {TAG: "dict", "items": items}
    if type(value) is list:
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {TAG: "tuple", "items": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, np.ndarray):
        return _encode_array(value, path)
    if isinstance(value, np.generic):
        arr = np.asarray(value)
        enc = _encode_array(arr, path)
        enc[TAG] = "npscalar"
        return enc
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            enc = _encode_array(tensor.view(torch.int16).numpy(), path)
            enc["dtype"] = "bfloat16"
        else:
            enc = _encode_array(tensor.numpy(), path)
        enc[TAG] = "torch"
        return enc
    raise CodecError(f"{path}: value of type {type(value).__module__}.{type(value).__qualname__} "
                     f"is not supported in driver state. " + _FIX)


def _decode_array(obj: dict[str, Any], path: str) -> np.ndarray:
    dtype = _dtype_from_name(str(obj.get("dtype")), path)
    shape = obj.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CodecError(f"{path}: invalid array shape {shape!r} in checkpoint")
    raw = _unb64(obj.get("data", ""), path)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise CodecError(f"{path}: array payload has {len(raw)} bytes, expected {expected} "
                         f"for shape {shape} {dtype}")
    little = dtype.newbyteorder("<")
    return np.frombuffer(raw, dtype=little).astype(dtype, copy=True).reshape(shape)


def decode(value: Any, path: str = "$") -> Any:
    """Inverse of :func:`encode`. Unknown tags and malformed payloads raise ``CodecError``."""
    if isinstance(value, list):
        return [decode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {k: decode(v, f"{path}[{k!r}]") for k, v in value.items()}
    tag = value[TAG]
    if tag == "float":
        text = value.get("value")
        if text not in ("nan", "inf", "-inf"):
            raise CodecError(f"{path}: invalid special float {text!r} in checkpoint")
        return float(text)
    if tag == "bytes":
        return _unb64(value.get("data", ""), path)
    if tag == "tuple":
        return tuple(decode(v, f"{path}[{i}]") for i, v in enumerate(value.get("items", [])))
    if tag == "dict":
        out = {}
        for pair in value.get("items", []):
            if not isinstance(pair, list) or len(pair) != 2:
                raise CodecError(f"{path}: malformed dict item {pair!r} in checkpoint")
            key = decode(pair[0], f"{path}.key")
            if isinstance(key, (list, dict)):
                raise CodecError(f"{path}: unhashable dict key in checkpoint")
            out[key] = decode(pair[1], f"{path}[{key!r}]")
        return out
    if tag == "ndarray":
        return _decode_array(value, path)
    if tag == "npscalar":
        return _decode_array(value, path)[()]
    if tag == "torch":
        import torch  # only reached when the checkpoint was written from torch values

        if value.get("dtype") == "bfloat16":
            arr = _decode_array({**value, "dtype": "int16"}, path)
            return torch.from_numpy(arr).view(torch.bfloat16)
        return torch.from_numpy(_decode_array(value, path))
    raise CodecError(f"{path}: unknown tag {tag!r} in checkpoint; it was written by a newer or "
                     f"foreign tool. Upgrade jaxckpt to read it.")


def dumps(value: Any) -> str:
    """Encode and serialise to JSON text (NaN/Infinity are never emitted raw)."""
    return json.dumps(encode(value), allow_nan=False, separators=(",", ":"))


def loads(text: str | bytes) -> Any:
    """Parse JSON text written by :func:`dumps` and decode it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CodecError(f"driver state is not valid JSON: {exc}") from exc
    return decode(data)
