"""The layout of one DCP tensor record, proven from its bytes without unpickling anything.

Owns: ``parse_record`` and ``Record``: where a ``torch.save(tensor)`` record's raw bytes lie
and in what layout, so ``dcp.metadata``'s reader copies them straight into the live
tensor. Nothing is assumed: the zip headers are parsed (stored entries, sizes agreeing,
zip64), the byte order must be this machine's, ``data.pkl`` is disassembled with
``pickletools.genops`` and accepted only as the exact pattern ``torch.save`` emits for one
plain contiguous tensor of a dtype in a small table, and the view must lie inside the
storage. Anything else gives ``None`` and goes to DCP's own path. The zip's CRC is not
checked: the manager's checksums of whole files cover the bytes.

Must not import: jax, orbax, torch, pickle (nothing here unpickles; the result names a dtype
by its storage name and the reader maps it).
"""

from __future__ import annotations

import dataclasses
import math
import pickletools  # restricted: genops lists opcodes, nothing is unpickled (test_security)
import struct
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["ITEM_SIZES", "Record", "parse_record"]

#: storage class name in ``data.pkl`` -> bytes per element: the only dtypes taken fast.
ITEM_SIZES: dict[str, int] = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
    "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1,
    "ByteStorage": 1, "BoolStorage": 1, "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16,
}

_END = struct.Struct("<IHHHHIIH")  # end of central directory, without its comment
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, fixed part
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, fixed part
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory, fixed part
_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator
_END_SIGNATURE, _CENTRAL_SIGNATURE, _LOCAL_SIGNATURE = 0x06054B50, 0x02014B50, 0x04034B50
_END64_SIGNATURE, _LOCATOR_SIGNATURE = 0x06064B50, 0x07064B50
_STORED = 0
_ZIP64_MARK = 0xFFFFFFFF
#: entries ``torch.save`` writes besides ``data.pkl`` and the storage (below its prefix).
_KNOWN_ENTRIES = frozenset({".format_version", ".storage_alignment", "byteorder", "version",
                            ".data/serialization_id", ".data/version"})
#: the most a record's zip directory and pickle may take before it is not torch.save's.
_MAX_SMALL = 1 << 16

Read = Callable[[int, int], bytes]


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """Where a record's tensor lies, relative to the record's first byte."""

    #: the storage class name (a key of ``ITEM_SIZES``).
    storage: str
    #: offset of the tensor's first byte (the storage entry's data plus the element offset).
    data_offset: int
    #: the tensor's shape; its strides are the contiguous ones.
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM_SIZES[self.storage]


def _directory(read: Read, length: int) -> tuple[int, int, int] | None:
    """(entry count, central directory offset, its size) from the end records of the zip
    of ``length`` bytes: the classic end record, and the zip64 one torch.save always adds
    before it (whose 64-bit fields then count); None where they are not as expected."""
    if length < _END.size:
        return None
    end_at = length - _END.size
    end = _END.unpack(read(end_at, _END.size))
    signature, disk, start_disk, on_disk, count, directory_size, directory_at, comment = end
    if signature != _END_SIGNATURE or disk or start_disk or on_disk != count or comment:
        return None
    if end_at >= _LOCATOR.size:
        locator = _LOCATOR.unpack(read(end_at - _LOCATOR.size, _LOCATOR.size))
        if locator[0] == _LOCATOR_SIGNATURE:
            end_at = locator[2]
            if locator[1] or locator[3] != 1 or end_at + _END64.size > length:
                return None
            (signature, _, _, _, disk, start_disk, on_disk, count, directory_size,
             directory_at) = _END64.unpack(read(end_at, _END64.size))
            if signature != _END64_SIGNATURE or disk or start_disk or on_disk != count:
                return None
    if directory_size > _MAX_SMALL or directory_at + directory_size != end_at:
        return None
    return count, directory_at, directory_size


