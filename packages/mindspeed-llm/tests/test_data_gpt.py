"""GPT samples, blends and the pretraining builder, against a slow reference and Megatron."""

from pathlib import Path

import numpy as np
import pytest

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    blending_indices,
    build_gpt_indices,
    build_pretrain_datasets,
    parse_data_paths,
    parse_split,
    split_document_ranges,
)

helpers = import_sibling(__file__, "data_helpers")


def _reference_samples(documents, doc_idx, seq_len, count):
    """Concatenate the documents in doc_idx order and cut every seq_len tokens."""
    stream = np.concatenate([documents[d] for d in doc_idx])
    return [stream[k * seq_len : k * seq_len + seq_len + 1] for k in range(count)]


@pytest.mark.parametrize(("num_samples", "seq_len"), [(0, 16), (50, 16), (700, 33)])
def test_samples_are_the_shuffled_stream_cut_with_one_token_overlap(tmp_path, num_samples, seq_len):
    documents = helpers.write_corpus(tmp_path / "c", 120, seed=3, min_len=0, max_len=40)
    ds = GPTDataset(
        IndexedDataset(tmp_path / "c"),
        document_range=(10, 110),
        seq_len=seq_len,
        num_samples=num_samples,
        seed=5,
        cache_dir=tmp_path,
    )
    assert len(ds) >= num_samples
    assert set(np.unique(ds.doc_idx)) <= set(range(10, 110))  # only this split's documents
    expected = _reference_samples(documents, ds.doc_idx, seq_len, len(ds))
    served = set()
    for i in range(len(ds)):
        tokens = ds[i]["tokens"]
        assert tokens.dtype == np.int64 and tokens.shape == (seq_len + 1,)
        k = int(ds.shuffle_idx[i])
        np.testing.assert_array_equal(tokens, expected[k])
        served.add(k)
    assert served == set(range(len(ds)))  # a permutation
    if num_samples:
        # epochs: every document appears equally often
        counts = np.bincount(ds.doc_idx, minlength=110)[10:]
        assert counts.min() == counts.max() >= 2 or num_samples < 100


@pytest.mark.parametrize(
    ("seq_len", "num_samples"),
    [(8, 10), (17, 0), (31, 400), (31, 300), (64, 1000)],  # 1 epoch, separate last epoch or not
)
def test_indices_equal_megatron(tmp_path, seq_len, num_samples):
    mgpt, mconfig, _, _ = helpers.megatron_gpt()
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    from megatron.core.datasets.utils import Split

    helpers.write_corpus(tmp_path / "c", 300, seed=0, min_len=0, max_len=50)  # some empty
    config = mconfig(
        random_seed=11,
        sequence_length=seq_len,
        split="1",
        tokenizer=helpers.MegatronTokenizerStub(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "megatron"),
    )
    documents = np.arange(20, 280, dtype=np.int32)
    theirs = mgpt(
        MegatronIndexedDataset(str(tmp_path / "c")),
        str(tmp_path / "c"),
        documents,
        num_samples or None,
        Split.train,
        config,
    )
    lengths = IndexedDataset(tmp_path / "c").sequence_lengths
    doc_idx, sample_idx, shuffle_idx = build_gpt_indices(
        lengths, documents, seq_len=seq_len, num_samples=num_samples, seed=11
    )
    np.testing.assert_array_equal(doc_idx, theirs.document_index)
    np.testing.assert_array_equal(sample_idx, theirs.sample_index)
    np.testing.assert_array_equal(shuffle_idx, theirs.shuffle_index)


