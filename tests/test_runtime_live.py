"""rvqspec.Engine with text that arrives over time (issue 52), on tiny random qwen-tts models: whatever the split
and timing of the pieces, the codes and audio are upstream's `generate_*(text=<whole>, non_streaming_mode=False)`
(greedy, every dual-track entry point, AR and speculative) and a seeded request's are the same bits as the whole
text's (AR, speculative, w8a8); a row waiting for its text neither holds nor changes the others; cancelling or a
failing source mid-text frees the row; `rvqspec synth --text - --stream`; sentence mode on the stand-in (each
sentence as it completes, one stream, the same bits as the whole text's passage). The tokenizer tail:
tests/test_live_text.py."""

import asyncio
import functools
import random
import time

import numpy as np
import pytest
import torch

from rvqspec import ReusedHeads, TextStream, default_tree
from rvqspec.core.errors import RvqspecError
from rvqspec.runtime import Engine
from rvqspec.runtime.passage import Passage

from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.engines import (GREEDY, KINDS, bounded, decoded_codes, engine_states, frames_of,  # noqa: E402
                             upstream_states)
from helpers.upstream_tts import tiny_qwen3_tts  # noqa: E402
from test_runtime_exactness import CALLS as EXACT_CALLS, reference_wav  # noqa: E402, F401 (a fixture)

TEXT = "hello there, how are you today?"
SAMPLED = dict(do_sample=True, subtalker_dosample=True, temperature=0.9, subtalker_temperature=0.9, top_k=0,
               subtalker_top_k=0)
SPECULATIVE = dict(drafter=ReusedHeads(), tree=default_tree(8))
CALLS = {name: EXACT_CALLS[name] for name in ("custom_voice", "voice_clone_x_vector", "voice_clone_in_context")}
CALLS["voice_design"] = ("voice_design", dict(instruct="calm"))  # one text: one instruct


@functools.cache
def tiny_tts(model_type: str = "custom_voice"):
    return tiny_qwen3_tts(seed=1, model_type=model_type)


def pieces(text: str, seed: int) -> list[str]:
    """`text` cut at random places (pieces of 1 to 4 characters, as an LLM's tokens, and longer ones)."""
    rng, out, at = random.Random(seed), [], 0
    while at < len(text):
        size = rng.choice([1, 2, 3, 4, 9])
        out.append(text[at:at + size])
        at += size
    return out


def arriving(text: str, seed: int, most_seconds: float = 0.02):
    """A generator of `pieces(text, seed)`, each after a random delay (up to `most_seconds`)."""
    rng = random.Random(seed)
    for piece in pieces(text, seed):
        time.sleep(rng.uniform(0, most_seconds))
        yield piece


def arguments(call: str, reference_wav: str, settings: dict) -> tuple[str, dict]:
    model_type, voice = CALLS[call]
    named = dict(language="English", max_new_tokens=40, **settings)
    named.update({name: value.format(ref=reference_wav) if isinstance(value, str) else value
                  for name, value in voice.items()})
    return model_type, named


@pytest.mark.parametrize("call", list(CALLS))
def test_greedy_live_text_is_upstreams_dual_track_audio_whatever_the_split(call, reference_wav, monkeypatch):
    """Upstream's codes and waveform for the whole text (non_streaming_mode=False), from the engine fed the text in
    random pieces at random times (AR and speculative), and from the whole text as one piece; and the talker
    states that conditioned each frame, to rounding (codes alone would miss a wrong text row: the tiny model's
    peaked heads)."""
    model_type, named = arguments(call, reference_wav, GREEDY)
    tts, kind = tiny_tts(model_type), KINDS[model_type]
    with decoded_codes(tts) as decoded:
        with upstream_states(tts) as upstream_hidden:
            wavs, rate = getattr(tts, f"generate_{kind}")(text=TEXT, non_streaming_mode=False, **named)
        upstream, hidden = decoded[-1][0], upstream_hidden[-1][0]
        assert len(upstream) >= 3
        for options, seed in (({"drafter": None}, 1), (SPECULATIVE, 2)):
            with Engine(tts, **options) as engine:
                states = engine_states(engine, monkeypatch)
                for text in (arriving(TEXT, seed), iter([TEXT])):
                    ours, our_rate = getattr(engine, f"generate_{kind}")(text=text, **named)
                    assert torch.equal(decoded[-1][0], upstream), (options, seed)
                    assert our_rate == rate and np.array_equal(ours[0], wavs[0])
                for request_states in states.values():
                    torch.testing.assert_close(torch.stack(request_states), hidden[:len(request_states)], atol=1e-5,
                                               rtol=0)