def _zip64_sizes(extra: bytes, fields: list[int]) -> list[int] | None:
    """``fields`` (size, packed size, local header offset) with each 0xFFFFFFFF replaced,
    in order, by the next 64-bit value of the zip64 extra field; None if it is missing."""
    position = 0
    while position + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4:position + 4 + size]
        position += 4 + size
        if tag != 1:
            continue
        values = iter(struct.unpack_from(f"<{len(body) // 8}Q", body))
        try:
            return [next(values) if value == _ZIP64_MARK else value for value in fields]
        except StopIteration:
            return None
    return None if _ZIP64_MARK in fields else fields


def _entries(read: Read, length: int) -> dict[str, tuple[int, int]] | None:
    """name -> (offset of its data, size) of every entry of the zip of ``length`` bytes,
    each checked stored, agreeing between central and local header; None if not so."""
    found_directory = _directory(read, length)
    if found_directory is None:
        return None
    count, directory_at, directory_size = found_directory
    directory = read(directory_at, directory_size)
    found: dict[str, tuple[int, int]] = {}
    position = 0
    for _ in range(count):
        if position + _CENTRAL.size > len(directory):
            return None
        fields = _CENTRAL.unpack_from(directory, position)
        (signature, _, _, _, method, _, _, _, packed, size, name_length, extra_length,
         comment_length, _, _, _, local_at) = fields
        name_at = position + _CENTRAL.size
        name = directory[name_at:name_at + name_length]
        extra = directory[name_at + name_length:name_at + name_length + extra_length]
        position = name_at + name_length + extra_length + comment_length
        sizes = _zip64_sizes(extra, [size, packed, local_at])
        if signature != _CENTRAL_SIGNATURE or method != _STORED or sizes is None:
            return None
        size, packed, local_at = sizes
        data_at = _local_data(read, local_at, name)
        if packed != size or data_at is None or data_at + size > directory_at:
            return None
        found[name.decode("utf-8", "replace")] = (data_at, size)
    return found if position == len(directory) and len(found) == count else None


def _local_data(read: Read, local_at: int, name: bytes) -> int | None:
    """Offset of the data of the entry whose local header is at ``local_at``, if that header
    names ``name`` and is stored."""
    header = read(local_at, _LOCAL.size)
    signature, _, _, method, _, _, _, _, _, name_length, extra_length = _LOCAL.unpack(header)
    if signature != _LOCAL_SIGNATURE or method != _STORED:
        return None
    if read(local_at + _LOCAL.size, name_length) != name:
        return None
    return local_at + _LOCAL.size + name_length + extra_length


_INTS = frozenset({"BININT1", "BININT2", "BININT", "LONG1"})
_STRINGS = frozenset({"BINUNICODE", "SHORT_BINUNICODE"})
_MEMO = frozenset({"BINPUT", "LONG_BINPUT", "MEMOIZE"})
_FIXED_TUPLES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_MARK = object()


class _Global(tuple):
    """A global a pickle names (module, name): only compared, never resolved."""


class _Call(tuple):
    """A REDUCE a pickle would perform (callable, arguments): only compared."""


class _PersistentId(tuple):
    """A persistent id's tuple."""


def _simulate(pickled: bytes) -> Any:
    """The inert value tree ``pickled`` describes if it uses only the opcodes of one
    torch.save'd tensor, else None. Nothing is imported, resolved or called."""
    stack: list[Any] = []
    try:
        for opcode, argument, _ in pickletools.genops(pickled):
            name = opcode.name
            if name in _MEMO or name == "PROTO":
                continue
            if name == "STOP":
                return stack.pop() if len(stack) == 1 else None
            if name == "GLOBAL":
                module, _, attribute = str(argument).partition(" ")
                stack.append(_Global((module, attribute)))
            elif name in _INTS or name in _STRINGS:
                stack.append(argument)
            elif name in ("NEWFALSE", "NEWTRUE"):
                stack.append(name == "NEWTRUE")
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "TUPLE":
                mark = len(stack) - 1 - stack[::-1].index(_MARK)
                items = tuple(stack[mark + 1:])
                del stack[mark:]
                stack.append(items)
            elif name in _FIXED_TUPLES:
                width = _FIXED_TUPLES[name]
                if len(stack) < width:
                    return None
                items = tuple(stack[len(stack) - width:]) if width else ()
                del stack[len(stack) - width:]
                stack.append(items)
            elif name == "BINPERSID":
                stack.append(_PersistentId(stack.pop()))
            elif name == "REDUCE":
                arguments = stack.pop()
                stack.append(_Call((stack.pop(), arguments)))
            else:
                return None
    except (ValueError, IndexError):  # malformed stream, unbalanced stack
        return None
    return None


