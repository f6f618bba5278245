"""Concurrency that pays (issue 40): the thread budget (never more threads doing torch work than the engine's
cores), audio made off the callers' threads and independent of the batch, and admission under a tiny capacity.
Seeds and chunked prefill: tests/test_runtime.py."""

import contextlib
import os
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rvqspec import RvqspecError
from rvqspec.integrations.qwen_tts_audio import CodecBatchUnsupported
from rvqspec.runtime import Engine
from rvqspec.runtime import qwen_tts as qwen_tts_runtime
from rvqspec.runtime.capacity import Capacity
from rvqspec.core.frame_loop import ChunkClock
from rvqspec.runtime.codec_worker import AHEAD_FRAMES, CodecWorker, Cores, Feed, Grant
from rvqspec.runtime.request import Request
from rvqspec.runtime.scheduler import Scheduler
from rvqspec.runtime.threads import GIL_SWITCH_SECONDS, ThreadBudget, fixed_where_bits_vary, quick_gil_handoff

from helpers.engines import GREEDY, bounded, frames_of, never_ending
from helpers.standin import tiny_standin
from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.upstream_tts import tiny_qwen3_tts, tiny_qwen3_tts64  # noqa: E402

WAIT = 120
QWEN = dict(speaker="tiny", language="English")


@pytest.fixture(scope="module")
def tts64():
    return tiny_qwen3_tts64()


# ---------------------------------------------------------------- the thread budget

