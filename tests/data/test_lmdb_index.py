"""ddpkit.data.lmdb_index: sample keys, and the index record written and read back."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ddpkit import __version__
from ddpkit.data.lmdb_index import (
    FORMAT_VERSION,
    LMDBFormatError,
    decode_index,
    encode_index,
    encode_index_buffer,
    sample_key,
)


def test_sample_keys_are_8_big_endian_bytes_that_sort_in_index_order() -> None:
    assert sample_key(0) == b"\0" * 8
    assert sample_key(1) == b"\0" * 7 + b"\1"
    assert sample_key(2**64 - 1) == b"\xff" * 8
    indices = [0, 1, 255, 256, 65535, 2**32, 10**12]
    assert sorted(sample_key(i) for i in indices) == [sample_key(i) for i in indices]


@pytest.mark.parametrize("index", [-1, 2**64])
def test_a_sample_key_out_of_range_is_refused(index: int) -> None:
    with pytest.raises(struct.error):
        sample_key(index)


def test_the_record_round_trips_labels_classes_columns_and_metadata() -> None:
    labels = np.array([2, 0, 1, 2], dtype=np.int32)
    record = encode_index(labels, ["cat", "dog", "ému"], columns={"path": ["a", "b", "c", "d"]},
                          metadata={"source_format": "list"})  # fmt: skip
    index = decode_index(record, source="db", columns=["path"])
    assert index.labels.dtype == np.int64
    assert index.labels.tolist() == [2, 0, 1, 2]
    assert index.classes == ("cat", "dog", "ému")
    assert index.columns == {"path": ["a", "b", "c", "d"]}
    assert index.metadata == {"source_format": "list"}
    assert (index.version, index.ddpkit_version) == (FORMAT_VERSION, __version__)
    assert len(index) == 4
    assert decode_index(record, source="db").columns == {}  # columns only when asked for


def test_the_buffer_and_the_bytes_are_the_same_record() -> None:
    args = ([0, 1, 1], ["a", "b"])
    assert bytes(encode_index_buffer(*args).to_pybytes()) == encode_index(*args)


def test_an_empty_index_round_trips() -> None:
    index = decode_index(encode_index([], []), source="db")
    assert len(index) == 0
    assert index.classes == ()
    assert len(decode_index(encode_index(np.array([], np.int64), ["a"]), source="db")) == 0


def test_decoded_labels_are_a_writable_copy_of_the_record() -> None:
    record = bytearray(encode_index([0, 1, 0], ["a", "b"]))
    index = decode_index(memoryview(record), source="db")
    record[:] = b"\0" * len(record)  # the map the record lived in is gone
    assert index.labels.tolist() == [0, 1, 0]
    index.labels[0] = 1  # a copy the caller owns


@pytest.mark.parametrize("labels", [[0, 3], [-1, 0], [7]])
def test_labels_outside_the_classes_are_refused_when_written(labels: list[int]) -> None:
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.2 for 3 classes"):
        encode_index(labels, ["a", "b", "c"])


def test_a_column_of_another_length_is_refused_when_written() -> None:
    with pytest.raises(ValueError, match="index column 'path' has 2 values for 3 samples"):
        encode_index([0, 0, 0], ["a"], columns={"path": ["x", "y"]})


def test_asking_for_a_column_the_index_lacks_names_it() -> None:
    record = encode_index([0], ["a"])
    with pytest.raises(LMDBFormatError, match=r"db: the index has no column\(s\) \['path'\]"):
        decode_index(record, source="db", columns=["path"])


@pytest.mark.parametrize("key", ["format", "version", "classes", "num_samples"])
def test_metadata_cannot_overwrite_the_format_fields(key: str) -> None:
    try:
        record = encode_index([0, 1], ["a", "b"], metadata={key: "7"})
    except ValueError:
        return  # refused when written: fine
    index = decode_index(record, source="db")
    assert (index.classes, index.labels.tolist()) == (("a", "b"), [0, 1])
