"""rvqspec.Engine (issue 32) in use, on tiny random models: a request's codes do not depend on what else is in the
batch (requests joining mid-utterance, rows leaving early; the stand-in and qwen-tts; AR and speculative), seeded
requests repeat, and the engine's behaviour: cancel, a full queue, close, bad prompts, an internal error, streaming.
Exactness against upstream and the G-tests: tests/test_runtime_exactness.py."""

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from rvqspec import ReusedHeads, RvqspecError, default_tree
from rvqspec.runtime import Engine, QueueFull

from helpers.engines import GREEDY, frames_of, never_ending
from helpers.standin import tiny_standin
from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.upstream_tts import FRAME_SAMPLES, tiny_qwen3_tts, tiny_qwen3_tts64, write_wav  # noqa: E402

WAIT = 120  # seconds: a bound on any wait, so that a bug fails a test rather than hanging the suite
SPECULATIVE = dict(drafter=ReusedHeads(), tree=default_tree(8))
# realtime=False where a test needs its requests in one batch: admission at real time (tests/test_concurrency.py) may
# hold a request back on a loaded machine
QWEN = dict(speaker="tiny", language="English")


@pytest.fixture(scope="module")
def tts():
    return tiny_qwen3_tts(seed=0)


@pytest.fixture(scope="module")
def standin():
    return tiny_standin(seed=3)


def requests_of(model: str) -> tuple[str, list[dict]]:
    """(kind, arguments) of four greedy requests: the first long, the third leaving after 3 frames, the fourth
    after 7 (qwen-tts's max_new_tokens counts c0 draws, the last one's frame never decoded; the stand-in's
    counts frames)."""
    if model == "standin":
        texts = [("Guten Tag, wie geht's?", "de"), ("¿Qué tal?", "es"), ("hello there", "en"), ("Привет.", "ru")]
        arguments = [dict(text=text, language=lang, **GREEDY) for text, lang in texts]
        arguments[2]["max_new_tokens"], arguments[3]["max_new_tokens"] = 3, 7
        return "speech", arguments
    texts = ["hello there", "a second line", "yes", "one more sentence"]
    limits = [40, 40, 4, 8]
    return "custom_voice", [dict(text=text, max_new_tokens=n, **QWEN, **GREEDY) for text, n in zip(texts, limits)]


class Gate:
    """Wraps the scheduler's frame step: records each step's batch size, and holds the scheduler's thread at the
    step after `request` has `frames` frames until `open()` (so that requests submitted meanwhile join then)."""

    def __init__(self, engine, monkeypatch):
        self.sizes, self.request, self.frames = [], None, 0
        self.reached, self.opened = threading.Event(), threading.Event()
        scheduler, step = engine.scheduler, engine.scheduler.frame_step

        def gated():
            if self.request is not None and len(self.request.decoded) >= self.frames and not self.opened.is_set():
                self.reached.set()
                assert self.opened.wait(WAIT)
            self.sizes.append(len(scheduler.rows))
            step()

        monkeypatch.setattr(scheduler, "frame_step", gated)

    def hold(self, request, frames: int) -> None:
        self.request, self.frames = request, frames

    def open(self) -> None:
        self.opened.set()


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "speculative"])
@pytest.mark.parametrize("model", ["standin", "qwen-tts"])
def test_greedy_codes_do_not_depend_on_the_batch(model, speculative, tts, standin, monkeypatch):
    """Each request alone, then all four together: the first decodes alone for 3 frames, the other three join
    it at the next frame boundaries (one prefill piece a gap while a row decodes), two of them leave early (short max_new_tokens) while the others go on. Every
    request's codes are the very codes it gets alone."""
    kind, arguments = requests_of(model)
    options = SPECULATIVE if speculative else {"drafter": None}
    with Engine(standin if model == "standin" else tts, realtime=False, **options) as engine:
        alone = [engine.submit(kind, **a).wait(WAIT) for a in arguments]
        gate = Gate(engine, monkeypatch)
        first = engine.submit(kind, **arguments[0])
        gate.hold(first, 3)
        assert gate.reached.wait(WAIT)
        others = [engine.submit(kind, **a) for a in arguments[1:]]
        gate.open()
        together = [request.wait(WAIT) for request in [first, *others]]
    assert [len(codes) for codes in alone[2:]] == [3, 7] and len(alone[0]) > 10
    for index, (mine, theirs) in enumerate(zip(together, alone)):
        assert torch.equal(mine, theirs), index
    peak = gate.sizes.index(4)  # all four decoded together, after the first alone for 3 frames
    assert gate.sizes[:peak] == [1] * (peak - 2) + [2, 3] and peak >= 5  # one joined per gap
    assert 3 in gate.sizes[peak:]  # and rows left while others went on


