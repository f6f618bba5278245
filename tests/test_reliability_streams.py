"""Streams of one model never deadlock (issue 36, cases 1-4): a second stream in the same thread is refused at
once, one in another thread waits while the first is read and gets a clear error once the first is left
unread; Ctrl-C reaches a waiting stream; undo() is refused while a stream generates. Every body that could
hang runs under a watchdog (`bounded`), so a deadlock fails the test instead of stalling CI."""

import faulthandler
import os
import signal
import threading
import time

import pytest
import torch

import rvqspec
from rvqspec import RvqspecError
from rvqspec.integrations import stream as stream_module

from helpers.engines import bounded
from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from rvqspec.integrations.qwen_tts import accelerate  # noqa: E402

from helpers.csm_models import prompts, tiny_csm  # noqa: E402
from helpers.upstream_tts import FRAME_SAMPLES, tiny_qwen3_tts  # noqa: E402

GREEDY = dict(do_sample=False, subtalker_dosample=False)
HERE = r"test_reliability_streams\.py:\d+"  # where a stream of this file was opened, as errors name it
SAME_THREAD = rf"opened at .*{HERE}, is open in this thread.*close\(\) it first.*rvqspec\.Engine"
LEFT_UNREAD = rf"opened at .*{HERE}, holds the model and has not been read for .*close\(\) it"


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rvqspec")]


@pytest.fixture(scope="module")
def tts():
    """The tiny model, decoded through rvqspec once: the CPU fast path's kernels are built (or loaded) here,
    outside the watchdogs."""
    tts = tiny_qwen3_tts(seed=1)
    handle = accelerate(tts)
    whole(tts, 2)
    handle.undo()
    return tts


@pytest.fixture
def handle(tts):
    """The tiny qwen-tts model accelerated (AR); undone after the test, and no tap left on the talker."""
    handle = accelerate(tts)
    yield handle
    handle.undo()
    assert "forward" not in vars(tts.model.talker) and not worker_threads()


def speak(handle, frames: int, text: str = "hi there"):
    """A stream of exactly `frames` frames, one chunk per frame: the worker cannot queue it all (4 chunks)."""
    return handle.stream_custom_voice(text=text, speaker="tiny", language="english", max_new_tokens=frames,
                                      min_new_tokens=frames, chunk_frames=1, first_chunk_frames=1, **GREEDY)


def samples(chunks) -> int:
    return sum(len(audio) for audio, _ in chunks)


def whole(tts, frames: int) -> int:
    """Samples of upstream's generate call that `speak(handle, frames)` streams."""
    wavs, _ = tts.generate_custom_voice(text="hi there", speaker="tiny", language="english", max_new_tokens=frames,
                                        min_new_tokens=frames, **GREEDY)
    return len(wavs[0])


def test_two_streams_zipped_in_one_thread_refuse_the_second_at_once(handle, tts):
    """Case 1 (what an asyncio server interleaving two responses does): the second stream's first read raises
    at once; the first then streams to the end."""
    def body() -> int:
        first, second = speak(handle, 30), speak(handle, 30)
        with pytest.raises(RvqspecError, match=SAME_THREAD):
            for _ in zip(first, second):
                pass
        return FRAME_SAMPLES + samples(first)  # zip took one chunk of the first

    start = time.monotonic()
    assert bounded(body) == whole(tts, 30)
    assert time.monotonic() - start < 10


def test_a_stream_opened_inside_another_ones_loop_is_refused_at_once(handle, tts):
    """Case 2."""
    def body() -> int:
        outer, refused = [], []
        for audio, _ in speak(handle, 30):
            outer.append(len(audio))
            if len(outer) == 2:
                with pytest.raises(RvqspecError, match=SAME_THREAD):
                    next(speak(handle, 5))
                refused.append(True)
        assert refused
        return sum(outer)

    assert bounded(body) == whole(tts, 30)


def test_two_csm_streams_zipped_in_one_thread_refuse_the_second_at_once():
    model = tiny_csm(codebooks=8, vocab=32, seed=3, runnable_codec=True)
    ids = prompts(1)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30, do_sample=False, depth_decoder_do_sample=False)
    handle = rvqspec.accelerate(model)
    try:
        def body() -> None:
            first, second = handle.stream(**kwargs, chunk_frames=1), handle.stream(**kwargs, chunk_frames=1)
            with pytest.raises(RvqspecError, match=SAME_THREAD):
                for _ in zip(first, second):
                    pass
            assert len(list(first)) == 29

        bounded(body)
    finally:
        handle.undo()
    assert not worker_threads()


