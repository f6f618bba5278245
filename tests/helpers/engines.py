"""Helpers for the tests of `rvqspec.Engine` (tests/test_runtime*.py): upstream's codes as its decoder sees them,
Hugging Face's own c0 logits processing, exact distributions of a request's first codes, a G-test, and a bounded
wait (`bounded`: a hang fails, with every thread's stack)."""

import contextlib
import itertools
import sys
import threading
import time
import traceback
from dataclasses import replace

import pytest
import torch

from rvqspec.core.sampling import Sampler
from rvqspec.integrations.qwen_tts import predictor_from_upstream
from rvqspec.tuning.qwen_tts_corpus import teacher_forced_hidden

from helpers.upstream_models import upstream_generate  # noqa: I001
from test_distribution import g_test as distribution_g_test

GREEDY = dict(do_sample=False, subtalker_dosample=False)  # qwen-tts's names
KINDS = {"custom_voice": "custom_voice", "voice_design": "voice_design", "base": "voice_clone"}  # model type: kind


@contextlib.contextmanager
def decoded_codes(tts):
    """A list that receives, per call of the speech tokenizer's decode, the codes [T, 16] of each row: what
    upstream's generate_* (and the engine's `generate_*`) turn into audio."""
    calls, decode = [], tts.model.speech_tokenizer.decode

    def recording(items, *args, **kwargs):
        calls.append([item["audio_codes"].clone().cpu() for item in items])
        return decode(items, *args, **kwargs)

    tts.model.speech_tokenizer.decode = recording
    try:
        yield calls
    finally:
        del tts.model.speech_tokenizer.decode


@contextlib.contextmanager
def upstream_states(tts):
    """A list that receives, per call of upstream's model.generate, the talker state [T, H] that conditioned each
    frame of each row (what it returns beside the codes; its generate_* drop them)."""
    calls, generate = [], tts.model.generate

    def recording(*args, **kwargs):
        codes, states = generate(*args, **kwargs)
        calls.append([state.clone() for state in states])
        return codes, states

    tts.model.generate = recording
    try:
        yield calls
    finally:
        del tts.model.generate


def engine_states(engine, monkeypatch) -> dict:
    """{request: [the talker state that conditioned each of its frames]} of the engine's decoding from now on."""
    states, predict = {}, engine.scheduler.predict

    def recording(hidden, c0, rows):
        for row, state in zip(rows, hidden):
            states.setdefault(row.request, []).append(state.clone())
        return predict(hidden, c0, rows)

    monkeypatch.setattr(engine.scheduler, "predict", recording)
    return states


def frames_of(request, count: int, wait: float = 120) -> None:
    """Wait until `request` has decoded `count` frames (at most `wait` seconds: a bug fails rather than hangs)."""
    deadline = time.monotonic() + wait
    while len(request.decoded) < count:
        assert time.monotonic() < deadline, f"{count} frames not decoded within {wait} s"
        time.sleep(0.001)


def never_ending(prompt):
    """`prompt` with EOS forbidden and no length limit (a request that runs until cancelled)."""
    return replace(prompt, rules=replace(prompt.rules, min_new_tokens=10 ** 9), max_new_tokens=10 ** 9)


def hf_processors(talker, settings: dict):
    """The LogitsProcessorList Hugging Face's generate builds for the talker's c0 from upstream's talker.generate
    arguments `settings` (processors, then the sampling warpers when do_sample): the same calls as `generate`."""
    config, _ = talker._prepare_generation_config(None, **settings)
    talker._prepare_special_tokens(config, True, talker.device)
    # inputs_embeds only: generate's input_ids start empty, so min_new_tokens counts from length 0
    return talker._get_logits_processor(config, input_ids_seq_length=0, device=talker.device)


def talker_settings(captured: dict) -> dict:
    """The generation settings among the arguments upstream passes its talker.generate."""
    names = ("max_new_tokens", "min_new_tokens", "do_sample", "top_k", "top_p", "temperature", "eos_token_id",
             "repetition_penalty", "suppress_tokens")
    return {name: captured[name] for name in names if name in captured}