def test_same_samples_as_megatron_builder(tmp_path):
    """Splits, epochs, separate last epoch, blending: Megatron's BlendedMegatronDatasetBuilder."""
    mgpt, mconfig, mbuilder, _ = helpers.megatron_gpt()
    helpers.write_corpus(tmp_path / "a", 300, seed=1)
    helpers.write_corpus(tmp_path / "b", 200, seed=2)
    sizes = [1000, 100, 10]
    config = mconfig(
        random_seed=7,
        sequence_length=32,
        blend=([str(tmp_path / "a"), str(tmp_path / "b")], [0.3, 0.7]),
        split="90,8,2",
        tokenizer=helpers.MegatronTokenizerStub(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,  # with a cache Megatron's blend wants a process group
    )
    theirs = mbuilder(mgpt, sizes, lambda: True, config).build()
    ours = build_pretrain_datasets(
        ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")],
        split="90,8,2",
        seq_len=32,
        seed=7,
        num_samples=tuple(sizes),
        cache_dir=tmp_path / "cache",
    )
    for split, size in enumerate(sizes):
        mine, reference = ours[split], theirs[split]
        assert isinstance(mine, BlendedDataset) and len(mine) == len(reference) == size
        for i in range(size):
            sample = reference[i]
            expected = np.append(sample["tokens"].numpy(), sample["labels"].numpy()[-1])
            np.testing.assert_array_equal(mine[i]["tokens"], expected)


def test_indices_are_cached_atomically_and_reused(tmp_path, monkeypatch):
    helpers.write_corpus(tmp_path / "c", 50, seed=0)
    corpus = IndexedDataset(tmp_path / "c")
    args = {"document_range": (0, 50), "seq_len": 16, "num_samples": 100, "seed": 1}
    first = GPTDataset(corpus, **args)  # default: next to the data
    cached = sorted(p.name for p in tmp_path.glob("c.*.npy"))
    assert len(cached) == 3 and all(first.cache_key in name for name in cached)
    assert not list(tmp_path.glob(".*tmp"))

    from mindspeed_llm.data import gpt_dataset

    def fail(*a, **k):
        raise AssertionError("indices rebuilt despite the cache")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", fail)
    again = GPTDataset(corpus, **args)
    assert isinstance(again.sample_idx, np.memmap)
    np.testing.assert_array_equal(again[3]["tokens"], first[3]["tokens"])
    monkeypatch.undo()

    other = GPTDataset(corpus, **{**args, "seed": 2}, cache_dir=tmp_path / "elsewhere")
    assert other.cache_key != first.cache_key
    assert len(list((tmp_path / "elsewhere").glob("c.*.npy"))) == 3
    assert not np.array_equal(other.shuffle_idx, first.shuffle_idx)


def test_unwritable_cache_keeps_indices_in_memory(tmp_path):
    helpers.write_corpus(tmp_path / "c", 20, seed=0)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ds = GPTDataset(
        IndexedDataset(tmp_path / "c"),
        document_range=(0, 20),
        seq_len=8,
        num_samples=10,
        seed=0,
        cache_dir=blocker / "sub",
    )
    assert len(ds) >= 10 and ds[0]["tokens"].shape == (9,)


def test_too_small_range_is_a_data_error(tmp_path):
    helpers.write_corpus(tmp_path / "c", 3, seed=0, max_len=4)
    with pytest.raises(DataError, match=rf"{tmp_path / 'c'}.*fewer than one sample"):
        GPTDataset(
            IndexedDataset(tmp_path / "c"), document_range=(0, 3), seq_len=64, num_samples=1, seed=0
        )


def test_blending_follows_weights_and_matches_megatron():
    _, _, _, mhelpers = helpers.megatron_gpt()
    weights = np.array([0.2, 0.5, 0.3])
    index, sample = blending_indices(weights, 10_000)
    theirs_index = np.zeros(10_000, dtype=np.int16)
    theirs_sample = np.zeros(10_000, dtype=np.int64)
    mhelpers.build_blending_indices(theirs_index, theirs_sample, weights, 3, 10_000, False)
    np.testing.assert_array_equal(index, theirs_index)
    np.testing.assert_array_equal(sample, theirs_sample)
    for n in (10, 100, 10_000):  # every prefix is close to the weights
        counts = np.bincount(index[:n], minlength=3)
        assert np.all(np.abs(counts - weights * n) <= 1.0)


def test_blended_dataset_draws_from_each_in_order():
    a = [{"tokens": np.array([0, i])} for i in range(30)]
    b = [{"tokens": np.array([1, i])} for i in range(80)]
    blend = BlendedDataset([a, b], [1, 3], 100)
    drawn = [blend[i]["tokens"] for i in range(len(blend))]
    from_a = [int(t[1]) for t in drawn if t[0] == 0]
    assert from_a == list(range(25))  # each dataset is read in its own order
    with pytest.raises(DataError, match="has 30 samples, the blend needs 50"):
        BlendedDataset([a, b], [1, 1], 100)


def test_parse_split_and_ranges():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ConfigError, match="split"):
            parse_split(bad)
    assert split_document_ranges(1000, parse_split("969,30,1")) == [
        (0, 969),
        (969, 999),
        (999, 1000),
    ]
    ranges = split_document_ranges(7, parse_split("1,1,1"))
    assert ranges[0][0] == 0 and ranges[-1][1] == 7
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_parse_data_paths():
    assert parse_data_paths("x/a") == ([Path("x/a")], None)
    prefixes, weights = parse_data_paths(["0.3", "a", "0.7", "b"])
    assert [str(p) for p in prefixes] == ["a", "b"] and weights == [0.3, 0.7]
    prefixes, weights = parse_data_paths(["a", "b"])
    assert [str(p) for p in prefixes] == ["a", "b"] and weights is None
    with pytest.raises(ConfigError):
        parse_data_paths([])


