"""Text that arrives while its speech is decoded (an LLM's tokens): `TextStream` (the caller writes pieces), the text
tokens that more text can no longer change (`StableTokens`), and a request's text rows as its talker takes them
(`LiveText`).

Qwen3-TTS's talker is dual-track: frame t's input is the sum of its codes' embeddings and text row t (upstream's
`trailing_text_hidden`, `non_streaming_mode=False`), then `tts_eos` once, then `tts_pad`. So a request can start as
soon as its first token is known and take each next one as it comes: a row whose text row t has not arrived waits
(the scheduler parks it) and rejoins when it comes.

The tokenizer's tail: "hel" + "lo" may tokenize otherwise than "hello", so tokens are committed only up to the start
of the text's last pre-token (the tokenizer's own normalizer and pre-tokenizer): byte-level BPE never merges across
a pre-token, and more text can only extend or re-split the last one (tests/test_live_text.py: a property test over
random splits against tokenizing the whole text, the way upstream does).
"""

import asyncio
import threading
import unicodedata
from collections.abc import AsyncIterable, Callable, Iterable

import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError

PROJECT_ROWS = 16  # text rows are projected in calls of exactly this many rows: a row's bits then never depend on
# how the text was split (a matmul's row depends on the call's row count on some CPUs), and they are the bits of a
# large call (upstream's whole-text projection) on those measured (scripts in docs/live-speech.md)


class TextStream:
    """Text fed by hand: `write(piece)` as it comes (any thread), `end()` when it is complete. Pass it as `text=` to
    an Engine entry point; pieces written before that are kept."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pieces: list[str] = []
        self.ended = False
        self.reader: Callable[[str | BaseException | None], None] | None = None  # the request's: a piece, the
        # end (None), or the error that ended the text's source
        self.task: asyncio.Task | None = None  # the task reading an async iterable into it (kept from the GC)

    def write(self, piece: str) -> None:
        check_piece(piece)
        with self.lock:
            if self.ended:
                raise RvqspecError("this text already ended: write before end(), or start another request")
            self.pieces.append(piece) if self.reader is None else self.reader(piece)

    def end(self, error: BaseException | None = None) -> None:
        """The text is complete; or, with `error`, its source failed (the request then ends with that error)."""
        with self.lock:
            if not self.ended:
                self.ended = True
                self.pieces.append(error)
                if self.reader is not None:
                    self.reader(self.pieces.pop())

    def attach(self, reader: Callable[[str | None], None]) -> None:
        """Hand what was written, and from now on each piece, to `reader` (once)."""
        with self.lock:
            if self.reader is not None:
                raise RvqspecError("this TextStream already feeds a request: make one TextStream per request")
            self.reader = reader
            for piece in self.pieces:  # the end (None or an error) last
                reader(piece)
            self.pieces = []


def check_piece(piece) -> None:
    if not isinstance(piece, str):
        raise RvqspecError(f"text pieces must be strings, got {type(piece).__name__}")
    try:
        piece.encode("utf-8")
    except UnicodeEncodeError:
        raise RvqspecError("the text is not valid Unicode (a lone surrogate): send whole characters") from None


def is_live(text) -> bool:
    """Whether `text` is text that arrives over time (a TextStream, an iterable or async iterable of pieces) rather
    than upstream's str or list of str."""
    return isinstance(text, (TextStream, AsyncIterable)) or (
        isinstance(text, Iterable) and not isinstance(text, (str, list, tuple, bytes)))


def text_stream(text, cancelled: threading.Event) -> TextStream:
    """`text` as a TextStream: an async iterable is read by a task on the running event loop (else by a thread's own
    loop), an iterable by a thread of its own; each ends at the text's end, at its source's error, or once the
    request is cancelled."""
    if isinstance(text, TextStream):
        return text
    stream = TextStream()

    async def pump():
        try:
            async for piece in text if isinstance(text, AsyncIterable) else as_async(text):
                if cancelled.is_set():
                    break
                stream.write(piece)
        except Exception as e:
            stream.end(e)
        stream.end()
    try:
        if not isinstance(text, AsyncIterable):
            raise RuntimeError("an iterable blocks: a thread of its own")
        stream.task = asyncio.get_running_loop().create_task(pump())
    except RuntimeError:
        threading.Thread(target=asyncio.run, args=(pump(),), name="rvqspec-text", daemon=True).start()
    return stream


async def as_async(pieces: Iterable):
    """An iterable's items from an async loop of its own (each `next` may block it: nothing else runs there)."""
    for piece in pieces:
        yield piece


