"""The indexed dataset: round trips, Megatron compatibility both ways, bad files."""

import errno
import os
import pickle
import struct
import subprocess

import numpy as np
import pytest
import torch

from mindspeed_core.errors import DataError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.data import IndexedDataset, IndexedDatasetWriter, best_dtype, dataset_exists

helpers = import_sibling(__file__, "data_helpers")

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]


def _documents(rng, high=100):
    """Documents of 1-3 sequences each, some sequences empty."""
    return [
        [rng.integers(0, high, size=int(n)) for n in rng.integers(0, 12, size=rng.integers(1, 4))]
        for _ in range(20)
    ]


def _write(prefix, documents, dtype):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            for seq in doc:
                writer.add_item(seq)
            writer.end_document()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype(tmp_path, dtype):
    documents = _documents(np.random.default_rng(0))
    _write(tmp_path / "c", documents, dtype)
    ds = IndexedDataset(tmp_path / "c")
    sequences = [seq for doc in documents for seq in doc]
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(sequences) and ds.num_documents == len(documents)
    sizes = np.cumsum([0] + [len(doc) for doc in documents])
    np.testing.assert_array_equal(ds.document_indices, sizes)
    np.testing.assert_array_equal(ds.sequence_lengths, [len(s) for s in sequences])
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(ds[i], seq.astype(dtype))
    # document spans cover each document's tokens in order
    starts, lengths = ds.document_spans()
    for d, doc in enumerate(documents):
        tokens = ds.tokens[starts[d] : starts[d] + lengths[d]]
        np.testing.assert_array_equal(tokens, np.concatenate(doc).astype(dtype))


def test_get_offset_length_slices_and_negative_index(tmp_path):
    _write(tmp_path / "c", [[np.arange(10)], [np.arange(10, 15)]], np.int32)
    ds = IndexedDataset(str(tmp_path / "c") + ".bin")  # a path with a suffix works too
    np.testing.assert_array_equal(ds.get(0, offset=3, length=4), [3, 4, 5, 6])
    np.testing.assert_array_equal(ds.get(0, offset=8), [8, 9])
    np.testing.assert_array_equal(ds[-1], [10, 11, 12, 13, 14])
    assert [len(x) for x in ds[0:2]] == [10, 5]
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(IndexError):
        ds.get(1, offset=3, length=3)
    clone = pickle.loads(pickle.dumps(ds))  # reopens the maps, no copy of the data
    np.testing.assert_array_equal(clone[1], ds[1])
    assert len(pickle.dumps(ds)) < 500


def test_best_dtype():
    assert best_dtype(32000) is np.uint16
    assert best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32
    assert best_dtype(151_936) is np.int32
    assert best_dtype(None) is np.int32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.float32])
def test_megatron_reads_ours_and_we_read_megatrons(tmp_path, dtype):
    mg = helpers.megatron_datasets()
    documents = _documents(np.random.default_rng(1), high=60000)

    _write(tmp_path / "ours", documents, dtype)
    theirs = mg.IndexedDataset(str(tmp_path / "ours"))
    sequences = [seq.astype(dtype) for doc in documents for seq in doc]
    assert len(theirs) == len(sequences)
    np.testing.assert_array_equal(
        theirs.document_indices, IndexedDataset(tmp_path / "ours").document_indices
    )
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(theirs[i], seq)

    builder = mg.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for doc in documents:
        for seq in doc:
            builder.add_item(torch.from_numpy(seq.astype(dtype)))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(tmp_path / "theirs")
    assert ours.dtype == np.dtype(dtype) and len(ours) == len(sequences)
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(ours[i], seq)
    # byte-identical files
    for suffix in (".idx", ".bin"):
        a = (tmp_path / f"ours{suffix}").read_bytes()
        assert a == (tmp_path / f"theirs{suffix}").read_bytes(), suffix


def test_add_index_merges_shards(tmp_path):
    docs_a = helpers.write_corpus(tmp_path / "a", 5, seed=1)
    docs_b = helpers.write_corpus(tmp_path / "b", 7, seed=2)
    with IndexedDatasetWriter(tmp_path / "ab", np.uint16) as writer:
        writer.add_document([1, 2, 3])
        writer.add_index(tmp_path / "a")
        writer.add_index(tmp_path / "b")
    merged = IndexedDataset(tmp_path / "ab")
    expected = [np.array([1, 2, 3])] + docs_a + docs_b
    assert merged.num_documents == len(expected)
    for i, doc in enumerate(expected):
        np.testing.assert_array_equal(merged[i], doc)
    with (
        IndexedDatasetWriter(tmp_path / "c", np.int32) as writer,
        pytest.raises(DataError, match="dtype"),
    ):
        writer.add_index(tmp_path / "a")