def sampled_requests_of(model: str) -> tuple[str, list[dict]]:
    """(kind, arguments) of eight requests, talker and predictor sampled: the first long, the others leaving after
    9 to 15 frames (or at a sampled EOS): they join one a frame step (chunked prefill), all eight decode together,
    then they leave one by one."""
    kind, arguments = requests_of(model)
    sampled = [{k: v for k, v in a.items() if k not in GREEDY} for a in arguments * 2]
    for a, frames in zip(sampled, [24, 9, 10, 11, 12, 13, 14, 15]):
        a["max_new_tokens"] = frames + (model != "standin")  # qwen-tts counts the c0 of a frame never decoded
    return kind, sampled


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "speculative"])
@pytest.mark.parametrize("model", ["standin", "qwen-tts"])
def test_seeded_sampled_codes_do_not_depend_on_the_batch(model, speculative, tts, standin, monkeypatch):
    """A seed is a seed in any batch: every draw of a row (c0 and the predictor's) comes from its own generator.
    Eight requests of different seeds, each alone, then together: the first alone for 3 frames, the seven others
    joining it one a frame step and leaving one by one (batches of 2 up to 8 and down again). Every request's sampled
    codes are the very codes it gets alone."""
    kind, arguments = sampled_requests_of(model)
    options = SPECULATIVE if speculative else {"drafter": None}
    first_seed = {"standin": 10, "qwen-tts": 3}[model]  # the first seeds none of whose requests draw an early EOS
    seeds = range(first_seed, first_seed + len(arguments))
    with Engine(standin if model == "standin" else tts, realtime=False, **options) as engine:
        alone = [engine.submit(kind, seed=seed, **a).wait(WAIT) for seed, a in zip(seeds, arguments)]
        gate = Gate(engine, monkeypatch)
        first = engine.submit(kind, seed=seeds[0], **arguments[0])
        gate.hold(first, 3)
        assert gate.reached.wait(WAIT)
        others = [engine.submit(kind, seed=seed, **a) for seed, a in zip(seeds[1:], arguments[1:])]
        gate.open()
        together = [request.wait(WAIT) for request in [first, *others]]
    for index, (mine, theirs) in enumerate(zip(together, alone)):
        assert torch.equal(mine, theirs), index
    assert {8, 4, 2} <= set(gate.sizes) and gate.sizes[:3] == [1] * 3
    same_text = [alone[i][:2] for i in (0, 4)]  # the same text and settings, other seeds: other codes
    assert not torch.equal(*same_text)


def test_a_seeded_engine_repeats_its_unseeded_requests(tts):
    """Engine(seed=) seeds the seeds of the requests submitted without one, in submission order: a run repeats; a
    request's own seed is its own."""
    arguments = dict(text="hello there", max_new_tokens=6, **QWEN)
    runs = []
    for seed in (5, 5, 6):
        with Engine(tts, drafter=None, seed=seed) as engine:
            runs.append([engine.submit("custom_voice", **arguments).wait(WAIT) for _ in range(2)]
                        + [engine.submit("custom_voice", seed=1, **arguments).wait(WAIT)])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0]) and torch.equal(runs[0][2], runs[2][2])


# ---------------------------------------------------------------- behaviour


def long_request(engine, seed: int = 0):
    """A request that decodes until cancelled (EOS forbidden, no length limit), from the tiny qwen-tts's prompt."""
    prompt = engine.model.prompts("custom_voice", dict(text="hello there", **QWEN, **GREEDY))[0]
    return engine.enqueue(never_ending(prompt), seed)