class StableTokens:
    """A text's token ids as they become final: `feed(piece)` and `end()` return the ids committed by it. The ids
    are the tokenizer's for `lead + text` minus those of `lead` (upstream slices the same layout's ids), committed
    up to the start of the last pre-token (module docstring)."""

    def __init__(self, tokenizer, lead: str = "assistant\n", skip: int = 2):
        self.tokenizer, self.backend = tokenizer, tokenizer.backend_tokenizer
        self.tail, self.skip = lead, skip  # the text not committed yet; ids of `lead` still to drop

    def feed(self, piece: str) -> list[int]:
        self.tail += piece
        cut = self.stable_end()
        return self.commit(cut) if cut else []

    def end(self) -> list[int]:
        return self.commit(len(self.tail))

    def commit(self, cut: int) -> list[int]:
        """The ids of the tail's first `cut` characters, tokenized with what follows them (a pre-token's split can
        depend on the next character: "  " alone is one whitespace token, before "0" two)."""
        tokens = self.tokenizer(self.tail, add_special_tokens=False, return_offsets_mapping=True)
        ids = [i for i, (_, end) in zip(tokens["input_ids"], tokens["offset_mapping"]) if end <= cut]
        self.tail = self.tail[cut:]
        dropped, self.skip = min(self.skip, len(ids)), self.skip - min(self.skip, len(ids))
        return ids[dropped:]

    def stable_end(self) -> int:
        """Where the tail's last pre-token starts (0: it has one pre-token)."""
        normal = self.backend.normalizer.normalize_str(self.tail) if self.backend.normalizer else self.tail
        pieces = self.backend.pre_tokenizer.pre_tokenize_str(normal) if self.backend.pre_tokenizer else []
        if len(pieces) < 2:
            return 0
        start = pieces[-1][1][0]
        if normal == self.tail:
            return start
        prefix = normal[:start]  # the tail's own index whose normal form is that prefix (normalizing changed it)
        for cut in range(len(self.tail), 0, -1):
            if unicodedata.normalize("NFC", self.tail[:cut]) == prefix:
                return cut
        return 0


class LiveText:
    """A request's text rows as they arrive (module docstring): row k is text token k's projection (`project`, in
    calls of PROJECT_ROWS rows), then `eos` once the text ended, then `pad`. The prompt takes rows 0..start-1
    (`head`, the adapter's), frame t row start + t. `known`: ids before the text's (a clone's reference transcript).
    The caller's side (`read`: a TextStream's pieces) commits tokens; the scheduler's (`ready`, `head`, `row`)
    projects them."""

    def __init__(self, tokens: StableTokens, project: Callable[[Tensor], Tensor], eos: Tensor, pad: Tensor,
                 start: int, head: Callable[["LiveText"], Tensor], known: list[int] | None = None):
        self.tokens, self.project, self.eos, self.pad, self.start = tokens, project, eos, pad, start
        self.make_head = head
        self.ids: list[int] = list(known or [])
        self.known = len(self.ids)
        self.on_end: Callable[[int], None] = lambda tokens: None  # told the text's token count at its end
        self.rows: list[Tensor] = []
        self.ended, self.error = False, None
        self.lock = threading.Lock()
        self.wake: Callable[[], None] = lambda: None  # the scheduler's, set when it takes the request

    def read(self, piece: str | BaseException | None) -> None:
        """A TextStream's reader: `piece` (None: the end; an error: its source failed) -> committed ids."""
        try:
            if isinstance(piece, BaseException):
                raise RvqspecError(f"the text's source failed ({type(piece).__name__}: {piece})")
            ids = self.tokens.end() if piece is None else self.tokens.feed(piece)
        except RvqspecError as e:
            ids, self.error = [], e
        except Exception as e:  # the tokenizer refused it: the request ends with the reason
            ids, self.error = [], RvqspecError(f"the text could not be tokenized ({type(e).__name__}: {e})")
        with self.lock:
            self.ids += ids
            ending = not self.ended and (piece is None or self.error is not None)
            self.ended = self.ended or ending
        if ending:
            self.on_end(len(self.ids) - self.known)
        self.wake()

    def ready(self, rows: int) -> bool:
        """Whether rows 0..rows-1 are known (the ids, or the text's end)."""
        with self.lock:
            return self.ended or len(self.ids) >= rows

    def head(self) -> Tensor:
        """The prompt's last rows [n, H], once `ready(start)` (the adapter's `head`); scheduler thread."""
        if self.row(self.start - 1) is None or self.row(0) is None:
            raise RvqspecError("the prompt's text rows have not arrived")
        return self.make_head(self)

    def row(self, index: int) -> Tensor | None:
        """Row `index` (None: not arrived yet); scheduler thread."""
        with self.lock:
            ids, ended = list(self.ids), self.ended
        if self.error is not None:
            raise self.error
        if index < len(ids):
            self.project_to(ids, index)
            return self.rows[index]
        if not ended:
            return None
        if not ids:
            raise RvqspecError("the text was empty: send at least one word")
        return self.eos if index == len(ids) else self.pad

    def project_to(self, ids: list[int], index: int) -> None:
        while len(self.rows) <= index:
            chunk = ids[len(self.rows):len(self.rows) + PROJECT_ROWS]
            padded = torch.tensor(chunk + chunk[-1:] * (PROJECT_ROWS - len(chunk)))
            self.rows += list(self.project(padded)[:len(chunk)])