def test_writer_is_all_or_nothing(tmp_path):
    helpers.write_corpus(tmp_path / "c", 3, seed=0)
    before = IndexedDataset(tmp_path / "c")[0].copy()
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "c", np.uint16) as writer:
        writer.add_document([7, 7, 7])
        raise RuntimeError("crash while writing")
    # the old pair is untouched and no temporary file is left behind
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "c")[0], before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]

    writer = IndexedDatasetWriter(tmp_path / "new", np.uint16)
    writer.add_document([1, 2])
    assert not dataset_exists(tmp_path / "new")  # nothing under the final names until finalize
    writer.finalize()
    assert dataset_exists(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx", "new.bin", "new.idx"]
    # the final files get the usual permissions (0644 under umask 022), not 0600
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("new.bin", "new.idx"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask


def test_writer_refuses_ids_that_do_not_fit(tmp_path):
    with (
        pytest.raises(DataError, match=r"new\.bin.*uint16"),
        IndexedDatasetWriter(tmp_path / "new", np.uint16) as writer,
    ):
        writer.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="unsupported token dtype"):
        IndexedDatasetWriter(tmp_path / "x", np.uint32)


def _corrupt(tmp_path, edit):
    helpers.write_corpus(tmp_path / "c", 4, seed=0)
    path = tmp_path / "c.idx"
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))
    return tmp_path / "c"


def _set(offset, fmt, value):
    def edit(data):
        struct.pack_into(fmt, data, offset, value)
        return data

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: b"NOTANIDX\x00" + d[9:], "bad magic"),
        (_set(9, "<Q", 2), "unsupported index version 2"),
        (_set(17, "<B", 9), "unknown dtype code 9"),
        (lambda d: d[:-5], "truncated"),
        (lambda d: d[:20], "truncated"),
        (lambda d: b"", "bad magic"),
        (_set(34 + 4 * 12, "<q", 1), "document indices must start at 0"),  # 4 sequences
        (lambda d: _set(len(d) - 8, "<q", 9)(d), "end at most at the sequence count 4"),
    ],
)
def test_bad_index_files_name_the_file(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(DataError, match=message) as info:
        IndexedDataset(prefix)
    assert str(tmp_path / "c.idx") in str(info.value)


def test_missing_or_short_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "nothing.idx")):
        IndexedDataset(tmp_path / "nothing")
    helpers.write_corpus(tmp_path / "c", 4, seed=0, min_len=5)
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[:-2])
    with pytest.raises(DataError, match=rf"{tmp_path / 'c.bin'} is truncated"):
        IndexedDataset(tmp_path / "c")
    (tmp_path / "c.bin").unlink()
    with pytest.raises(DataError, match=rf"not found: {tmp_path / 'c.bin'}"):
        IndexedDataset(tmp_path / "c")


class _FullDisk:
    """A file whose writes and flushes fail as on a full disk (close() flushes too)."""

    def __init__(self, real):
        self.real, self.name, self.closed = real, real.name, False

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.real.close()
        self.closed = True
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_leaves_no_temporary_files(tmp_path):
    for stage in ("add", "finalize"):
        with (
            pytest.raises(OSError, match="No space left"),
            IndexedDatasetWriter(tmp_path / stage, np.int32) as writer,
        ):
            writer.add_document([1, 2, 3])
            writer._bin = _FullDisk(writer._bin)
            if stage == "add":
                writer.add_document([4])
        assert sorted(os.listdir(tmp_path)) == []


def test_temporaries_of_a_killed_writer_are_removed_by_the_next(tmp_path):
    from mindspeed_core.files import owned_temp_prefix

    dead = _dead_pid()
    stale = tmp_path / owned_temp_prefix(".c").replace(f".{os.getpid()}.", f".{dead}.")
    live = tmp_path / (owned_temp_prefix(".c").replace(f".{os.getpid()}.", f".{os.getppid()}."))
    for path in (stale, live):
        path.with_name(path.name + "x.bin.tmp").write_bytes(b"partial")
    _write(tmp_path / "c", [[np.arange(3)]], np.int32)
    assert set(os.listdir(tmp_path)) == {"c.bin", "c.idx", live.name + "x.bin.tmp"}


def _dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
