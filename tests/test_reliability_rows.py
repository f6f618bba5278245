"""One request never fails another (issue 41, case 3): in a batch of four greedy requests on a tiny stand-in, a row
whose talker state turns non-finite mid-utterance, a prompt that is non-finite from the start, and a row whose
predictor batch raises each fail alone, with their own error, while the others decode the very codes they decode
alone (also the request that later reuses the failed row's cache row). And the Python API's edges: seeds out of a
generator's range, leaving a request's iteration early, a close that cuts requests short."""

from dataclasses import replace

import pytest
import torch

from rvqspec import RvqspecError
from rvqspec.runtime import Engine

from helpers.engines import GREEDY
from helpers.standin import tiny_standin

WAIT = 120  # seconds: a bound on any wait
TEXTS = [("Guten Tag, wie geht's?", "de"), ("hello there, how are you", "en"), ("¿Qué tal, amigo mío?", "es"),
         ("one more sentence here", "en"), ("Привет, друг.", "ru")]


@pytest.fixture(scope="module")
def engine():
    with Engine(tiny_standin(seed=3), drafter=None, max_batch=4, realtime=False) as engine:  # one batch of 4
        yield engine


def prompts(engine) -> list:
    return [engine.model.prompts("speech", dict(text=text, language=lang, max_new_tokens=24, **GREEDY))[0]
            for text, lang in TEXTS]


def together(engine, batch: list) -> list:
    """Submit `batch` while holding the scheduler's lock, so that they are admitted into one batch."""
    with engine.scheduler.condition:  # a re-entrant lock: enqueue takes it again in this thread
        return [engine.enqueue(prompt, 0) for prompt in batch]


def test_a_row_whose_state_turns_non_finite_fails_alone(engine):
    good = prompts(engine)
    alone = [engine.enqueue(prompt, 0).wait(WAIT) for prompt in good]
    hidden = good[0].embeds.shape[-1]
    poison = torch.zeros(5, hidden, dtype=good[0].embeds.dtype)
    poison[3] = float("nan")  # added to the row's talker input at frame 3
    bad = replace(good[3], text=poison, pad=torch.zeros(hidden, dtype=poison.dtype))
    requests = together(engine, [good[0], good[1], good[2], bad])  # the bad row is the last: its cache row is reused
    with pytest.raises(RvqspecError, match="not finite"):
        requests[3].wait(WAIT)
    assert len(requests[3].decoded) == 4  # frames 0-3: the state after frame 3's input is the non-finite one
    later = engine.enqueue(good[4], 0)  # admitted into the failed row's cache row
    nan_prompt = engine.enqueue(replace(good[1], embeds=good[1].embeds * float("inf")), 0)
    with pytest.raises(RvqspecError, match="not finite"):
        nan_prompt.wait(WAIT)
    for index, request in enumerate([*requests[:3], later]):
        assert torch.equal(request.wait(WAIT), alone[[0, 1, 2, 4][index]]), index
    assert engine.status()["active"] == 0


def test_a_row_whose_state_is_finite_but_out_of_range_fails_alone(engine, monkeypatch):
    """A talker state past the predictor's range (|x| >= MAX_HIDDEN: its float32 norms would overflow), which
    decode_frames refuses, fails its own row at that frame step; the other row decodes its lone codes."""
    good = prompts(engine)[:2]
    alone = [engine.enqueue(prompt, 0).wait(WAIT) for prompt in good]
    scheduler, step = engine.scheduler, engine.scheduler.frame_step

    def huge_state_at_frame_3():
        for row in scheduler.rows:
            if row.request.prompt is good[1] and row.frames == 3:
                row.hidden = torch.full_like(row.hidden, 1e16)
        step()

    monkeypatch.setattr(scheduler, "frame_step", huge_state_at_frame_3)
    requests = together(engine, good)
    with pytest.raises(RvqspecError, match="out of range"):
        requests[1].wait(WAIT)
    assert len(requests[1].decoded) == 3 and torch.equal(requests[0].wait(WAIT), alone[0])


def test_a_row_whose_predictor_batch_raises_fails_alone(engine, monkeypatch):
    good = prompts(engine)[:4]
    alone = [engine.enqueue(prompt, 0).wait(WAIT) for prompt in good]
    scheduler, predict_group = engine.scheduler, engine.scheduler.predict_group

    def failing(hidden, c0, rows, sampler, members, codes):
        if any(rows[b].request.prompt is good[1] and rows[b].frames == 2 for b in members):
            raise RuntimeError("the predictor blew up")
        return predict_group(hidden, c0, rows, sampler, members, codes)

    monkeypatch.setattr(scheduler, "predict_group", failing)
    requests = together(engine, good)
    with pytest.raises(RvqspecError, match="blew up"):
        requests[1].wait(WAIT)
    for index in (0, 2, 3):
        assert torch.equal(requests[index].wait(WAIT), alone[index]), index


# ---------------------------------------------------------------- the Python API's edges (issue 41's smaller items)


@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 63, -1, 1.5, "7", True])
def test_a_seed_out_of_a_generators_range_is_refused_in_words(engine, seed):
    with pytest.raises(RvqspecError, match=r"seed must be an integer from 0 to 2\*\*63 - 1"):
        engine.speech("hello", voice="en", seed=seed)
    assert engine.status()["queued"] == 0


def long_request(engine):
    """A request of 1000 frames (EOS forbidden): seconds of decoding, unless cancelled."""
    prompt = engine.model.prompts("speech", dict(text="a long sentence", language="en", max_new_tokens=1000,
                                                 **GREEDY))[0]
    return engine.enqueue(replace(prompt, rules=replace(prompt.rules, min_new_tokens=10 ** 9)), 0)


def test_breaking_out_of_a_requests_audio_frees_its_row(engine):
    request = long_request(engine)
    for _ in request:
        break
    assert request.finished.wait(WAIT) and request.error is None
    assert request.cancelled.is_set() and len(request.decoded) < 1000
    assert engine.status()["active"] == 0


@pytest.mark.long
def test_close_without_grace_hands_the_consumer_an_error_not_cut_audio():
    engine = Engine(tiny_standin(seed=3), drafter=None)
    request = long_request(engine)
    chunks = iter(request)
    next(chunks)
    engine.close(grace=0)
    with pytest.raises(RvqspecError, match="cut short"):
        list(chunks)