@torch.no_grad()
def c0_pair_probs(tts, prompt: dict, settings: dict) -> torch.Tensor:
    """Exact probability [V * V] of a request's first two c0 (c0_1 * V + c0_2, V the codebook size) when the
    predictor is greedy: for each c0_1, upstream's greedy predictor completes frame 0, upstream's talker (teacher
    forced, its own M-RoPE) gives the state that emits c0_2, and Hugging Face's processors (repetition penalty
    over [c0_1] included) and warpers give its distribution."""
    model, talker = tts.model, tts.model.talker
    vocab = talker.code_predictor.config.vocab_size
    processors = hf_processors(talker, settings)
    h0 = teacher_forced_hidden(talker, prompt, torch.zeros(1, 16, dtype=torch.long))[0]
    first = processors(torch.zeros(1, 0, dtype=torch.long), talker.codec_head(h0)[None].float()).softmax(-1)[0]
    assert float(first[vocab:].sum()) == 0  # specials suppressed, EOS not yet allowed
    c0 = torch.arange(vocab)
    rest = upstream_generate(model, h0.expand(vocab, -1), c0, Sampler(do_sample=False))
    probs = torch.zeros(vocab, vocab, dtype=torch.float64)
    for c in range(vocab):
        frames = torch.zeros(2, 16, dtype=torch.long)
        frames[0, 0], frames[0, 1:] = c, rest[c]
        h1 = teacher_forced_hidden(talker, prompt, frames)[1]
        second = processors(torch.tensor([[c]]), talker.codec_head(h1)[None].float()).softmax(-1)[0]
        assert float(second[vocab:].sum()) == 0
        probs[c] = first[c].double() * second[:vocab].double()
    return probs.reshape(-1)


def repeats(pairs: torch.Tensor, vocab: int) -> torch.Tensor:
    """[repeated, not] of joint (c0_1, c0_2) counts or probabilities [V * V]: where a repetition penalty acts,
    gathered in one cell (the joint spreads it over V diagonal cells of V * V, each too rare to weigh)."""
    same = pairs.reshape(vocab, vocab).diagonal().sum()
    return torch.stack([same, pairs.sum() - same])


@torch.no_grad()
def predictor_pair_probs(tts, hidden: torch.Tensor, c0: int, sampler) -> torch.Tensor:
    """Exact probability [V * V] of a frame's (c1, c2) (c1 * V + c2) given the talker state `hidden` and `c0`:
    the predictor's teacher-forced logits and `sampler`'s p~."""
    predictor = predictor_from_upstream(tts.model.talker)
    vocab = predictor.config.vocab_size
    pairs = torch.tensor(list(itertools.product(range(vocab), repeat=2)))
    codes = torch.zeros(len(pairs), predictor.config.num_code_groups, dtype=torch.long)
    codes[:, 0], codes[:, 1:3] = c0, pairs
    logits = predictor.teacher_forced_logits(hidden.to(predictor.dtype).expand(len(pairs), -1), codes)[:, :2]
    probs = sampler.probs(logits).double().gather(-1, pairs[..., None]).squeeze(-1).prod(-1)
    assert abs(float(probs.sum()) - 1) < 1e-6
    return probs


def g_test(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """test_distribution's G-test, where an outcome of probability zero that occurs fails at once (p 0) instead of
    asserting: the power tests feed it the counts of a wrong rule."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    return distribution_g_test(counts, probs)


def bounded(body, seconds: float = 20.0):
    """body() in a thread of its own, its result or error; fails with every thread's stack if it is still
    running after `seconds`."""
    outcome = {}

    def run() -> None:
        try:
            outcome["value"] = body()
        except BaseException as error:  # noqa: BLE001 - raised in the test below
            outcome["error"] = error

    thread = threading.Thread(target=run, name="bounded-test-body", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        frames = sys._current_frames()
        stacks = "\n".join(f"--- {t.name}\n{''.join(traceback.format_stack(frames[t.ident]))}"
                           for t in threading.enumerate() if t.ident in frames)
        pytest.fail(f"still running after {seconds} s (a deadlock):\n{stacks}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