def sampled_codes(engine, text, seed: int, kind: str = "custom_voice", **named) -> torch.Tensor:
    return engine.submit(kind, text=text, seed=seed, language="English", speaker="tiny", max_new_tokens=40,
                         **SAMPLED, **named).wait(120)


@pytest.mark.parametrize("options", [{"drafter": None}, SPECULATIVE, {"drafter": None, "weights": "w8a8"}],
                         ids=["ar", "speculative", "w8a8"])
def test_a_seeded_request_is_the_same_bits_whatever_the_split_and_timing(options):
    """The same seed: the same codes from the whole text as one piece, from random pieces at random times, and
    from pieces written by hand from another thread (w8a8: relative to its own model)."""
    with Engine(tiny_tts(), **options) as engine:
        whole = sampled_codes(engine, [TEXT].__iter__(), seed=11)
        assert len(whole) >= 3
        for split in (5, 6):
            assert torch.equal(sampled_codes(engine, arriving(TEXT, split), seed=11), whole)
        stream = TextStream()
        request = engine.submit("custom_voice", text=stream, seed=11, language="English", speaker="tiny",
                                max_new_tokens=40, **SAMPLED)
        for piece in pieces(TEXT, 7):
            stream.write(piece)
            time.sleep(0.005)
        stream.end()
        assert torch.equal(request.wait(120), whole)
        assert not torch.equal(sampled_codes(engine, iter([TEXT]), seed=12), whole)  # the seed matters


def test_a_row_waiting_for_its_text_neither_holds_nor_changes_the_others():
    """A request whose text stalls is parked: the request beside it decodes all its frames meanwhile, with the codes
    it has alone; the stalled one resumes when its text comes and has the codes it has alone."""
    named = dict(language="English", speaker="tiny", max_new_tokens=40, **GREEDY)
    with Engine(tiny_tts(), drafter=None) as engine:
        alone = engine.submit("custom_voice", text=TEXT, **named).wait(120)
        live_alone = engine.submit("custom_voice", text=iter(["hello there"]), **named).wait(120)
        stream = TextStream()
        stalled = engine.submit("custom_voice", text=stream, **named)
        stream.write("hello th")
        frames_of(stalled, 2)
        beside = engine.submit("custom_voice", text=TEXT, **named)
        assert torch.equal(beside.wait(120), alone)
        assert not stalled.done and len(stalled.decoded) < len(live_alone)
        assert engine.scheduler.parked and engine.status()["active"] == 1
        stream.write("ere")
        stream.end()
        assert torch.equal(stalled.wait(120), live_alone)


def test_a_parked_row_holds_its_place_without_spinning_the_loop(monkeypatch):
    """A row waiting for text keeps its place in the batch (max_batch 1: the next request waits), and the loop only
    looks again every POLL_SECONDS (tens of times a second, where spinning would be thousands)."""
    named = dict(language="English", speaker="tiny", max_new_tokens=40, **GREEDY)
    with Engine(tiny_tts(), drafter=None, max_batch=1) as engine:
        stream = TextStream()
        request = engine.submit("custom_voice", text=stream, **named)
        stream.write("hello th")
        frames_of(request, 2)
        other = engine.submit("custom_voice", text=TEXT, **named)
        calls, admit = [], engine.scheduler.admit
        monkeypatch.setattr(engine.scheduler, "admit", lambda: calls.append(1) or admit())
        time.sleep(1.0)
        assert len(calls) < 100 and len(other.decoded) == 0 and engine.status()["queued"] == 1
        stream.end()
        assert len(other.wait(120)) > 0 and len(request.wait(120)) > 0