_REBUILD = _Global(("torch._utils", "_rebuild_tensor_v2"))
_NO_HOOKS = _Call((_Global(("collections", "OrderedDict")), ()))


def _tensor_facts(pickled: bytes) -> tuple[str, str, int, int, tuple[int, ...],
                                          tuple[int, ...]] | None:
    """(storage name, storage key, storage numel, offset, size, stride) of a pickle that is
    exactly one plain tensor as torch.save writes it; None for anything else."""
    value = _simulate(pickled)
    if not (isinstance(value, _Call) and value[0] == _REBUILD and isinstance(value[1], tuple)
            and len(value[1]) == 6):
        return None
    persistent, offset, size, stride, requires_grad, hooks = value[1]
    if not (isinstance(persistent, _PersistentId) and len(persistent) == 5
            and hooks == _NO_HOOKS and isinstance(requires_grad, bool)):
        return None
    tag, storage, key, _location, numel = persistent
    if not (tag == "storage" and isinstance(storage, _Global) and storage[0] == "torch"
            and storage[1] in ITEM_SIZES and isinstance(key, str) and isinstance(numel, int)):
        return None
    integers = (offset, *size, *stride) if isinstance(size, tuple) and isinstance(
        stride, tuple) else None
    if integers is None or not all(type(item) is int and item >= 0 for item in integers):
        return None
    return storage[1], key, numel, offset, size, stride


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if len(size) != len(stride):
        return False
    expected = 1
    for extent, step in zip(reversed(size), reversed(stride), strict=True):
        if extent != 1 and step != expected:
            return False
        expected *= extent
    return True


def parse_record(read: Read, length: int) -> Record | None:
    """The layout of the torch.save record of ``length`` bytes that ``read(offset, n)``
    returns bytes of (offsets relative to the record), or None where it is not proven to be
    one plain, contiguous, little-endian tensor in a dtype of ``ITEM_SIZES``."""
    try:
        entries = _entries(read, length)
    except struct.error:  # a header cut short: not a record this module understands
        return None
    if not entries:
        return None
    pickle_names = [name for name in entries if name.endswith("/data.pkl")]
    if len(pickle_names) != 1:
        return None
    prefix = pickle_names[0][:-len("data.pkl")]
    pickle_at, pickle_size = entries[pickle_names[0]]
    if pickle_size > _MAX_SMALL:
        return None
    facts = _tensor_facts(read(pickle_at, pickle_size))
    if facts is None:
        return None
    storage, key, numel, offset, size, stride = facts
    data_name = f"{prefix}data/{key}"
    others = {name[len(prefix):] for name in entries if name.startswith(prefix)} - {
        "data.pkl", f"data/{key}"}
    if data_name not in entries or len(others) != len(entries) - 2 or not (
            others <= _KNOWN_ENTRIES):
        return None
    order_at, order_size = entries.get(f"{prefix}byteorder", (0, 0))
    # The bytes are copied as they are: they must be in this machine's byte order.
    if not order_size or read(order_at, order_size) != sys.byteorder.encode():
        return None
    data_at, data_size = entries[data_name]
    item_size = ITEM_SIZES[storage]
    if data_size != numel * item_size or offset + math.prod(size) > numel:
        return None
    if not _contiguous(size, stride):
        return None
    return Record(storage=storage, data_offset=data_at + offset * item_size, shape=size)
