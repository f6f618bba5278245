"""Text cut into sentences, for speaking a long text one sentence at a time (the Engine's long-text mode) and for
models that take text a sentence at a time (sentence mode). One rule for both, whole or incremental:

    split_sentences(text, max_chars=MAX_CHARS) -> list[str]        # the whole text at once
    splitter = SentenceSplitter(max_chars=MAX_CHARS)
    splitter.feed(piece) -> list[str]                              # the sentences this piece completed (maybe none)
    splitter.end() -> list[str]                                    # the rest, once the text is over

Feeding a text in any pieces, then `end()`, gives exactly `split_sentences(text)`. Each sentence is stripped of the
spaces around it; pieces without a letter or digit ("...", " - ") are dropped (nothing to speak).

Where a sentence ends:
 - Latin script: `.`, `!`, `?`, `…` (a run of them, and closing quotes or brackets after it), then white space, then a
   character that is not a lowercase letter. A dot after an abbreviation ("Dr.", "e.g.", "etc.": `ABBREVIATIONS`) or
   a single letter (an initial: "J. Smith") ends nothing; "3.5" has no space after its dot.
 - CJK: `。`, `！`, `？`, `．` (and the closing marks after them), no space needed.
 - A blank line (a paragraph's end).
A sentence longer than `max_chars` is cut before its limit at the last clause mark (`,;:` and `，、；：`) in its second
half or more, else at the last space there, else at `max_chars` (CJK without punctuation).

Incremental: a sentence is given out as soon as the characters after it decide its end (the white space and the next
character after a Latin `.`; the next character after a CJK `。`), or once the text held reaches `max_chars` with
no end: then its first piece, cut as above.
"""

import re

MAX_CHARS = 200  # characters of a sentence at most (docs/limits.md: where the stand-in was measured to hold up)
# UTF-8 bytes (about the speech's length in any script: a Latin letter 1, Cyrillic 2, a CJK character 3): `rvqspec
# serve` and `synth` speak a longer text sentence by sentence by default (`is_long`; docs/limits.md)
LONG_TEXT = 200
LATIN_ENDS, CJK_ENDS = ".!?…", "。！？．"
CLOSERS = "\"')]}»”’」』）》】"
CLAUSE_MARKS = ",;:，、；："
ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "cf", "approx", "no",
                 "fig", "vol", "inc", "ltd", "co", "mt", "u.s", "a.m", "p.m"}
PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n")
UNDECIDED = object()  # an end that the characters not yet fed will decide


class SentenceSplitter:
    """Sentences out of a text fed in pieces (module docstring): `feed(piece)` -> completed sentences, `end()` ->
    the rest."""

    def __init__(self, max_chars: int = MAX_CHARS):
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 2:
            raise ValueError(f"max_chars must be a whole number >= 2, got {max_chars!r}")
        self.max_chars, self.held = max_chars, ""

    def feed(self, piece: str) -> list[str]:
        self.held += piece
        return self.take(final=False)

    def end(self) -> list[str]:
        sentences = self.take(final=True)
        self.held = ""
        return sentences

    def take(self, final: bool) -> list[str]:
        """The sentences the held text decides, taken off it."""
        sentences = []
        while (cut := self.next_cut(final)) is not None:
            sentence, self.held = self.held[:cut], self.held[cut:].lstrip()
            if any(c.isalnum() for c in sentence):
                sentences.append(sentence.strip())
        return sentences

    def next_cut(self, final: bool) -> int | None:
        """Where the first sentence of the held text ends (None: not decided yet)."""
        self.held = self.held.lstrip()
        if not self.held:
            return None
        end = first_end(self.held, final)
        if end is UNDECIDED:
            return None
        if end is not None and end <= self.max_chars:
            return end
        if len(self.held) > self.max_chars:
            return clause_cut(self.held, self.max_chars)
        return len(self.held) if final else None


def split_sentences(text: str, max_chars: int = MAX_CHARS) -> list[str]:
    """The sentences of a whole text (module docstring)."""
    splitter = SentenceSplitter(max_chars)
    return splitter.feed(text) + splitter.end()


def is_long(text: str) -> bool:
    """Whether `text` is past LONG_TEXT bytes: spoken sentence by sentence by default."""
    return len(text.encode("utf-8", "surrogatepass")) > LONG_TEXT


def first_end(text: str, final: bool):
    """The index just past the first sentence end in `text`, None if there is none, UNDECIDED if the characters
    after the text would decide one."""
    paragraph = PARAGRAPH.search(text)
    limit = paragraph.start() if paragraph else len(text)
    for i, char in enumerate(text[:limit]):
        if char not in LATIN_ENDS and char not in CJK_ENDS:
            continue
        if i > 0 and text[i - 1] in LATIN_ENDS + CJK_ENDS:
            continue  # inside a run: its first character decided
        end = run_end(text, i)
        if end == len(text):
            return None if final else UNDECIDED
        decided = True if char in CJK_ENDS else latin_end(text, i, end, final)
        if decided is UNDECIDED:
            return UNDECIDED
        if decided:
            return end
    return limit if paragraph else None


def run_end(text: str, start: int) -> int:
    """The index past a run of end marks from `start`, and the closing marks after it."""
    end = start
    while end < len(text) and text[end] in LATIN_ENDS + CJK_ENDS:
        end += 1
    while end < len(text) and text[end] in CLOSERS:
        end += 1
    return end


def latin_end(text: str, start: int, end: int, final: bool):
    """Whether the Latin marks text[start:end] end a sentence: white space after them, then no lowercase letter; a
    lone dot after an abbreviation or an initial does not (UNDECIDED until the next letter is known)."""
    if not text[end].isspace():
        return False
    following = text[end:].lstrip()
    if not following:
        return False if final else UNDECIDED
    if following[0].islower():
        return False
    if text[start:end].rstrip(CLOSERS) == ".":
        word = re.search(r"[\w.]*$", text[:start]).group().lower()
        if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
            return False
    return True


def clause_cut(text: str, max_chars: int) -> int:
    """Where to cut a sentence longer than `max_chars`: past the last clause mark in the second half of its first
    `max_chars` characters, else at the last space there, else at `max_chars`."""
    window = text[:max_chars]
    for marks in (CLAUSE_MARKS, " \t\n"):
        cut = max(window.rfind(mark) for mark in marks)
        if cut >= max_chars // 2:
            return cut + 1
    return max_chars