def test_cancel_frees_the_row_at_the_next_frame_boundary_and_ends_iteration(tts):
    with Engine(tts, drafter=None) as engine:
        request = long_request(engine)
        frames_of(request, 3)
        assert engine.status()["active"] == 1
        request.cancel()
        assert request.finished.wait(WAIT)  # the scheduler let the row go
        assert engine.status()["active"] == 0 and request.error is None
        decoded = len(request.decoded)
        chunks = list(request)  # ends (the frames left, no final flush), no error
        assert all(chunk.dtype == np.float32 for chunk in chunks)
        assert len(request.wait(WAIT)) == decoded >= 3
        after = engine.submit("custom_voice", text="yes", max_new_tokens=4, **QWEN, **GREEDY)
        assert len(after.wait(WAIT)) == 3  # and the engine goes on


def test_a_full_queue_refuses_with_queue_full(tts):
    with Engine(tts, drafter=None, max_batch=1, max_queue=1) as engine:
        running = long_request(engine)
        frames_of(running, 1)  # decoding: it holds the one row
        waiting = long_request(engine, seed=1)
        try:
            assert engine.status()["active"] == 1 and engine.status()["queued"] == 1
            with pytest.raises(QueueFull, match="queue is full"):
                long_request(engine, seed=2)
            assert issubclass(QueueFull, RvqspecError)
        finally:
            running.cancel()
            waiting.cancel()
        assert running.finished.wait(WAIT)


def test_closed_engine_refuses_requests_and_its_thread_ends(tts):
    engine = Engine(tts, drafter=None)
    done = engine.submit("custom_voice", text="yes", max_new_tokens=4, **QWEN, **GREEDY)
    engine.close()  # grace None: what was submitted finishes
    assert len(done.wait(WAIT)) == 3 and done.error is None
    assert engine.scheduler.thread not in threading.enumerate()
    with pytest.raises(RvqspecError, match="closed"):
        engine.speech("hello there", voice="tiny")
    with pytest.raises(RvqspecError, match="closed"):
        engine.submit("custom_voice", text="hello there", **QWEN)


def test_close_without_grace_ends_what_is_in_flight_with_an_error_and_the_thread_ends(tts):
    """What close cuts short ends with an error (its audio is not the whole), not as if it were complete."""
    engine = Engine(tts, drafter=None, max_batch=1)
    running, waiting = long_request(engine), long_request(engine, seed=1)
    frames_of(running, 2)
    engine.close(grace=0)
    assert engine.scheduler.thread not in threading.enumerate()
    for request, frames in ((running, 2), (waiting, 0)):
        with pytest.raises(RvqspecError, match="engine was closed"):
            request.wait(WAIT)
        assert len(request.codes) >= frames
        with pytest.raises(RvqspecError, match="cut short"):
            list(request)


def test_close_without_grace_finishes_the_requests_it_cancels(tts):
    """Whoever waits on a request's end (request.done, request.finished) sees it end when the engine closes."""
    engine = Engine(tts, drafter=None, max_batch=1)
    running, waiting = long_request(engine), long_request(engine, seed=1)
    frames_of(running, 2)
    engine.close(grace=0)
    assert running.done and waiting.done


def test_a_bad_prompt_fails_its_own_request_and_the_engine_serves_the_others(tts, standin):
    """Refused at submit: an unknown speaker (upstream's refusal), the wrong entry point, an empty text (the
    stand-in), several texts in one submit. Failing at prefill (a RoPE position past the talker's table): that
    request ends with RvqspecError while another decodes, and the next request's codes are its codes alone."""
    with Engine(tts, drafter=None) as engine:
        good = dict(text="a second line", max_new_tokens=10, **QWEN, **GREEDY)
        alone = engine.submit("custom_voice", **good).wait(WAIT)
        with pytest.raises(RvqspecError, match="nobody"):
            engine.submit("custom_voice", text="hello", speaker="nobody", language="English")
        with pytest.raises(RvqspecError, match="custom_voice"):
            engine.submit("voice_design", text="hello", instruct="calm", language="English")
        with pytest.raises(RvqspecError, match="one text"):
            engine.submit("custom_voice", text=["hello", "there"], speaker="tiny", language="English")
        running = long_request(engine)
        frames_of(running, 2)
        prompt = engine.model.prompts("custom_voice", dict(text="hello", **QWEN, **GREEDY))[0]
        broken = engine.enqueue(replace(prompt, positions=prompt.positions + 10 ** 6), 0)
        with pytest.raises(RvqspecError, match="RoPE position"):
            broken.wait(WAIT)
        after = engine.submit("custom_voice", **good)
        assert torch.equal(after.wait(WAIT), alone)
        assert not running.done
        running.cancel()
    with Engine(standin, drafter=None) as engine:
        with pytest.raises(RvqspecError, match="non-empty"):
            engine.submit("speech", text="  ", language="en")
        assert len(engine.submit("speech", text="hi", language="en", max_new_tokens=3, **GREEDY).wait(WAIT))