def test_cancelling_mid_text_frees_the_row_and_a_failing_source_fails_its_request():
    named = dict(language="English", speaker="tiny", max_new_tokens=40, **GREEDY)

    def failing():
        yield "hello"
        raise ValueError("the LLM went away")

    with Engine(tiny_tts(), drafter=None) as engine:
        stream = TextStream()
        request = engine.submit("custom_voice", text=stream, **named)
        stream.write("hello th")
        frames_of(request, 2)
        request.cancel()
        bounded(lambda: request.wait(30), 30)
        assert engine.status()["active"] == 0 and not engine.scheduler.parked
        assert engine.scheduler.parked_cache.rows == 0 and engine.scheduler.cache.rows == 0
        with pytest.raises(RvqspecError, match="the LLM went away"):
            engine.submit("custom_voice", text=failing(), **named).wait(60)
        with pytest.raises(RvqspecError, match="empty"):
            engine.submit("custom_voice", text=iter([]), **named).wait(60)
        assert engine.status()["text_mode"] == "token"


def test_an_async_iterable_is_read_on_the_running_loop():
    async def tokens():
        for piece in pieces(TEXT, 3):
            await asyncio.sleep(0.001)
            yield piece

    async def main(engine):
        request = engine.submit("custom_voice", text=tokens(), language="English", speaker="tiny",
                                max_new_tokens=40, **GREEDY)
        return await asyncio.to_thread(request.wait, 120)

    with Engine(tiny_tts(), drafter=None) as engine:
        whole = engine.submit("custom_voice", text=iter([TEXT]), language="English", speaker="tiny",
                              max_new_tokens=40, **GREEDY).wait(120)
        assert torch.equal(asyncio.run(main(engine)), whole)


@pytest.mark.long
def test_synth_reads_stdin_as_it_arrives_and_speaks_the_engines_audio(tmp_path):
    """`rvqspec synth --text - --stream`: the text piped in pieces (the writer waits after each), the wav the
    engine's audio for the whole text."""
    import os
    import subprocess
    import sys

    import soundfile

    from helpers.upstream_tts import save_checkpoint

    folder = save_checkpoint(tiny_tts(), tmp_path / "checkpoint", {"max_new_tokens": 40, **GREEDY})
    out = tmp_path / "live.wav"
    command = [sys.executable, "-m", "rvqspec.cli", "synth", "--model", str(folder), "--text", "-", "--stream",
               "--speaker", "tiny", "--language", "English", "--device", "cpu", "--no-spec", "--out", str(out)]
    with open(tmp_path / "out.txt", "wb") as stdout, open(tmp_path / "err.txt", "wb") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    for piece in pieces(TEXT, 4):
        process.stdin.write(piece.encode())
        process.stdin.flush()
        time.sleep(0.01)
    process.stdin.close()
    assert process.wait(300) == 0, (tmp_path / "err.txt").read_text()[-2000:]
    assert "streamed: first audio after" in (tmp_path / "out.txt").read_text()
    audio, rate = soundfile.read(out, dtype="int16")
    with Engine(tiny_tts(), drafter=None) as engine:
        want = engine.stream_custom_voice(text=iter([TEXT]), speaker="tiny", language="English", max_new_tokens=40,
                                          seed=0, **GREEDY)
        want = np.concatenate([chunk for chunk, _ in want])
    assert rate == engine.sample_rate and len(audio) == len(want) > 0
    assert np.abs(audio.astype(np.int32) - np.round(want * 32768).astype(np.int32)).max() <= 1  # 16-bit rounding


