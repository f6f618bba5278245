import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from rvqspec.core.errors import RvqspecError
from rvqspec.tuning.corpus import Corpus, CorpusWriter, split_of

GROUPS, HIDDEN = 16, 6


def utterance(index: int, frames: int, top: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and hidden states whose rows are recognisable: hidden[:, 0] is a unique frame number."""
    g = torch.Generator().manual_seed(index)
    codes = torch.randint(0, top, (frames, GROUPS), generator=g)
    hidden = torch.randn(frames, HIDDEN, generator=g)
    hidden[:, 0] = index * 1000 + torch.arange(frames)
    return codes, hidden


def write(path, count: int = 30, shard_frames: int = 40, order=None, **kwargs) -> dict:
    written = {}
    with CorpusWriter(path, HIDDEN, GROUPS, shard_frames=shard_frames, hidden_dtype=torch.float32, **kwargs) as w:
        for i in order or range(count):
            codes, hidden = utterance(i, 3 + i % 7)
            w.add(f"utt-{i}", "en" if i % 2 else "de", codes, hidden)
            written[f"utt-{i}"] = (codes, hidden)
    return written


def test_round_trip_over_several_shards(tmp_path):
    written = write(tmp_path / "c")
    corpus = Corpus(tmp_path / "c", validation_fraction=0.3)
    assert len(corpus.shards) > 3 and corpus.hidden_size == HIDDEN and corpus.groups == GROUPS
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    assert index["frames"] == sum(len(c) for c, _ in written.values())
    read = {}
    for split in ("train", "validation"):
        for entry, codes, hidden in corpus.utterances_of(split):
            assert entry["lang"] == ("en" if int(entry["id"][4:]) % 2 else "de") and entry["frames"] == len(codes)
            read[entry["id"]] = (codes, hidden)
    assert read.keys() == written.keys()
    for key, (codes, hidden) in written.items():
        assert torch.equal(read[key][0], codes) and torch.equal(read[key][1], hidden)
    with safe_open(tmp_path / "c" / index["shards"][0]["file"], "pt") as f:
        assert f.get_tensor("codes").dtype == torch.int16
        offsets = f.get_tensor("offsets")
    assert offsets[0] == 0 and offsets[-1] == index["shards"][0]["frames"]


def test_large_codes_and_half_hidden(tmp_path):
    codes, hidden = utterance(0, 5, top=40000)
    with CorpusWriter(tmp_path / "c", HIDDEN, GROUPS) as w:  # float16 hidden by default
        w.add("a", "en", codes, hidden / 1000)
    (entry, read_codes, read_hidden), = Corpus(tmp_path / "c", 0.0).utterances_of("train")
    assert torch.equal(read_codes, codes) and read_hidden.dtype == torch.float16
    assert torch.equal(read_hidden, (hidden / 1000).half())


def test_split_is_fixed_by_the_ids(tmp_path):
    write(tmp_path / "a", count=200, shard_frames=100)
    write(tmp_path / "b", count=200, shard_frames=7, order=list(reversed(range(200))))
    a, b = Corpus(tmp_path / "a", 0.25), Corpus(tmp_path / "b", 0.25)
    val_a = {u["id"] for u in a.split("validation")}
    assert val_a == {u["id"] for u in b.split("validation")} == {u["id"] for u in Corpus(tmp_path / "a", 0.25).split("validation")}
    assert val_a.isdisjoint(u["id"] for u in a.split("train"))
    assert len(val_a) + len(a.split("train")) == 200 and 30 <= len(val_a) <= 70
    assert all(split_of(i, 0.25) == "validation" for i in val_a)
    assert {u["id"] for u in Corpus(tmp_path / "a", 0.5).split("validation")} > val_a  # nested as the fraction grows


def frame_ids(batches) -> list[list[int]]:
    return [hidden[:, 0].long().tolist() for _, hidden in batches]


def test_shuffled_batches_depend_on_seed_and_epoch_only(tmp_path):
    write(tmp_path / "c", count=40)
    corpus = Corpus(tmp_path / "c", 0.2)
    epoch0 = frame_ids(corpus.batches("train", 8, seed=3, epoch=0))
    assert epoch0 == frame_ids(Corpus(tmp_path / "c", 0.2).batches("train", 8, seed=3, epoch=0))
    assert epoch0 != frame_ids(corpus.batches("train", 8, seed=3, epoch=1))
    assert epoch0 != frame_ids(corpus.batches("train", 8, seed=4, epoch=0))
    flat = [f for batch in epoch0 for f in batch]
    in_order = [f for batch in frame_ids(corpus.batches("train", 8)) for f in batch]
    assert sorted(flat) == sorted(in_order) and flat != in_order and len(flat) == corpus.num_frames("train")
    dropped = frame_ids(corpus.batches("train", 8, seed=3, epoch=0, drop_last=True))
    assert len(dropped) == corpus.num_batches("train", 8, drop_last=True) == corpus.num_frames("train") // 8
    assert frame_ids(corpus.batches("train", 8, seed=3, epoch=0, skip=3)) == epoch0[3:]


def test_ranks_split_every_global_batch(tmp_path):
    write(tmp_path / "c", count=40)
    corpus = Corpus(tmp_path / "c", 0.2)
    whole = list(corpus.batches("train", 8, seed=1, epoch=2, drop_last=True))
    parts = [list(corpus.batches("train", 8, seed=1, epoch=2, rank=r, world_size=2, drop_last=True)) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole)
    for (codes, hidden), (c0, h0), (c1, h1) in zip(whole, *parts):
        assert len(c0) == len(c1) == 4
        assert torch.equal(codes, torch.cat([c0, c1])) and torch.equal(hidden, torch.cat([h0, h1]))


def test_sample_is_deterministic(tmp_path):
    write(tmp_path / "c")
    corpus = Corpus(tmp_path / "c", 0.3)
    codes, hidden = corpus.sample("validation", 10, seed=5)
    assert len(codes) == 10 and torch.equal(corpus.sample("validation", 10, seed=5)[1], hidden)
    assert len(corpus.sample("validation", 10_000, seed=5)[0]) == corpus.num_frames("validation")


@pytest.mark.parametrize("codes, hidden, match", [
    (torch.zeros(4, GROUPS - 1, dtype=torch.long), torch.zeros(4, HIDDEN), "codes"),
    (torch.zeros(4, GROUPS), torch.zeros(4, HIDDEN), "integer"),
    (-torch.ones(4, GROUPS, dtype=torch.long), torch.zeros(4, HIDDEN), r"\[0, 2\*\*31\)"),
    (torch.zeros(4, GROUPS, dtype=torch.long), torch.zeros(3, HIDDEN), "one talker state per frame"),
    (torch.zeros(4, GROUPS, dtype=torch.long), torch.full((4, HIDDEN), 1e6), "bfloat16"),
])
def test_writer_rejects_bad_utterances(tmp_path, codes, hidden, match):
    writer = CorpusWriter(tmp_path / "c", HIDDEN, GROUPS)  # float16: 1e6 overflows
    with pytest.raises(RvqspecError, match=match):
        writer.add("x", "en", codes, hidden)


def test_writer_refuses_duplicates_and_existing_corpus(tmp_path):
    write(tmp_path / "c", count=3)
    with pytest.raises(RvqspecError, match="already holds a corpus"):
        CorpusWriter(tmp_path / "c", HIDDEN, GROUPS)
    writer = CorpusWriter(tmp_path / "c", HIDDEN, GROUPS, overwrite=True)
    writer.add("a", "en", *utterance(0, 3))
    with pytest.raises(RvqspecError, match="twice"):
        writer.add("a", "en", *utterance(1, 3))
    writer.close()
    assert [u["id"] for u in Corpus(tmp_path / "c").utterances] == ["a"]
    assert len(list((tmp_path / "c").glob("shard-*"))) == 1  # the old shards are gone


def test_unfinished_or_broken_corpus_is_reported(tmp_path):
    with pytest.raises(RuntimeError):
        with CorpusWriter(tmp_path / "c", HIDDEN, GROUPS, shard_frames=4) as w:
            w.add("a", "en", *utterance(0, 5))
            raise RuntimeError("crash while writing")
    assert list((tmp_path / "c").iterdir()) == []  # the crashed run removed its shards
    killed = CorpusWriter(tmp_path / "k", HIDDEN, GROUPS, shard_frames=4)  # a process killed before close()
    killed.add("a", "en", *utterance(0, 5))
    with pytest.raises(RvqspecError, match="did not finish"):
        Corpus(tmp_path / "k")
    with pytest.raises(RvqspecError, match="not a code corpus"):
        Corpus(tmp_path / "nowhere")
    write(tmp_path / "d", count=10)
    (tmp_path / "d" / Corpus(tmp_path / "d").shards[1]["file"]).unlink()
    corpus = Corpus(tmp_path / "d", 0.0)
    with pytest.raises(RvqspecError, match="missing"):
        list(corpus.batches("train", 4))


def test_rows_follow_index_order(tmp_path):
    write(tmp_path / "c", count=12, shard_frames=10)
    corpus = Corpus(tmp_path / "c", 0.0)
    shards, rows = corpus.rows("train")
    expected = [(u["shard"], u["start"] + t) for u in corpus.utterances for t in range(u["frames"])]
    assert list(zip(shards.tolist(), rows.tolist())) == expected and rows.dtype == np.int64


def corpus_codes(path) -> torch.Tensor:
    corpus = Corpus(path, 0.0)
    return torch.cat([codes for _, codes, _ in corpus.utterances_of("train")])


def test_overwrite_keeps_the_old_corpus_until_the_new_one_is_complete(tmp_path):
    """`--overwrite` used to delete the old corpus first: one undecodable clip (or Ctrl-C) left an empty folder."""
    write(tmp_path / "c", count=6, shard_frames=8)
    (tmp_path / "c" / "notes.txt").write_text("the user's")
    before = corpus_codes(tmp_path / "c")
    with pytest.raises(KeyboardInterrupt):
        with CorpusWriter(tmp_path / "c", HIDDEN, GROUPS, shard_frames=4, hidden_dtype=torch.float32, overwrite=True) as w:
            w.add("new", "en", *utterance(99, 9))  # two shards written
            raise KeyboardInterrupt
    assert torch.equal(corpus_codes(tmp_path / "c"), before)  # the old corpus, whole
    old_files = {p.name for p in (tmp_path / "c").iterdir()}
    written = write(tmp_path / "c", count=3, shard_frames=8, overwrite=True)
    assert [u["id"] for u in Corpus(tmp_path / "c").utterances] == list(written)
    files = {p.name for p in (tmp_path / "c").iterdir()}
    assert "notes.txt" in files and not (files & (old_files - {"index.json", "notes.txt"}))  # old shards gone
    assert (tmp_path / "c" / "notes.txt").read_text() == "the user's"


def rewrite_shard(path, change) -> None:
    from safetensors.torch import load_file, save_file

    file = path / Corpus(path).shards[0]["file"]
    data = load_file(file)
    change(data)
    save_file(data, file)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["codes"].__setitem__((2, 3), -1), "row 2: codes must be >= 0"),
    (lambda d: d.__setitem__("codes", d["codes"].float()), "codes are torch.float32, not integers"),
    (lambda d: d.__setitem__("codes", d["codes"] > 0), "codes are torch.bool, not integers"),
    (lambda d: d["hidden"].__setitem__((4, 1), float("nan")), "row 4: the hidden state is not finite"),
    (lambda d: d["hidden"].__setitem__((0, 0), float("inf")), "row 0: the hidden state is not finite"),
    (lambda d: d.pop("hidden"), "lacks its codes or hidden tensor"),
], ids=["negative", "float", "bool", "nan", "inf", "missing"])
def test_a_damaged_shard_is_refused_when_read_naming_the_shard_and_row(tmp_path, change, message):
    write(tmp_path / "c", count=4, shard_frames=100)
    rewrite_shard(tmp_path / "c", change)
    with pytest.raises(RvqspecError, match=message.replace("(", r"\(")):
        corpus_codes(tmp_path / "c")


@pytest.mark.parametrize("change, message", [
    (lambda i: i["shards"][0].__setitem__("file", "../../etc/passwd"), "is not a shard name"),
    (lambda i: i["shards"][0].__setitem__("file", "/tmp/x.safetensors"), "is not a shard name"),
    (lambda i: i["utterances"][1].__setitem__("start", 10 ** 6), "field 'start' must be an integer in"),
    (lambda i: i["utterances"][1].__setitem__("shard", 7), "field 'shard' must be an integer in"),
    (lambda i: i["utterances"][0].__setitem__("frames", "three"), "field 'frames' must be an integer"),
    (lambda i: i.pop("utterances"), "field 'utterances' must be list"),
    (lambda i: i.__setitem__("groups", 10 ** 7), "field 'groups' must be an integer in"),
    (lambda i: i.__setitem__("hidden_size", True), "field 'hidden_size' must be an integer in"),
], ids=["traversal", "absolute", "start", "shard", "frames", "utterances", "groups", "bool"])
def test_a_damaged_index_is_refused_naming_the_field(tmp_path, change, message):
    write(tmp_path / "c", count=4, shard_frames=100)
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    change(index)
    (tmp_path / "c" / "index.json").write_text(json.dumps(index))
    with pytest.raises(RvqspecError, match=message):
        Corpus(tmp_path / "c")


def test_random_damage_to_a_corpus_is_refused_in_one_error_or_read():
    """Fuzz: random bytes, truncations and field edits of index.json and a shard give RvqspecError or a corpus."""
    import tempfile
    from pathlib import Path

    from hypothesis import given, settings, strategies as st

    @settings(max_examples=60, deadline=None)
    @given(target=st.sampled_from(["index", "shard"]), cut=st.floats(0, 1), flips=st.lists(
        st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4))
    def damaged(target, cut, flips):
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "c"
            write(path, count=3, shard_frames=100)
            file = path / ("index.json" if target == "index" else Corpus(path).shards[0]["file"])
            data = bytearray(file.read_bytes())
            for where, value in flips:
                data[int(where * (len(data) - 1))] = value
            file.write_bytes(bytes(data[:max(1, int(cut * len(data)))]))
            try:
                corpus_codes(path)
            except RvqspecError as e:
                assert "\n" not in str(e)

    damaged()