def test_an_internal_error_fails_that_steps_requests_not_the_engine(tts, monkeypatch):
    """c0_logits raises once: the request of that frame step ends with RvqspecError (naming the error), a warning
    says so, and the engine decodes the next request as if nothing happened."""
    arguments = dict(text="a second line", max_new_tokens=10, **QWEN, **GREEDY)
    with Engine(tts, drafter=None) as engine:
        alone = engine.submit("custom_voice", **arguments).wait(WAIT)
        c0_logits, calls = engine.model.c0_logits, []

        def failing_once(hidden):
            calls.append(len(hidden))
            if len(calls) == 1:
                raise RuntimeError("boom")
            return c0_logits(hidden)

        monkeypatch.setattr(engine.model, "c0_logits", failing_once)
        with pytest.warns(RuntimeWarning, match="a frame step failed"):
            failed = engine.submit("custom_voice", **arguments)
            with pytest.raises(RvqspecError, match="boom"):
                failed.wait(WAIT)
        assert engine.status()["active"] == 0 and engine.scheduler.thread.is_alive()
        assert torch.equal(engine.submit("custom_voice", **arguments).wait(WAIT), alone)


@pytest.fixture(scope="module")
def tts64():
    return tiny_qwen3_tts64()


def test_streamed_chunks_concatenate_to_the_whole_audio(tts64):
    """stream_custom_voice yields (audio, sample_rate) chunks (the first of 2 frames, then 3) that concatenate to
    generate_custom_voice's waveform; iterating a submitted request gives the same chunks."""
    arguments = dict(text="hello there", max_new_tokens=12, **QWEN, **GREEDY)
    with Engine(tts64, drafter=None, chunk_frames=3, first_chunk_frames=2) as engine:
        (whole,), rate = engine.generate_custom_voice(**arguments)
        streamed = list(engine.stream_custom_voice(**arguments))
        chunks = list(engine.submit("custom_voice", **arguments))
    assert len(streamed) > 2 and {r for _, r in streamed} == {rate} == {engine.sample_rate}
    assert len(streamed[0][0]) == 2 * FRAME_SAMPLES and all(a.dtype == np.float32 for a, _ in streamed)
    audio = np.concatenate([a for a, _ in streamed])
    assert audio.shape == whole.shape and whole.std() > 0.05
    np.testing.assert_allclose(audio, whole, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.concatenate(chunks), audio)


def test_a_cloned_voice_streams_its_own_audio_after_the_reference(tmp_path):
    """In-context voice clone: the reference's codes are decoded first, unheard; the chunks concatenate to
    generate_voice_clone's waveform (reference cut off)."""
    write_wav(tmp_path / "ref.wav", 0.5, seed=3)
    tts = tiny_qwen3_tts(seed=1, model_type="base")
    tts.model.speech_tokenizer.model.double()
    arguments = dict(text="hello there", language="English", ref_audio=str(tmp_path / "ref.wav"), ref_text="hello",
                     max_new_tokens=10, **GREEDY)
    with Engine(tts, drafter=None, chunk_frames=3, first_chunk_frames=2) as engine:
        (whole,), _ = engine.generate_voice_clone(**arguments)
        audio = np.concatenate([a for a, _ in engine.stream_voice_clone(**arguments)])
    assert audio.shape == whole.shape
    np.testing.assert_allclose(audio, whole, atol=1e-6, rtol=0)