@pytest.mark.long
def test_sentence_mode_speaks_each_sentence_as_it_completes_as_one_stream():
    """The stand-in (no dual-track text): text in pieces is spoken sentence by sentence as they complete, one stream
    with the seed carried on: the same bits as the whole text's passage (`sentences=True`); a sentence that arrives
    after the previous one was spoken still follows it; a failing source ends the stream with its error."""
    text = "Hello there. How are you today? I am fine, thanks."

    def slow(pieces_of: list[str], pause_after: int = -1):
        for i, piece in enumerate(pieces_of):
            time.sleep(0.5 if i == pause_after else 0.005)
            yield piece

    def failing():
        yield "Hello there. How are"
        raise ValueError("the LLM went away")

    with Engine("standin") as engine:
        assert engine.status()["text_mode"] == "sentence"
        whole = engine.speech(text, voice="en", seed=5, sentences=True)
        want = whole.audio()
        for source in (slow(pieces(text, 8)), slow(["Hello there. ", "How are you today? I am fine, thanks."], 1)):
            passage = engine.speech(source, voice="en", seed=5)
            assert np.array_equal(passage.audio(), want) and passage.end_reason == "eos"
            assert len(passage.requests) == 3
        with pytest.raises(RvqspecError, match="the LLM went away"):
            engine.speech(failing(), voice="en", seed=5).audio()
        with pytest.raises(RvqspecError, match="empty"):
            engine.speech(iter([" "]), voice="en").audio()
        assert engine.status()["active"] == 0


def test_a_passages_next_sentence_is_decoded_before_its_stream_reaches_it():
    """Sentence k+1 is queued when sentence k's decoding ends (not when its listener takes a chunk), and while the
    passage streams its audio is decoded from then on: its first chunk is waiting when the stream reaches it (no
    wait at the join for all its frames in one chunk). The audio stays the passage's."""
    text = "Hello there. How are you today?"
    with Engine("standin") as engine:
        want = engine.speech(text, voice="en", seed=5, sentences=True).audio()
        passage = engine.speech(text, voice="en", seed=5, sentences=True)
        chunks = iter(passage)
        first = next(chunks)  # then nothing is taken until the next sentence's audio is there
        deadline = time.monotonic() + 120
        while len(passage.requests) < 2 or passage.requests[1].chunks_ready.empty():
            assert time.monotonic() < deadline, "the next sentence was not decoded while the stream waited"
            time.sleep(0.01)
        assert passage.requests[0].done and passage.requests[1].attached
        audio = np.concatenate([first, *chunks])
        assert len(audio) == len(want) and np.abs(audio - want).max() < 1e-4  # chunks of other sizes: float rounding


def test_a_passage_whose_engine_closed_before_its_next_sentence_ends_with_that_error():
    """The next sentence is submitted from the engine's thread (its last one's end): an engine that closed meanwhile
    refuses it, and the passage's stream ends with that refusal; the engine's thread gets no exception."""
    class Ended:  # a sentence's request that has decoded, and its audio
        done, end_reason, attached = True, "eos", False

        def attach(self):
            self.attached = True

        def __iter__(self):
            yield np.ones(4, dtype=np.float32)

    submitted = []

    def submit(prompt, ended):
        if submitted:
            raise RvqspecError("the engine is closed: make a new rvqspec.Engine to decode more")
        submitted.append(ended)
        return Ended()

    passage = Passage(["first", "second"], submit, 16000)
    chunks = iter(passage)
    assert len(next(chunks)) == 4
    submitted[0]()  # the first sentence's end, as the engine's thread reports it: no exception there
    with pytest.raises(RvqspecError, match="engine is closed"):
        next(chunks)
    assert passage.done and passage.end_reason == "error"
