"""Chunked prefill (issue 40, item 3): a prompt prefilled in pieces gives the talker states of one prefill (float64, to
rounding: a piece's matmuls have other row counts and its attention other widths) and, through the engine, the very
greedy codes; rows leaving, cancelled or failing while another request is half-prefilled, and a close then, leave
every other request as it is alone."""

import threading
import time
from dataclasses import replace

import pytest
import torch

from rvqspec import RvqspecError
from rvqspec.core import talker as talker_blocks
from rvqspec.core.talker import Talker, TalkerConfig
from rvqspec.runtime import Engine

from helpers.engines import GREEDY, frames_of, never_ending
from helpers.standin import tiny_standin

WAIT = 120  # seconds: a bound on any wait
# realtime=False: these tests need prefills to start while rows decode, whatever admission at real time would decide
# on a loaded machine (admission: tests/test_concurrency.py)
LONG = "a sentence long enough to take many pieces, one token a gap"  # the stand-in's prompt: its UTF-8 bytes


@pytest.mark.parametrize("pieces", [[150], [1, 63, 1, 85], [64, 64, 22], [7] * 21 + [3]], ids=str)
def test_a_prompt_prefilled_in_pieces_has_the_states_of_one_prefill(pieces):
    """150 tokens (crossing SLOT_MULTIPLE twice) in pieces: the piece's last state, the row's K/V entries and the
    states of steps after it are those of one prefill, to 1e-12 in float64 (rounding: other matmul row counts and
    attention widths; not the same bits)."""
    torch.manual_seed(0)
    talker = Talker(TalkerConfig(64, 128, 2, 4, 2, 16, 50)).double().eval()
    embeds, inputs = torch.randn(sum(pieces), 64, dtype=torch.float64), torch.randn(3, 1, 64, dtype=torch.float64)

    def run(sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        staging, cache, start = talker_blocks.RowCache(talker), talker_blocks.RowCache(talker), 0
        row = staging.add()
        for size in sizes:
            state = talker_blocks.prefill(talker, staging, row, embeds[start:start + size],
                                          torch.arange(start, start + size))
            start += size
        cache.adopt(staging, row)
        states = [state] + [talker_blocks.step(talker, cache, x, torch.tensor([start + s]))[0]
                            for s, x in enumerate(inputs)]
        return torch.stack(states), cache.kv.kv[:, :, 0, :, :cache.lengths[0]]

    with torch.inference_mode():
        whole, chunked = run([sum(pieces)]), run(pieces)
    for mine, theirs in zip(chunked, whole):
        torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=0)


@pytest.fixture(scope="module")
def standin():
    return tiny_standin(seed=3)


def prompt_of(engine, text: str, **settings):
    return engine.model.prompts("speech", dict(text=text, language="en", **GREEDY, **settings))[0]


class Pieces:
    """Records, for each prefill piece the scheduler runs, (the request being prefilled, tokens done before it, the
    requests of the rows decoding then)."""

    def __init__(self, engine, monkeypatch):
        self.seen, scheduler = [], engine.scheduler
        piece = scheduler.prefill_piece

        def recording(tokens):
            if scheduler.prefilling is not None:
                self.seen.append((scheduler.prefilling.request, scheduler.prefilling.done,
                                  [row.request for row in scheduler.rows]))
            piece(tokens)

        monkeypatch.setattr(scheduler, "prefill_piece", recording)

    def of(self, request) -> list[tuple[int, list]]:
        return [(done, rows) for prefilling, done, rows in self.seen if prefilling is request]