@pytest.mark.parametrize("kept_by", ["a name", "an exception"])
def test_a_stream_left_unread_blocks_another_thread_for_a_bounded_time(handle, tts, monkeypatch, kept_by):
    """Case 3: a stream left after `break` but still bound to a name, or kept by the traceback of an exception
    raised in its loop: a stream in another thread gets a clear error after IDLE_SECONDS (instead of waiting
    forever); once the first is closed, the second streams in full."""
    monkeypatch.setattr(stream_module, "IDLE_SECONDS", 0.3)
    first = speak(handle, 30)
    if kept_by == "a name":
        for _ in first:
            break
    else:
        def consume() -> None:
            chunks = speak(handle, 30)
            for _ in chunks:
                raise ValueError("the consumer's loop failed")

        try:
            consume()
        except ValueError as error:
            kept = error  # its traceback keeps consume's frame, and the stream in it, alive
    start = time.monotonic()
    with pytest.raises(RvqspecError, match=LEFT_UNREAD):
        bounded(lambda: samples(speak(handle, 5)))
    assert 0.3 <= time.monotonic() - start < 5
    if kept_by == "a name":
        first.close()
    else:
        del kept
    assert bounded(lambda: samples(speak(handle, 5))) == whole(tts, 5)


def test_a_stream_read_slowly_makes_another_thread_wait_not_fail(handle, tts, monkeypatch):
    """The bound is on a consumer that stopped reading, not on the wait: a first stream read every 0.1 s (a
    player) makes a second one, started in another thread, wait for it and then stream in full."""
    monkeypatch.setattr(stream_module, "IDLE_SECONDS", 0.3)
    started, lengths = threading.Event(), {}

    def slow() -> None:
        total = 0
        for audio, _ in speak(handle, 12):
            started.set()
            total += len(audio)
            time.sleep(0.1)
        lengths["slow"] = total

    player = threading.Thread(target=slow)
    player.start()
    started.wait(10)
    lengths["second"] = bounded(lambda: samples(speak(handle, 5)))
    player.join(10)
    assert lengths == {"slow": whole(tts, 12), "second": whole(tts, 5)}


def test_ctrl_c_reaches_a_stream_waiting_for_its_turn(handle, tts):
    """A stream waiting for the model while another thread's stream holds it: SIGINT ends the wait at once
    (Ctrl-C in the main thread; a worker waiting on a plain lock used to make the consumer's join hang). The
    watchdogs need the main thread free: after 10 s a timer closes the holding stream (a hang then fails the
    time check), after 60 s faulthandler ends the process with every thread's stack."""
    first = speak(handle, 30)
    bounded(lambda: next(first))  # opened and paused in another thread
    interrupt = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    rescue = threading.Timer(10, first.close)
    faulthandler.dump_traceback_later(60, exit=True)
    # Ctrl-C as a plain program gets it (Python's handler, the signal not blocked in the main thread), whatever a
    # library loaded by an earlier test in this worker process left behind (once in CI: the signal never arrived)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        interrupt.start()
        rescue.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            samples(speak(handle, 5))
        assert time.monotonic() - start < 3
    finally:
        faulthandler.cancel_dump_traceback_later()
        interrupt.cancel()
        rescue.cancel()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)
    assert FRAME_SAMPLES + samples(first) == whole(tts, 30)  # the first is untouched


def test_undo_is_refused_while_a_stream_generates_and_no_stream_is_cut_short(tts):
    """Case 4: undo() while a stream is paused raises, and the stream stays whole; a stream opened from the
    handle after undo() is refused; accelerating again streams in full; no wrapper is left on the talker."""
    def body() -> None:
        handle = accelerate(tts)
        paused, late = speak(handle, 11), speak(handle, 11)
        first = len(next(paused)[0])
        with pytest.raises(RvqspecError, match=r"opened at .*is still generating: .*close\(\) it before undo\(\)"):
            handle.undo()
        assert first + samples(paused) == whole(tts, 11)
        handle.undo()
        with pytest.raises(RvqspecError, match="this acceleration was undone: accelerate the model again"):
            next(late)
        again = accelerate(tts)
        try:
            assert samples(speak(again, 11)) == whole(tts, 11)
        finally:
            again.undo()

    bounded(body)
    assert "forward" not in vars(tts.model.talker) and "decode" not in vars(tts.model.speech_tokenizer)
    assert "generate" not in vars(tts.model.talker.code_predictor) and not worker_threads()