def test_build_pretrain_datasets(tmp_path):
    documents = helpers.write_corpus(tmp_path / "c", 200, seed=4, eod=0)
    train, valid, test = build_pretrain_datasets(
        str(tmp_path / "c"), split="90,10,0", seq_len=16, seed=3, num_samples=(500, 20, 0)
    )
    assert test is None
    assert isinstance(train, GPTDataset) and len(train) >= 500 and len(valid) >= 20
    assert set(np.unique(train.doc_idx)) == set(range(180))
    assert set(np.unique(valid.doc_idx)) == set(range(180, 200))
    assert valid[0]["tokens"].shape == (17,)
    del documents

    # without weights, corpora are blended by their token counts
    helpers.write_corpus(tmp_path / "d", 100, seed=5)
    train, _, _ = build_pretrain_datasets(
        [str(tmp_path / "c"), str(tmp_path / "d")],
        split="1",
        seq_len=16,
        seed=3,
        num_samples=(300, 0, 0),
    )
    tokens = [IndexedDataset(tmp_path / p).sequence_lengths.sum() for p in ("c", "d")]
    assert train.weights == pytest.approx([t / sum(tokens) for t in tokens])
    # a requested count of 0 gives one epoch without repeating a sample
    _, valid, _ = build_pretrain_datasets(
        ["1", str(tmp_path / "c"), "1", str(tmp_path / "d")],
        split="5,5",
        seq_len=16,
        seed=3,
        num_samples=(10, 0, 0),
    )
    assert len(valid) > 0 and all(len(valid.datasets[i]) > 0 for i in range(2))


def test_build_pretrain_datasets_errors(tmp_path):
    with pytest.raises(DataError, match=rf"{tmp_path / 'missing'}.*missing.*missing\.idx"):
        build_pretrain_datasets(
            ["0.5", str(tmp_path / "missing"), "0.5", str(tmp_path / "missing2")],
            split="1",
            seq_len=8,
            seed=0,
            num_samples=(1, 0, 0),
        )
    helpers.write_corpus(tmp_path / "c", 10, seed=0)
    with pytest.raises(DataError, match=r"valid split of '99,1,0' gets no document"):
        build_pretrain_datasets(
            str(tmp_path / "c"), split="99,1,0", seq_len=8, seed=0, num_samples=(1, 1, 0)
        )
