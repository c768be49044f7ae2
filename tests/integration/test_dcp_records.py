"""dcp_records on real torch.save output: the layout of every dtype's record is found where
torch.load finds the tensor, and whatever the parser cannot prove (a compressed entry, a
storage of the wrong length, a non-contiguous or offset-less view, an unknown entry or dtype,
another pickle, big-endian bytes, a truncated record) gives None, so that the reader leaves
the record to torch.load."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from torch_bridge.dcp import metadata as dcp_metadata, records as dcp_records  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.complex128]


def saved(value) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


def parse(data: bytes):
    return dcp_records.parse_record(lambda offset, size: data[offset:offset + size],
                                     len(data))


def tensor_at(data: bytes, record) -> torch.Tensor:
    dtype = dcp_metadata.DTYPES[record.storage]
    raw = bytearray(data[record.data_offset:record.data_offset + record.nbytes])
    return torch.frombuffer(raw, dtype=dtype).reshape(record.shape) if raw else torch.empty(
        record.shape, dtype=dtype)


def rezipped(data: bytes, *, compression=zipfile.ZIP_STORED, change=None) -> bytes:
    """The entries of the record ``data`` written again by zipfile (``change`` maps an
    entry's name and bytes to new ones, or None to drop it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            entry = (name, source.read(name))
            if change is not None:
                entry = change(*entry)
            if entry is not None:
                target.writestr(entry[0], entry[1], compress_type=compression)
    return out.getvalue()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_of_the_table_is_found_where_torch_load_finds_it(dtype):
    value = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    record = parse(saved(value))
    assert record is not None and record.shape == (2, 3, 4)
    assert dcp_metadata.DTYPES[record.storage] == dtype
    assert dcp_records.ITEM_SIZES[record.storage] == value.element_size()
    assert torch.equal(tensor_at(saved(value), record), value)


@pytest.mark.parametrize("value", [torch.tensor(2.5), torch.zeros(0, 3),
                                   torch.ones(3, 1, 2), torch.arange(10.0)[3:7]],
                         ids=["scalar", "empty", "unit-dimension", "view-with-offset"])
def test_shapes_and_a_view_into_a_larger_storage_are_located_exactly(value):
    data = saved(value)
    record = parse(data)
    assert record is not None and record.shape == tuple(value.shape)
    assert torch.equal(tensor_at(data, record), value)


def test_a_record_rewritten_by_another_zip_writer_still_parses():
    # Sizes in the local headers instead of data descriptors, no zip64 end record, no
    # alignment padding: the parser reads the format, not torch's byte positions.
    value = torch.randn(5, 4)
    data = rezipped(saved(value))
    record = parse(data)
    assert record is not None and torch.equal(tensor_at(data, record), value)


def test_a_non_contiguous_record_is_refused():
    assert parse(saved(torch.arange(12.0).reshape(3, 4).t())) is None


def test_a_compressed_entry_is_refused():
    assert parse(rezipped(saved(torch.randn(64)), compression=zipfile.ZIP_DEFLATED)) is None


def test_a_storage_of_the_wrong_length_is_refused():
    def shorter(name, data):
        return (name, data[:-4]) if name.endswith("/data/0") else (name, data)

    assert parse(rezipped(saved(torch.randn(8)), change=shorter)) is None


def test_an_unexpected_entry_or_a_missing_byte_order_is_refused():
    data = saved(torch.randn(8))
    assert parse(rezipped(data, change=lambda name, body: (
        name.replace("/version", "/extra"), body))) is None
    assert parse(rezipped(data, change=lambda name, body: (
        None if name.endswith("/byteorder") else (name, body)))) is None
    assert parse(rezipped(data, change=lambda name, body: (
        (name, b"big") if name.endswith("/byteorder") else (name, body)))) is None


def test_a_dtype_outside_the_table_and_other_pickles_are_refused():
    assert parse(saved(torch.zeros(4, dtype=torch.uint16))) is None
    assert parse(saved(nn.Parameter(torch.randn(3)))) is None  # _rebuild_parameter
    assert parse(saved({"weight": torch.randn(3)})) is None
    assert parse(saved([torch.randn(3), torch.randn(3)])) is None
    # A conjugate view is saved with its bit in extra metadata: copying the bytes would lose it.
    assert parse(saved(torch.randn(3, dtype=torch.complex64).conj())) is None


def test_a_pickle_naming_another_global_is_refused_without_running_it():
    def planted(name, data):
        if name.endswith("data.pkl"):
            data = data.replace(b"ctorch._utils\n_rebuild_tensor_v2\n",
                                b"cos\nsystem\n")
        return name, data

    assert parse(rezipped(saved(torch.randn(3)), change=planted)) is None


@pytest.mark.parametrize("cut", [1, 22, 200, 1000])
def test_a_truncated_or_garbled_record_is_refused(cut):
    data = saved(torch.randn(100))
    assert parse(data[:-cut]) is None
    assert parse(data[cut:]) is None
    assert parse(b"\x00" * len(data)) is None


def test_zip64_sizes_take_the_extra_field_for_each_saturated_field():
    extra = struct.pack("<HHQQ", 1, 16, 5 << 32, 7 << 32)
    marker = 0xFFFFFFFF
    assert dcp_records._zip64_sizes(extra, [marker, marker, 10]) == [5 << 32, 7 << 32, 10]
    assert dcp_records._zip64_sizes(b"", [marker, 3, 10]) is None
    assert dcp_records._zip64_sizes(b"", [3, 3, 10]) == [3, 3, 10]


class _Item:
    """The fields of a DCP ReadItem that the reader's copy uses."""

    def __init__(self, storage_offsets, lengths):
        from torch.distributed.checkpoint.planner import LoadItemType

        self.type = LoadItemType.TENSOR
        self.storage_offsets = torch.Size(storage_offsets)
        self.lengths = torch.Size(lengths)


class _Planner:
    def __init__(self, target):
        self.target, self.committed = target, []

    def resolve_tensor(self, item):
        return self.target

    def commit_tensor(self, item, tensor):
        self.committed.append(tensor)


class _Info:
    def __init__(self, offset, length):
        self.offset, self.length, self.transform_descriptors = offset, length, None


def _copied(record: torch.Tensor, target: torch.Tensor, offsets, lengths) -> bool:
    padding = b"x" * 37  # the record sits inside a file, after other records
    data = padding + saved(record) + padding
    planner = _Planner(target)
    done = dcp_metadata._load_record(io.BytesIO(data), _Info(len(padding), len(data) - 74),
                                      _Item(offsets, lengths), planner)
    return done and [t.data_ptr() for t in planner.committed] == [target.data_ptr()]


def test_a_region_of_a_record_lands_in_a_target_of_another_layout_and_dtype():
    # Resharding reads part of a saved chunk (storage offsets); a target may be a strided
    # view, or of another dtype (DCP's copy_ casts): the record is read into a tensor of its
    # own, narrowed and copied, as DCP's path does.
    record = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    strided = torch.zeros(3, 2).t()
    assert not strided.is_contiguous()
    assert _copied(record, strided, (1, 2), (2, 3))
    assert torch.equal(strided, record[1:3, 2:5])
    widened = torch.zeros(2, 3, dtype=torch.float64)
    assert _copied(record, widened, (2, 3), (2, 3))
    assert torch.equal(widened, record[2:4, 3:6].double())
    whole = torch.zeros(4, 6)
    assert _copied(record, whole, (0, 0), (4, 6)) and torch.equal(whole, record)


def test_a_target_of_another_size_is_left_to_dcps_own_error():
    record = torch.arange(6.0)
    assert dcp_metadata._load_record(io.BytesIO(saved(record)),
                                      _Info(0, len(saved(record))), _Item((0,), (6,)),
                                      _Planner(torch.zeros(5))) is False


def test_a_conjugate_view_target_gets_the_values_not_the_raw_bytes():
    record = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    base = torch.zeros(2, dtype=torch.complex64)
    target = base.conj()  # writing into it stores the conjugate in base
    assert _copied(record, target, (0,), (2,))
    assert torch.equal(target.resolve_conj(), record)