def prefilling(engine, request) -> None:
    """Wait until `request`'s prompt is half-prefilled."""
    deadline = time.monotonic() + WAIT
    while not (engine.scheduler.prefilling and engine.scheduler.prefilling.request is request
               and engine.scheduler.prefilling.done > 0):
        assert time.monotonic() < deadline
        time.sleep(0.001)


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_gives_the_greedy_codes_of_whole_prefills_while_rows_leave_and_cancel(standin, chunk,
                                                                                              monkeypatch):
    """A long prompt prefilled `chunk` tokens a gap beside three rows: one leaves (its length limit) and one is
    cancelled while it is half-prefilled, one stays. Every request's codes are those of whole prefills, alone (the
    cancelled one's: the frames it had)."""
    with Engine(standin, drafter=None, prefill_chunk=None) as engine:
        short = prompt_of(engine, "hello there", max_new_tokens=30)
        long = prompt_of(engine, LONG * 3, max_new_tokens=12)
        staying, cancelled = (prompt_of(engine, text, max_new_tokens=300) for text in ("stay", "go"))
        alone = [engine.enqueue(prompt, 0).wait(WAIT) for prompt in (short, long, staying, cancelled)]
    with Engine(standin, drafter=None, realtime=False, prefill_chunk=chunk) as engine:
        pieces = Pieces(engine, monkeypatch)
        requests = [engine.enqueue(prompt, 0) for prompt in (short, staying, cancelled)]
        frames_of(requests[2], 1)  # all three decode (the last two joined one piece a gap)
        late = engine.enqueue(long, 0)
        prefilling(engine, late)
        requests[2].cancel()
        codes = [request.wait(WAIT) for request in (requests[0], late, requests[1])]
        cut = requests[2].wait(WAIT)
    assert torch.equal(codes[0], alone[0]) and torch.equal(codes[1], alone[1]) and torch.equal(codes[2], alone[2])
    assert torch.equal(cut, alone[3][:len(cut)])
    seen = pieces.of(late)
    # a piece a gap while rows decode (the rest whole once none does)
    assert [done for done, _ in seen] == list(range(0, chunk * len(seen), chunk)) and len(seen) > 10
    assert all(rows for _, rows in seen[:-1])
    for request in (requests[0], requests[2]):  # it left (its limit; cancelled) while `late` was half-prefilled
        assert request in seen[0][1] and request not in seen[-1][1]


def test_a_prompt_failing_mid_prefill_fails_alone(standin, monkeypatch):
    """With a row decoding, a prompt whose last embedding is nan, and one whose last position is past the RoPE
    table, fail after pieces of them ran (on their last) with their own error; the staging row they leave (nan:
    zeroed) serves the next prompt, whose codes and the running row's are theirs alone."""
    with Engine(standin, drafter=None, prefill_chunk=None) as engine:
        good, other = prompt_of(engine, LONG, max_new_tokens=10), prompt_of(engine, "hello there", max_new_tokens=40)
        alone = [engine.enqueue(prompt, 0).wait(WAIT) for prompt in (good, other)]
    nan = good.embeds.clone()
    nan[-1] = float("nan")
    far = good.positions.clone()
    far[-1] = 10 ** 6
    with Engine(standin, drafter=None, realtime=False, prefill_chunk=4) as engine:
        pieces = Pieces(engine, monkeypatch)
        running = engine.enqueue(other, 0)
        frames_of(running, 1)
        broken = [engine.enqueue(replace(good, embeds=nan), 0), engine.enqueue(replace(good, positions=far), 0)]
        after = engine.enqueue(good, 0)
        for request, match in zip(broken, ["not finite", "RoPE position"]):
            with pytest.raises(RvqspecError, match=match):
                request.wait(WAIT)
            assert [done for done, _ in pieces.of(request)][:2] == [0, 4]  # it failed after pieces of it ran
        assert torch.equal(after.wait(WAIT), alone[0]) and torch.equal(running.wait(WAIT), alone[1])
        assert engine.status() == engine.status() | {"active": 0, "queued": 0}


def test_close_during_a_prefill_ends_the_half_prefilled_request_with_an_error(standin):
    engine = Engine(standin, drafter=None, realtime=False, prefill_chunk=1)
    running = engine.enqueue(never_ending(prompt_of(engine, "hello there")), 0)
    frames_of(running, 1)
    late = engine.enqueue(prompt_of(engine, LONG), 0)
    prefilling(engine, late)
    engine.close(grace=0)
    assert engine.scheduler.thread not in threading.enumerate()
    for request in (running, late):
        with pytest.raises(RvqspecError, match="engine was closed"):
            request.wait(WAIT)
    assert engine.scheduler.prefilling is None and not late.decoded


@pytest.mark.parametrize("chunk", [0, -3, 1.5, True, "64"])
def test_a_bad_prefill_chunk_is_refused_in_words(standin, chunk):
    with pytest.raises(RvqspecError, match="prefill_chunk must be a whole number >= 1.*or None"):
        Engine(standin, drafter=None, prefill_chunk=chunk)
