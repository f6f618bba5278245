"""The sentence splitter (runtime/sentences.py): where sentences end, the length cap, and the incremental splitter
giving exactly the whole-text split whatever the pieces."""

import pytest
from hypothesis import given, settings, strategies as st

from rvqspec.runtime.sentences import SentenceSplitter, is_long, split_sentences


@pytest.mark.parametrize("text, sentences", [
    ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
    ("It costs 3.5 dollars. Cheap.", ["It costs 3.5 dollars.", "Cheap."]),
    ("Fruit, e.g. apples, is good. Dr. Smith agrees.", ["Fruit, e.g. apples, is good.", "Dr. Smith agrees."]),
    ("J. R. Smith wrote it. Then he left.", ["J. R. Smith wrote it.", "Then he left."]),
    ("Wait... what? Really?! Yes.", ["Wait... what?", "Really?!", "Yes."]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("今天天气很好。我们去公园吧！好不好？", ["今天天气很好。", "我们去公园吧！", "好不好？"]),
    ("「你好。」他说。", ["「你好。」", "他说。"]),
    ("こんにちは。元気ですか？", ["こんにちは。", "元気ですか？"]),
    ("First paragraph\n\nSecond paragraph", ["First paragraph", "Second paragraph"]),
    ("A line\nwrapped here. Next.", ["A line\nwrapped here.", "Next."]),
    ("  Spaces around.   ", ["Spaces around."]),
    ("Hi! ... :)", ["Hi!"]),
    ("In 2024. Then more.", ["In 2024.", "Then more."]),
    ("", []),
])
def test_sentence_ends(text, sentences):
    assert split_sentences(text) == sentences


def test_long_sentences_are_cut_at_clauses_then_spaces_then_anywhere():
    clauses = "one two three, four five six, seven eight nine, ten eleven twelve."
    assert split_sentences(clauses, max_chars=32) == ["one two three, four five six,", "seven eight nine,",
                                                      "ten eleven twelve."]
    words = "alpha beta gamma delta epsilon zeta eta theta"
    assert split_sentences(words, max_chars=20) == ["alpha beta gamma", "delta epsilon zeta", "eta theta"]
    assert split_sentences("字" * 25, max_chars=10) == ["字" * 10, "字" * 10, "字" * 5]
    for text in (clauses, words, "字" * 25):
        assert all(len(s) <= 20 for s in split_sentences(text, max_chars=20))


def test_incremental_gives_sentences_as_soon_as_they_are_decided():
    splitter = SentenceSplitter()
    assert splitter.feed("Hello there.") == []  # "." then what? ("Hello there.5" is not an end)
    assert splitter.feed(" ") == []  # the next word may be lowercase ("e.g. apples")
    assert splitter.feed("How") == ["Hello there."]
    assert splitter.feed(" are you?") == []
    assert splitter.end() == ["How are you?"]
    assert splitter.feed("好。") == [] and splitter.feed("我") == ["好。"]
    assert splitter.end() == ["我"]


TEXT_PARTS = st.sampled_from(["Hello", " world", ".", " ", "!", "?", "e.g.", " apples", "Dr.", " Smith", "3.5",
                              "。", "你好", "，", ",", "\n", "\n\n", '"', "…", "J.", "long sentence without end "])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(TEXT_PARTS, max_size=40), cuts=st.lists(st.integers(0, 400), max_size=8),
       max_chars=st.integers(2, 60))
def test_incremental_equals_whole_text(parts, cuts, max_chars):
    text = "".join(parts)
    splitter, got, start = SentenceSplitter(max_chars), [], 0
    for cut in sorted(cut % (len(text) + 1) for cut in cuts) + [len(text)]:
        got += splitter.feed(text[start:cut])
        start = cut
    got += splitter.end()
    whole = split_sentences(text, max_chars)
    assert got == whole
    assert all(len(s) <= max_chars for s in whole)
    letters = [c for c in text if c.isalnum()]
    assert [c for s in whole for c in s if c.isalnum()] == letters  # nothing spoken is lost or reordered


def test_a_long_text_is_counted_in_bytes():
    assert not is_long("a" * 200) and is_long("a" * 201)
    assert is_long("я" * 101) and is_long("字" * 67) and not is_long("字" * 66)


def test_max_chars_is_checked():
    with pytest.raises(ValueError, match="max_chars"):
        SentenceSplitter(max_chars=1)