def test_the_default_budget_follows_the_cores_the_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert ThreadBudget.split() == ThreadBudget(cores=1, loop=1, codec=1, loop_most=1, prefill_most=1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert ThreadBudget.split() == ThreadBudget(cores=4, loop=3, codec=4, loop_most=4,  # all 4 while no decode
                                                prefill_most=4)
    assert ThreadBudget.split(cores=2, threads=2, codec_threads=3) == ThreadBudget(cores=2, loop=2, codec=3,
                                                                                   loop_most=2, prefill_most=2)
    assert ThreadBudget.split(threads=6).cores == 6  # a frame loop of 6 threads holds 6 cores
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(RvqspecError, match="whole number >= 1"):
            ThreadBudget.split(threads=bad)


def test_cores_are_handed_out_first_come_first_served():
    cores, order = Cores(2), []

    def take(name: str, count: int) -> None:
        with cores.held(count):
            order.append(name)

    with cores.held(2):  # all taken: the others queue in the order they came
        threads = [threading.Thread(target=take, args=(name, count)) for name, count in (("a", 2), ("b", 1))]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
    for thread in threads:
        thread.join(WAIT)
    assert order == ["a", "b"]  # b (one core) did not overtake a (two)


def test_cores_held_up_to_a_most_take_what_is_free_then():
    cores = Cores(2)
    with cores.held(1, 2) as grant:
        assert grant.count == 2 and cores.free == 0
    with cores.held(1) as one:
        with cores.held(1, 2) as grant:
            assert one.count == grant.count == 1 and cores.free == 0
    assert cores.free == 2


def test_a_grant_resizes_without_waiting_and_never_takes_a_core_someone_waits_for():
    cores = Cores(2)
    with cores.held(1, 2) as grant:
        assert grant.resize(1) == 1 and cores.free == 1  # handed back at once
        assert grant.resize(2) == 2 and cores.free == 0  # free, no one waiting: taken
        assert grant.resize(1) == 1
        with cores.held(1):
            assert grant.resize(2) == 1  # none free: it does not wait
        got, done = threading.Event(), threading.Event()

        def take_both() -> None:
            with cores.held(2):
                got.set()
                done.wait(WAIT)

        waiting = threading.Thread(target=take_both)
        waiting.start()  # wants both: queued behind this grant's core
        time.sleep(0.05)
        assert grant.resize(2) == 1 and cores.free == 1  # the free core is for the one waiting
        grant.resize(0)
        assert got.wait(WAIT) and cores.free == 0
        done.set()
        waiting.join(WAIT)
    assert cores.free == 2


def test_the_frame_loop_takes_every_core_only_where_its_bits_do_not_depend_on_the_thread_count():
    float32 = torch.nn.Sequential(torch.nn.Linear(4, 4))
    budget = ThreadBudget.split(cores=2)
    assert (budget.loop, budget.loop_most) == (1, 2)
    fixed = fixed_where_bits_vary(budget, float32)
    assert fixed.loop_most == fixed.prefill_most == 1  # torch's float32 products split sums by thread count
    assert fixed_where_bits_vary(budget, float32.to(torch.bfloat16)) == budget


def test_two_cores_a_prompt_prefills_on_both_where_the_steps_keep_to_one_thread(monkeypatch):
    """bfloat16 layers, cores=2, threads=1: the prompt (no row decoding) prefills at 2 threads, every frame step at
    1; a seeded request's frames are a one-core engine's."""
    tts = tiny_qwen3_tts(seed=1)
    tts.model.talker.to(torch.bfloat16)
    threads, frames = {"prefill": set(), "step": set()}, {}
    for part, name in (("prefill_piece", "prefill"), ("frame_step", "step")):
        monkeypatch.setattr(Scheduler, part, counted_threads(getattr(Scheduler, part), threads[name]))
    assert ThreadBudget.split(cores=2, threads=1).prefill_most == 2
    for cores in (2, 1):
        with Engine(tts, drafter=None, cores=cores, threads=1, chunk_frames=4, first_chunk_frames=1) as engine:
            request = engine.submit("custom_voice", text="two cores here", max_new_tokens=8, seed=3, **QWEN)
            assert len(request.audio())  # its stream starts with its first frame: the prefill has both cores
            frames[cores] = request.codes
        if cores == 2:
            assert threads == {"prefill": {2}, "step": {1}}
    assert torch.equal(frames[2], frames[1])


def counted_threads(method, seen: set):
    """`method`, noting into `seen` the intra-op threads of the thread it runs in."""
    def counted(self, *args):
        seen.add(torch.get_num_threads())
        return method(self, *args)
    return counted


def decoded_ahead(pieces: int | None, frames: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A feed with chunks of 3 then 12 frames (`pieces` ahead, as `CodecWorker` decodes them): its decodes (frames
    so far, frames decoded up to then) as `frames` frames come one by one and the request ends, and its deliveries'
    [first, last] frame."""
    request = SimpleNamespace(decoded=[], done=False)
    feed, calls, chunks = Feed(request, pieces), [], []
    feed.stream, feed.clock = object(), ChunkClock(3, 12)
    for frame in range(frames + 1):
        if frame == frames:
            request.done = True
        else:
            request.decoded.append(frame)
        if not feed.has_work():
            continue
        end = feed.due()
        calls.append((len(request.decoded), end))
        pieces_audio = [np.arange(feed.sent, end)]
        feed.sent = end
        chunk = feed.take_audio(pieces_audio, request.done)
        if chunk is not None:
            chunks.append((int(chunk[0]), int(chunk[-1])))
    return calls, chunks


def test_frames_are_decoded_ahead_of_their_chunk_boundary_and_delivered_at_it():
    """With pieces: the first chunk's frames decode one by one, then AHEAD_FRAMES at a time; the audio is delivered
    at the same boundaries (3, 15, 27 and the end) as without, so that at a boundary and at the end only the last
    piece is left to decode."""
    calls, chunks = decoded_ahead(None, 30)
    assert calls == [(3, 3), (15, 15), (27, 27), (30, 30)]
    assert chunks == [(0, 2), (3, 14), (15, 26), (27, 29)]
    calls, ahead_chunks = decoded_ahead(AHEAD_FRAMES, 30)
    assert ahead_chunks == chunks
    assert calls[:3] == [(1, 1), (2, 2), (3, 3)] and calls[-1] == (30, 30)
    assert all(end - start == AHEAD_FRAMES for (_, start), (_, end) in zip(calls[2:-1], calls[3:-1]))
    assert calls[-2][1] >= 30 - AHEAD_FRAMES  # what the end leaves: less than a piece


def test_frames_are_decoded_ahead_only_while_one_stream_is_attached():
    """Pieces cost the decoder more per frame: a lone stream's spare core pays, a batch's codec does not."""
    model = SimpleNamespace(decodes_ahead=True, codec_batches=False)
    worker = CodecWorker(model, Cores(2), ThreadBudget.split(cores=2), ahead=True)
    try:
        requests = [SimpleNamespace(cancelled=threading.Event(), decoded=[], done=False,
                                    prompt=SimpleNamespace(prefix=None)) for _ in range(2)]
        worker.attach(requests[0])
        assert [feed.pieces for feed in worker.feeds] == [AHEAD_FRAMES]
        worker.attach(requests[1])
        assert [feed.pieces for feed in worker.feeds] == [None, None]
        requests[1].cancelled.set()
        worker.wake()
        deadline = time.monotonic() + WAIT
        while len(worker.feeds) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [feed.pieces for feed in worker.feeds] == [AHEAD_FRAMES]
    finally:
        worker.close()
    one_core = CodecWorker(model, Cores(1), ThreadBudget.split(cores=1), ahead=True)
    one_core.close()
    assert one_core.pieces is None  # no core beside the loop's steps


def test_a_decode_holds_one_core_and_runs_on_one_thread_while_the_frame_loop_is_idle_too():
    """A decode holds one core and its worker one intra-op thread, also at a stream's end where the frame loop has
    left both cores: the codec's float sums split by thread count, so the audio would depend on the schedule."""
    cores, seen = Cores(2), []

    def add_together(streams, frames):
        seen.append((torch.get_num_threads(), cores.free))
        return [np.zeros(len(f), dtype=np.float32) for f in frames]

    stream = SimpleNamespace(lag=0, finish=lambda: np.zeros(0, dtype=np.float32))
    model = SimpleNamespace(decodes_ahead=False, codec_batches=False, add_together=add_together,
                            new_stream=lambda prompt: stream)
    worker, audio = CodecWorker(model, cores, ThreadBudget.split(cores=2)), []
    try:
        request = SimpleNamespace(decoded=[torch.zeros(16)] * 3, done=True, cancelled=threading.Event(), chunks=(1, 4),
                                  prompt=SimpleNamespace(prefix=None), deliver=audio.append, deliver_end=lambda: None)
        worker.attach(request)
        worker.wake()
        deadline = time.monotonic() + 30
        while len(audio) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.close()
    assert seen and all(entry == (1, 1) for entry in seen) and cores.free == 2 and len(audio) >= 1


def test_the_frame_loop_leaves_a_core_while_a_chunk_waits_or_decodes():
    """`Scheduler.step_threads` (asked as a step starts and before its talker forward): the loop's share while the
    codec has a chunk due or decoding, every core otherwise (a prompt alone: prefill_most)."""
    budget = ThreadBudget.split(cores=2)
    for decoding, rows, expected in ((True, [1], 1), (False, [1], 2), (False, [], 2), (True, [], 1)):
        loop = SimpleNamespace(codec=SimpleNamespace(decoding=lambda decoding=decoding: decoding), budget=budget,
                               rows=rows, parked=[])
        assert Scheduler.step_threads(loop) == expected


def test_a_stream_starts_with_its_first_frame_unless_it_decodes_a_prefix_beside_the_prefill():
    request = SimpleNamespace(decoded=[], done=False, prompt=SimpleNamespace(prefix=None))
    feed = Feed(request)
    assert not feed.has_work()  # its prompt prefills: no core taken from it
    request.decoded.append(torch.zeros(16))
    assert feed.has_work()
    request.decoded.clear()
    request.prompt.prefix = torch.zeros(4, 16)  # a clone's reference: decoded beside the prefill
    assert feed.has_work()


def test_two_cores_decode_ahead_and_deliver_the_audio_of_one_core(tts64):
    """decode_ahead, cores=2 (frames decoded ahead: the codec has a core of its own) against cores=1 (at the chunks'
    boundaries): the same codes and the same audio to float rounding (the chunks' lengths depend on timing where a
    worker falls behind: `decoded_ahead` checks them)."""
    runs = {}
    for cores in (2, 1):
        with Engine(tts64, drafter=None, cores=cores, chunk_frames=4, first_chunk_frames=3,
                    decode_ahead=True) as engine:
            assert (engine.codec.pieces is not None) == (cores == 2)
            request = engine.submit("custom_voice", text="ahead of time", max_new_tokens=14, **QWEN, **GREEDY)
            runs[cores] = list(request), request.codes
    assert torch.equal(runs[2][1], runs[1][1])
    np.testing.assert_allclose(np.concatenate(runs[2][0]), np.concatenate(runs[1][0]), atol=1e-6, rtol=0)


def counted_cores(monkeypatch, noted) -> tuple[list[int], set]:
    """`Cores.held` counting: ([the most cores held at once, resized grants' counts included], {(thread name,
    noted(cores it got))})."""
    live, peak, lock, counts = set(), [0], threading.Lock(), set()
    original, resize = Cores.held, Grant.resize

    def note_peak() -> None:
        with lock:
            peak[0] = max(peak[0], sum(grant.count for grant in live))

    @contextlib.contextmanager
    def counted(self, least, most=None):
        with original(self, least, most) as grant:
            with lock:
                live.add(grant)
                counts.add((threading.current_thread().name.rstrip("0123456789-"), noted(grant.count)))
            note_peak()
            try:
                yield grant
            finally:
                with lock:
                    live.discard(grant)

    def resized(self, most):
        count = resize(self, most)
        note_peak()
        return count

    monkeypatch.setattr(Cores, "held", counted)
    monkeypatch.setattr(Grant, "resize", resized)
    return peak, counts


def test_an_engine_on_several_cores_shortens_the_gil_switch_interval(monkeypatch):
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    set_to = []
    monkeypatch.setattr(sys, "setswitchinterval", set_to.append)
    quick_gil_handoff(ThreadBudget.split(cores=1))
    assert set_to == []  # one core: nothing runs side by side
    quick_gil_handoff(ThreadBudget.split(cores=2))
    assert set_to == [GIL_SWITCH_SECONDS] and GIL_SWITCH_SECONDS < 0.005


def test_two_cores_the_frame_loop_steps_on_both_while_no_chunk_waits(monkeypatch):
    """bfloat16 layers, cores=2: the frame loop steps on 2 threads while no chunk waits for the codec, on 1 while one
    does or is decoding (never more than 2 threads together); a seeded request's frames are a one-core engine's."""
    tts = tiny_qwen3_tts(seed=1)
    tts.model.talker.to(torch.bfloat16)
    peak, counts = counted_cores(monkeypatch, lambda count: count)
    frames = {}
    for cores in (2, 1):
        with Engine(tts, drafter=None, cores=cores, chunk_frames=4, first_chunk_frames=1) as engine:
            request = engine.submit("custom_voice", text="two cores here", max_new_tokens=14, seed=3, **QWEN)
            assert len(request.audio())
            frames[cores] = torch.stack(request.decoded)
    assert peak[0] <= 2
    assert {("rvqspec-engine", 2), ("rvqspec-codec", 1)} <= counts
    assert torch.equal(frames[2], frames[1])


def test_no_more_threads_do_torch_work_than_the_engines_cores(tts64, monkeypatch):
    """8 requests streamed from 8 caller threads with cores=2: the frame loop and the codec workers never hold more
    than 2 cores together, each works with its budget's intra-op threads, and the model's audio is made only in the
    codec workers (callers only receive it)."""
    peak, counts = counted_cores(monkeypatch, lambda count: torch.get_num_threads())
    makers = set()
    with Engine(tts64, drafter=None, cores=2, chunk_frames=2, first_chunk_frames=1) as engine:
        add_together = engine.model.add_together

        def recording(streams, frames):
            makers.add(threading.current_thread().name)
            return add_together(streams, frames)

        monkeypatch.setattr(engine.model, "add_together", recording)
        audio = [None] * 8
        arguments = [dict(text=f"line {i} here", max_new_tokens=6 + i, **QWEN, **GREEDY) for i in range(8)]

        def caller(i: int) -> None:
            audio[i] = engine.submit("custom_voice", **arguments[i]).audio()

        callers = [threading.Thread(target=caller, args=(i,), name=f"caller-{i}") for i in range(8)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(WAIT)
        assert engine.status()["cores"] == 2
    assert all(a is not None and len(a) for a in audio)
    assert 1 <= peak[0] <= 2
    assert counts == {("rvqspec-engine", 1), ("rvqspec-codec", 1)}
    assert makers and all(name.startswith("rvqspec-codec-") for name in makers)


# ---------------------------------------------------------------- audio off the callers' threads

def test_a_requests_audio_does_not_depend_on_what_else_decodes(tts64, monkeypatch):
    """Greedy requests' audio alone, then with the first already streaming when the others join, one of them
    cancelled mid-stream: each finished request's audio equals its lone audio (float rounding of the codec aside);
    the cancelled one's chunks are a prefix of its lone audio. One codec worker, whose first call after the others
    are submitted waits until they have frames decoded, so that the next call gathers several requests' chunks
    (`add_together`; a shared forward of rows with equal chunks: tests/test_streaming_batch.py); alone, never."""
    arguments = [dict(text=text, max_new_tokens=n, **QWEN, **GREEDY)
                 for text, n in (("hello there", 14), ("a second line", 9), ("yes", 4), ("one more", 12))]
    gathered, others = [], []
    with Engine(tts64, drafter=None, chunk_frames=2, first_chunk_frames=1, codec_threads=1) as engine:
        add_together, held = engine.model.add_together, threading.Event()

        def gathering(streams, frames):
            if others and not held.is_set():  # the others' frames come from the frame loop meanwhile
                deadline = time.monotonic() + WAIT
                while not all(r.done or len(r.decoded) >= 3 for r in others) and time.monotonic() < deadline:
                    time.sleep(0.01)
                held.set()
            gathered.append(len(streams))
            return add_together(streams, frames)

        monkeypatch.setattr(engine.model, "add_together", gathering)
        alone = [engine.submit("custom_voice", **a).audio() for a in arguments]
        assert set(gathered) == {1}
        streams = [iter(engine.submit("custom_voice", **arguments[0]))]
        heads = [[next(streams[0])]]
        others += [engine.submit("custom_voice", **a) for a in arguments[1:]]
        streams += [iter(request) for request in others]
        heads += [[next(stream)] for stream in streams[1:]]  # each streaming (its codec attached) beside the others
        others[-1].cancel()
        cut = heads.pop() + list(streams.pop())
        together = [np.concatenate(head + list(stream)) for head, stream in zip(heads, streams)]
    for mine, theirs in zip(together, alone):
        assert mine.shape == theirs.shape
        np.testing.assert_allclose(mine, theirs, atol=1e-6, rtol=0)
    cut = np.concatenate(cut)
    assert 0 < len(cut) <= len(alone[-1])
    np.testing.assert_allclose(cut, alone[-1][:len(cut)], atol=1e-6, rtol=0)
    assert max(gathered) >= 2  # chunks of several requests in one call


def test_a_codec_that_cannot_batch_ends_that_calls_requests_and_decodes_one_by_one_after(tts64, monkeypatch):
    """Upstream's attention cache not as the batched codec needs it (another transformers than qwen-tts pins): the
    requests of that call end with an error that names the fix, and the next ones decode one by one. Only this
    model's codec calls count (and fail): an engine that another test left to its finalizer may still be decoding in
    this process, on a machine under load, through the same module function."""
    decoder, together, calls = tts64.model.speech_tokenizer.model.decoder, qwen_tts_runtime.decode_together, []

    def unsupported(codecs, chunks):
        if any(codec.decoder is not decoder for codec in codecs):
            return together(codecs, chunks)
        calls.append(len(codecs))
        raise CodecBatchUnsupported("upstream's cache gave other lengths: install transformers==4.57.3")

    monkeypatch.setattr(qwen_tts_runtime, "decode_together", unsupported)
    request = dict(text="hello there", max_new_tokens=4, **QWEN, **GREEDY)
    with Engine(tts64, drafter=None) as engine:
        with pytest.raises(RvqspecError, match="transformers==4.57.3"):
            engine.submit("custom_voice", **request).audio()
        assert engine.model.codec_batches is False and calls == [1]
        assert len(engine.submit("custom_voice", **request).audio()) > 0 and calls == [1]


def test_an_error_its_audio_met_before_its_decoding_ended_is_the_one_the_request_ends_with():
    """The codec worker's error (`deliver_error`) before the scheduler ends the request for its length: the request
    ends with that error, raised to its caller, not well and silent (the race the test above met at random)."""
    class Codec:
        def wake(self):
            pass

        def attach(self, request):
            pass

    request, error = Request(None, Codec(), 24000, (3, 12), torch.Generator()), RvqspecError("the codec failed")
    request.deliver_error(error)
    request.finish(reason="length")
    assert request.error is error and request.end_reason == "error"
    with pytest.raises(RvqspecError, match="the codec failed"):
        request.audio()


def test_an_error_outside_the_codec_call_ends_that_request_and_the_worker_goes_on(tts64, monkeypatch):
    """A failure the codec call's own guard does not cover (here: the chunk clock) ends the audio of that call's
    request with an error; the one codec worker lives on and decodes the next request."""
    due, calls = Feed.due, []

    def failing_once(feed):
        calls.append(feed)
        if len(calls) == 1:
            raise RuntimeError("the chunk clock broke")
        return due(feed)

    monkeypatch.setattr(Feed, "due", failing_once)
    request = dict(text="hello there", max_new_tokens=4, **QWEN, **GREEDY)
    with Engine(tts64, drafter=None, codec_threads=1) as engine:
        with pytest.raises(RvqspecError, match="the chunk clock broke"):  # bounded: a dead worker's requests hang
            bounded(engine.submit("custom_voice", **request).audio)
        assert len(bounded(engine.submit("custom_voice", **request).audio)) > 0


def test_a_codec_worker_takes_an_equal_share_per_decode_that_can_run_now():
    """Where the codec batches, one worker does not take on one core what free cores could decode side by side."""
    def share(ready: int, idle: int, free: int, batches: bool = True) -> int:
        model, cores = SimpleNamespace(codec_batches=batches), SimpleNamespace(free=free)
        worker = SimpleNamespace(model=model, idle=idle, cores=cores)
        return CodecWorker.share(worker, ready)

    assert share(8, idle=0, free=1) == 8  # alone: everything in one call
    assert share(8, idle=3, free=1) == 8  # one free core (the frame loop holds the rest): one call
    assert share(8, idle=3, free=4) == 2 and share(7, idle=1, free=4) == 4
    assert share(8, idle=3, free=0) == 8  # no core free now: this call waits for one anyway
    assert share(8, idle=3, free=4, batches=False) == 1


# ---------------------------------------------------------------- admission

def test_capacity_predicts_unmeasured_batch_sizes_and_protects_real_time():
    capacity = Capacity(frame_seconds=0.08, max_batch=8)
    assert capacity.admits(0) and capacity.admits(1)  # nothing measured yet
    for _ in range(3):
        capacity.record(1, 0.03)
    assert capacity.period(2) == pytest.approx(0.06)  # one size measured: in proportion to the rows
    assert capacity.period(3) == pytest.approx(0.09)
    assert capacity.admits(1) and not capacity.admits(2)  # 3 rows would run below real time
    capacity.record(2, 0.035)
    assert capacity.period(3) == pytest.approx(0.04)  # a line through the measured sizes
    assert capacity.admits(2) and capacity.report(2)["realtime_rows"] == 8
    slow = Capacity(frame_seconds=0.08, max_batch=8)
    slow.record(1, 0.2)  # slower than real time alone: nothing to protect, the batch fills for throughput
    assert slow.admits(1) and slow.report(1) == {"frames_per_second": 5.0, "realtime_rows": 0}
    assert Capacity(0.08, 8, realtime=False).admits(5)
    capacity.record(1, 10.0)  # one slow step (a first call's one-off work) does not move the median
    assert capacity.period(1) == pytest.approx(0.03)


def test_capacity_scales_one_measured_size_as_the_policy_predicts_and_stops_at_a_wrong_prior():
    """One stream at 50 ms of an 80 ms frame: in proportion a second would make 100 ms and wait for the first to
    end; the policy's measured scaling (a 2-row step 1.25x a 1-row one) predicts 62.5 ms, so it joins. If the
    2-row batch then measures slower than real time, no third joins (the CPU runs one stream at real time)."""
    proportional, scaled = Capacity(0.08, 8), Capacity(0.08, 8, scaling=lambda batch: 1 + 0.25 * (batch - 1))
    for capacity in (proportional, scaled):
        for _ in range(3):
            capacity.record(1, 0.05)
    assert proportional.period(2) == pytest.approx(0.10) and not proportional.admits(1)
    assert scaled.period(2) == pytest.approx(0.0625) and scaled.admits(1)
    assert scaled.report(1)["realtime_rows"] == 3  # 3 rows: 0.075 s predicted, 4: 0.0875 s
    for _ in range(3):
        scaled.record(2, 0.09)
    assert not scaled.admits(2)  # measured: 2 rows already miss real time; a line through the sizes says 3 would too


def test_the_engine_scales_capacity_by_its_decoding_policy(tts64):
    """The Engine hands the capacity its policy's predicted frame times per batch size (no policy, AR: none)."""
    with Engine(tts64, drafter=None) as ar, Engine(tts64) as speculative:
        assert ar.capacity.scaling is None
        policy = speculative.policy
        assert speculative.capacity.scaling(4) == pytest.approx(policy.frame_ms(4, policy.choose(4)))


def test_a_request_waits_while_admitting_it_would_slow_the_running_stream(tts64, monkeypatch):
    """Under a capacity of one row, a second request waits in the queue while the first decodes, and starts once
    it leaves; status() reports the rows' real-time factors and the capacity."""
    with Engine(tts64, drafter=None) as engine:
        monkeypatch.setattr(engine.capacity, "admits", lambda batch: batch == 0)
        prompt = engine.model.prompts("custom_voice", dict(text="hello there", **QWEN, **GREEDY))[0]
        running = engine.enqueue(never_ending(prompt), None)
        frames_of(running, 3)
        waiting = engine.submit("custom_voice", text="yes", max_new_tokens=4, **QWEN, **GREEDY)
        time.sleep(0.2)
        status = engine.status()
        assert (status["active"], status["queued"]) == (1, 1) and not waiting.decoded
        assert len(status["real_time_factors"]) == 1 and status["real_time_factors"][0] > 0
        assert status["frames_per_second"] > 0
        running.cancel()
        assert len(waiting.wait(WAIT)) == 3


def test_the_standins_vocoded_audio_does_not_depend_on_what_else_decodes():
    """The stand-in's HiFi-GAN chunks (made in the codec workers, with context frames) for a request streamed alone
    and beside two others that join it, one cancelled: the same audio to the streaming tolerance (1e-4,
    tests/test_standin_streaming.py)."""
    texts = [("hello there, a sentence", "en"), ("¿Qué tal?", "es"), ("Guten Tag", "de")]
    arguments = [dict(text=text, language=lang, max_new_tokens=12, **GREEDY) for text, lang in texts]
    with Engine(tiny_standin(seed=3), drafter=None, chunk_frames=2, first_chunk_frames=1) as engine:
        alone = [engine.submit("speech", **a).audio() for a in arguments[:2]]
        first = engine.submit("speech", **arguments[0])
        chunks = iter(first)
        head = [next(chunks)]
        second, third = (engine.submit("speech", **a) for a in arguments[1:])
        next(iter(third))
        third.cancel()
        together = [np.concatenate(head + list(chunks)), second.audio()]
    for mine, theirs in zip(together, alone):
        assert mine.shape == theirs.shape and theirs.std() > 0
        np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=0)
