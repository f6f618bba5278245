"""Text that arrives over time (issue 52), its tokenizer tail and its hand-fed stream (runtime/live_text.py): the ids
committed piece by piece are the ids upstream takes from the whole text, whatever the split (a property test with
the real Qwen2TokenizerFast on a small byte-level BPE trained here: Qwen's normalizer NFC, pre-tokenizer regex and
byte-level model, so the same tail rules); `TextStream`'s refusals."""

import functools
import threading

import pytest
from hypothesis import given, settings, strategies as st

from rvqspec.core.errors import RvqspecError
from rvqspec.runtime.live_text import StableTokens, TextStream, is_live, text_stream

CORPUS = ["assistant\n", "Hello there, how are you today? I'm fine: 12345 apples cost $3.50!",
          "你好，世界。今天天气很好！", "emoji 😀👍🏽 test... don't won't 1,000,000 we'll they're",
          "The quick brown fox jumps over the lazy dog.\n\nNew line  spaces   here", "café naïve résumé"]
# letters, digits, punctuation, spaces and newlines, CJK, emoji (modifiers, ZWJ), combining marks (NFC composes them)
ALPHABET = list("abcXYZ 019'.,!?$:-\n\t") + ["  ", "   0", "'s", "'ll", "你", "好", "。", "！", "😀", "👍", "\U0001f3fd",
                                                   "\u200d", "é", "e\u0301", "\u0301", "ﬁ", "\r\n"]


@functools.cache
def qwen_tokenizer():
    """Qwen2TokenizerFast on a byte-level BPE of 600 ids trained on CORPUS ("assistant" and "\\n" one id each, as in
    Qwen's vocabulary), with the chat special tokens."""
    import tempfile

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.train_from_iterator(CORPUS * 50, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    folder = tempfile.mkdtemp()
    bpe.model.save(folder)
    tokenizer = Qwen2TokenizerFast(vocab_file=f"{folder}/vocab.json", merges_file=f"{folder}/merges.txt")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    assert len(tokenizer("assistant\n")["input_ids"]) == 2
    return tokenizer


def upstream_ids(tokenizer, text: str) -> list[int]:
    """The text's ids as upstream's entry points take them (`_build_assistant_text`, then `input_id[:, 3:-5]`)."""
    return tokenizer(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"][3:-5]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30).map("".join),
       st.lists(st.integers(0, 60), max_size=12))
def test_ids_committed_piece_by_piece_are_the_whole_texts(text, cuts):
    """Whatever the split, the committed ids are upstream's for the whole text, and an id once committed is final
    (it is a prefix of the whole text's ids at every step)."""
    tokenizer = qwen_tokenizer()
    whole, tokens, ids = upstream_ids(tokenizer, text), StableTokens(tokenizer), []
    for piece in split(text, cuts):
        ids += tokens.feed(piece)
        assert ids == whole[:len(ids)]
    ids += tokens.end()
    assert ids == whole


def test_the_last_pre_token_is_held_back_until_more_text_or_the_end():
    tokenizer = qwen_tokenizer()
    tokens = StableTokens(tokenizer)
    assert tokens.feed("Hel") == []  # "Hel" may become "Hello": nothing is final
    assert tokens.feed("lo") == []
    committed = tokens.feed(" there")  # "Hello" is final, " there" is not
    assert committed == upstream_ids(tokenizer, "Hello")
    assert committed + tokens.end() == upstream_ids(tokenizer, "Hello there")


def test_a_text_stream_refuses_what_it_cannot_speak_in_one_line():
    stream = TextStream()
    with pytest.raises(RvqspecError, match="strings"):
        stream.write(b"bytes")
    with pytest.raises(RvqspecError, match="lone surrogate"):
        stream.write("a\ud800")
    stream.write("fine")
    stream.end()
    with pytest.raises(RvqspecError, match="already ended"):
        stream.write("more")
    seen = []
    stream.attach(seen.append)
    assert seen == ["fine", None]
    with pytest.raises(RvqspecError, match="one TextStream per request"):
        stream.attach(seen.append)


def test_what_counts_as_text_that_arrives_over_time():
    async def pieces():
        yield "a"

    assert is_live(TextStream()) and is_live(iter(["a"])) and is_live(x for x in "ab") and is_live(pieces())
    assert not any(is_live(text) for text in ("text", ["a", "b"], ("a",), None))


def test_an_iterable_and_an_async_iterable_are_read_to_their_end():
    async def pieces():
        for piece in ("Hel", "lo"):
            yield piece

    for text in (iter(["Hel", "lo"]), pieces()):
        seen, done = [], threading.Event()
        text_stream(text, threading.Event()).attach(lambda piece: seen.append(piece) or piece is None and done.set())
        assert done.wait(10)
        assert seen == ["Hel", "lo", None]
