"""rvqspec.Engine (issue 32) against upstream, on tiny random models: greedy codes and audio of every qwen-tts entry
point (float32 and float64, AR and speculative, batched lists), the stand-in's codes against `synthesize_codes`, the
distribution of sampled codes against exact enumeration (G-tests, alone and in a batch, with the power to see a
wrong rule), `TalkerRules` against Hugging Face's own processors, and the talker's hidden states against upstream's
forward. Behaviour and batch independence: tests/test_runtime.py."""

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from rvqspec import ReusedHeads, Sampler, default_tree
from rvqspec.core import talker as talker_blocks
from rvqspec.integrations.qwen_tts import import_qwen_tts, talker_from_upstream
from rvqspec.runtime import Engine
from rvqspec.standin.synthesis import max_frames_for, synthesize_codes
from rvqspec.tuning.qwen_tts_corpus import talker_prompt, teacher_forced_hidden

from helpers.standin import tiny_standin
from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.engines import (GREEDY, KINDS, c0_pair_probs, decoded_codes, engine_states,  # noqa: E402
                             g_test, hf_processors, predictor_pair_probs, repeats, talker_settings, upstream_states)
from helpers.upstream_tts import tiny_qwen3_tts, tiny_tts_config_dict, write_wav  # noqa: E402

TEXTS = ["hello there", "a second line"]  # greedy, seed 1: the second stops on EOS long before max_new_tokens
MAX_NEW_TOKENS = 16
SPECULATIVE = dict(drafter=ReusedHeads(), tree=default_tree(8))
CALLS = {  # entry point: (model type, its arguments beside text and language)
    "custom_voice": ("custom_voice", dict(speaker="tiny")),
    "custom_voice_one_text": ("custom_voice", dict(speaker="tiny", text="hello there")),
    "custom_voice_instruct": ("custom_voice", dict(speaker=["tiny", "tiny"], instruct="calm")),
    "voice_design": ("voice_design", dict(instruct=["calm", "fast"])),
    "voice_clone_x_vector": ("base", dict(ref_audio="{ref}", x_vector_only_mode=True)),
    "voice_clone_in_context": ("base", dict(ref_audio="{ref}", ref_text="hello")),
}


@pytest.fixture(scope="module")
def reference_wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("clone") / "ref.wav"
    write_wav(path, 0.5, seed=3)
    return str(path)


@functools.cache
def tiny_tts(model_type: str, dtype: torch.dtype):
    tts = tiny_qwen3_tts(seed=1, model_type=model_type)
    return tts if dtype == torch.float32 else tts.model.double() and tts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("call", list(CALLS))
def test_greedy_codes_and_audio_are_upstreams_for_every_entry_point(call, dtype, reference_wav, monkeypatch):
    """Greedy: the codes the engine decodes (AR, and speculative with the predictor's own heads) are upstream's
    generate_* codes bit for bit, for each row of a batched call, and the engine's generate_* returns upstream's
    very waveforms (the speech tokenizer's decode of the same codes, a clone's reference audio cut off). The talker
    states that conditioned each frame are upstream's too, to rounding: the tiny model's peaked heads keep greedy
    codes far from ties, so codes alone would miss a small error in a frame's input (the trailing text, the pad
    embedding). Rounding in float64 too: upstream's RMSNorm normalises in float32 whatever the dtype, and the fused
    kernel sums the squares in another order (fused.cpp, norm_row), so float64 states agree to float32's ~1e-7."""
    model_type, voice = CALLS[call]
    tts, kind = tiny_tts(model_type, dtype), KINDS[model_type]
    arguments = dict(text=TEXTS, language="English", max_new_tokens=MAX_NEW_TOKENS, **GREEDY)
    arguments.update({name: value.format(ref=reference_wav) if isinstance(value, str) else value
                      for name, value in voice.items()})
    with decoded_codes(tts) as decoded:
        with upstream_states(tts) as upstream_hidden:  # out of the way of the engine's own capture of generate
            reference, rate = getattr(tts, f"generate_{kind}")(**arguments)
        upstream = decoded[-1]
        assert all(len(codes) >= 3 for codes in upstream)  # the talker did not stop at once
        for options in ({"drafter": None}, SPECULATIVE):
            with Engine(tts, **options) as engine:
                states = engine_states(engine, monkeypatch)
                wavs, our_rate = getattr(engine, f"generate_{kind}")(**arguments)
            ours = decoded[-1]
            rows = [torch.stack(states[request]) for request in sorted(states, key=lambda r: r.submitted)]
            for mine, theirs in zip(rows, upstream_hidden[-1]):
                torch.testing.assert_close(mine, theirs[:len(mine)], atol=1e-5, rtol=0)
            assert len(ours) == len(upstream) == len(wavs) == len(reference)
            for row, (mine, theirs) in enumerate(zip(ours, upstream)):
                assert torch.equal(mine, theirs), f"{call} row {row} {options}"
            assert our_rate == rate
            for mine, theirs in zip(wavs, reference):
                np.testing.assert_array_equal(mine, theirs)


def test_the_parity_tests_see_a_row_stop_on_eos_and_one_run_to_max_new_tokens():
    """The texts above exercise both ways a row ends (the scheduler's leave on EOS and on max_new_tokens)."""
    tts = tiny_tts("custom_voice", torch.float32)
    with decoded_codes(tts) as decoded:
        tts.generate_custom_voice(text=TEXTS, speaker="tiny", language="English", max_new_tokens=MAX_NEW_TOKENS,
                                  **GREEDY)
    lengths = sorted(len(codes) for codes in decoded[-1])
    assert lengths[0] < MAX_NEW_TOKENS - 1 and lengths[-1] == MAX_NEW_TOKENS - 1, lengths


STANDIN_TEXTS = [("hello there", "en"), ("Guten Tag, wie geht's?", "de"), ("¿Qué tal?", "es"), ("Привет.", "ru")]


def test_stand_in_frame_positions_are_the_stand_ins():
    """Each frame's RoPE id as the engine feeds it is the one the stand-in was trained with (and
    `synthesize_codes` uses): `StandinTTS.frame_positions`, for every language and every frame."""
    tts = tiny_standin(seed=3)
    with Engine(tts, drafter=None) as engine:
        for text, lang in STANDIN_TEXTS:
            prompt = engine.model.prompts("speech", dict(text=text, language=lang))[0]
            frames = torch.arange(max_frames_for(tts, text, lang))
            ours = prompt.frame_positions[:len(frames)]
            assert ours == tts.frame_positions(frames, lang).tolist(), lang


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "speculative"])
def test_stand_in_greedy_codes_are_synthesize_codes(speculative):
    """The stand-in in the engine, greedy, all four languages at once: each text's codes are those of
    `synthesize_codes` (the stand-in's own frame loop), AR and speculative."""
    tts = tiny_standin(seed=3)
    greedy = Sampler(do_sample=False)
    expected = [synthesize_codes(tts, text, lang, sampler=greedy, talker_sampler=greedy).codes
                for text, lang in STANDIN_TEXTS]
    assert min(len(codes) for codes in expected) < 5 < max(len(codes) for codes in expected)
    with Engine(tts, **(SPECULATIVE if speculative else {"drafter": None})) as engine:
        requests = [engine.submit("speech", text=text, language=lang, **GREEDY) for text, lang in STANDIN_TEXTS]
        codes = [request.wait() for request in requests]
    mismatched = [lang for (_, lang), mine, theirs in zip(STANDIN_TEXTS, codes, expected) if not torch.equal(mine, theirs)]
    assert not mismatched


# ---------------------------------------------------------------- sampled codes: G-tests against enumeration

SAMPLES = 300
PREDICTOR_SAMPLES = 200  # a wrong temperature is rejected at p ~ 1e-15 (the c0 test needs more for its rule)
ALPHA = 1e-3
ARGUMENTS = dict(text="hello there", speaker="tiny", language="English")


@pytest.fixture(scope="module")
def tts():
    return tiny_qwen3_tts(seed=0)


def sample(engine, first, count: int, prompt=None) -> torch.Tensor:
    """Codes [count, T, 16] of `first` and count - 1 more requests of its prompt (or `prompt`), seeds 1.., all
    submitted at once (the engine batches them as its max_batch allows)."""
    requests = [first] + [engine.enqueue(prompt or first.prompt, seed) for seed in range(1, count)]
    return torch.stack([request.wait() for request in requests])


def test_sampled_c0_follow_upstreams_rules_in_a_batch_and_a_wrong_rule_is_seen(tts):
    """The first two c0 of requests decoded 8 at a time (the talker sampled, the predictor greedy so that the
    joint is enumerable): their joint against the exact joint from upstream's talker, predictor and Hugging Face's
    processors (`c0_pair_probs`). Repetition penalty 0.2 (upstream takes any penalty > 0; below 1 it favours
    repeats) makes the rule visible: the statistic, the G-test of the joint and of (c0_1, repeated or not), passes
    for the engine's rules and fails for the same rules with the penalty ignored."""
    settings = dict(ARGUMENTS, repetition_penalty=0.2, subtalker_dosample=False, max_new_tokens=3)
    prompt = talker_prompt(tts, ARGUMENTS["text"], language="English", speaker="tiny")
    with Engine(tts, drafter=None, max_batch=8, max_queue=SAMPLES) as engine:
        probs = c0_pair_probs(tts, prompt, talker_settings(engine.model.capture("custom_voice", settings)))
        vocab = int(len(probs) ** 0.5)
        right = sample(engine, engine.submit("custom_voice", seed=0, **settings), SAMPLES)
        right_prompt = engine.model.prompts("custom_voice", settings)[0]  # a prompt, not a request: the queue stays
        ignored = replace(right_prompt, rules=replace(right_prompt.rules, repetition_penalty=1.0))  # at SAMPLES
        wrong = sample(engine, engine.enqueue(ignored, 0), SAMPLES)

    def statistic(codes: torch.Tensor) -> float:
        assert codes.shape[1:] == (2, 16)
        counts = torch.bincount(codes[:, 0, 0] * vocab + codes[:, 1, 0], minlength=vocab * vocab)
        return min(g_test(counts, probs), g_test(repeats(counts, vocab), repeats(probs, vocab)))

    print(f"p-values: engine {statistic(right):.3g}, penalty ignored {statistic(wrong):.3g}")
    assert statistic(right) > ALPHA / 2
    assert statistic(wrong) < 1e-6


@pytest.mark.parametrize("batch, speculative", [(1, False), (8, False), (8, True)],
                         ids=["alone", "batch-ar", "batch-speculative"])
def test_sampled_predictor_codes_follow_the_enumeration_alone_and_in_a_batch(tts, batch, speculative):
    """Frame 0's (c1, c2) of requests decoded alone, 8 at a time AR, and 8 at a time speculatively (the tree's
    acceptance), each row drawing from its own generator: against the exact joint from the predictor's
    teacher-forced logits at upstream's talker state (c0 greedy). The same counts reject the joint of a sampler
    whose temperature is off by 0.3: the test has the power to see a wrong predictor rule."""
    settings = dict(ARGUMENTS, do_sample=False, subtalker_temperature=1.0, max_new_tokens=2)
    prompt = talker_prompt(tts, ARGUMENTS["text"], language="English", speaker="tiny")
    h0 = teacher_forced_hidden(tts.model.talker, prompt, torch.zeros(1, 16, dtype=torch.long))[0]
    options = SPECULATIVE if speculative else {"drafter": None}
    with Engine(tts, **options, max_batch=batch, max_queue=PREDICTOR_SAMPLES, seed=0) as engine:
        first = engine.submit("custom_voice", seed=0, **settings)
        codes = sample(engine, first, PREDICTOR_SAMPLES)[:, 0]
    c0 = int(codes[0, 0])
    assert (codes[:, 0] == c0).all()  # greedy talker: every request's state and c0 are the same
    probs = predictor_pair_probs(tts, h0, c0, first.prompt.sampler)
    vocab = int(len(probs) ** 0.5)
    counts = torch.bincount(codes[:, 1] * vocab + codes[:, 2], minlength=vocab * vocab)
    off = predictor_pair_probs(tts, h0, c0, replace(first.prompt.sampler, temperature=0.7))
    print(f"p-values: {g_test(counts, probs):.3g}, against temperature 0.7 {g_test(counts, off):.3g}")
    assert g_test(counts, probs) > ALPHA
    assert g_test(counts, off) < 1e-6


# ---------------------------------------------------------------- TalkerRules against Hugging Face


@pytest.mark.parametrize("settings", [
    dict(repetition_penalty=1.05, do_sample=False),
    dict(repetition_penalty=1.3, temperature=0.9, top_k=50, top_p=1.0),
    dict(repetition_penalty=0.7, temperature=1.3, top_k=5, top_p=0.8),
    dict(repetition_penalty=1.0, temperature=0.6, top_k=0, top_p=0.9),
], ids=["greedy", "upstream-defaults", "topk-topp", "no-penalty"])
def test_talker_rules_are_hugging_faces_processors_bit_for_bit(tts, settings):
    """For random logits and histories (repeats, EOS and suppressed ids among them, lengths around
    min_new_tokens): the engine's rules for a prompt (`TalkerRules.scores`, then its sampler's warpers when
    sampling) give the very scores of the LogitsProcessorList transformers' generate builds from the arguments
    upstream passes its talker.generate (repetition penalty, min_new_tokens, suppressed tokens; temperature,
    top-k, top-p)."""
    arguments = dict(ARGUMENTS, **settings)
    with Engine(tts, drafter=None) as engine:
        rules = engine.model.prompts("custom_voice", arguments)[0].rules
        captured = talker_settings(engine.model.capture("custom_voice", arguments))
    processors = hf_processors(tts.model.talker, captured)
    assert captured["min_new_tokens"] == rules.min_new_tokens == 2 and len(captured["suppress_tokens"]) > 1000
    generator = torch.Generator().manual_seed(0)
    vocab = rules.allowed.numel()
    for case in range(60):
        logits = torch.randn(vocab, generator=generator) * (1 + case % 5)
        history = torch.randint(0, vocab, (case % 5,), generator=generator)
        if case % 3 == 0 and len(history):
            history[-1] = history[0]  # a repeated id: penalised once
        if case % 7 == 0 and len(history):
            history[0] = rules.eos
        ours = rules.scores(logits, history)
        if rules.sampler.do_sample:
            ours = rules.sampler.process(ours)
        theirs = processors(history[None], logits[None].clone())[0]
        assert torch.equal(ours, theirs), case


# ---------------------------------------------------------------- the talker on the core's blocks


@functools.cache
def upstream_talker(layers: int, dtype: torch.dtype):
    """A tiny upstream talker with `layers` layers (random weights, std 0.02), eval."""
    qwen_tts = import_qwen_tts()
    config = qwen_tts.core.models.Qwen3TTSConfig(**tiny_tts_config_dict(talker_layers=layers))
    torch.manual_seed(4)
    model = qwen_tts.core.models.Qwen3TTSForConditionalGeneration(config).to(dtype).eval().requires_grad_(False)
    return model.talker


def test_talker_prefill_and_steps_are_upstreams_forward_in_float64():
    """A prompt prefilled and frames stepped one by one on the core's blocks give upstream's talker forward
    (its M-RoPE position ids from get_rope_index, one causal pass) at every position, in float64 to 1e-12 on the
    plain layers: the talker's layers, KV cache and 1-D RoPE (which equals M-RoPE for upstream's text-only ids)
    are upstream's. Under inference mode (the fused kernels, as the engine runs) to float32's rounding, 1e-6."""
    upstream = upstream_talker(2, torch.float64)
    ours = talker_from_upstream(upstream)
    generator = torch.Generator().manual_seed(0)
    length, frames, hidden = 11, 7, upstream.config.hidden_size
    inputs = torch.randn(1, length + frames, hidden, generator=generator, dtype=torch.float64)
    mask = torch.ones(1, length + frames, dtype=torch.long)
    positions, _ = upstream.get_rope_index(mask)
    assert positions.shape[0] == 3 and (positions == torch.arange(length + frames)).all()  # text-only: t = h = w
    with torch.no_grad():
        reference = upstream.model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                                   use_cache=False).last_hidden_state[0]

    def prefill_and_steps() -> torch.Tensor:
        """The prompt's last state, then one per step: the prefill and the steps on a fresh one-row cache."""
        cache = talker_blocks.RowCache(ours)
        row = cache.add()
        states = [talker_blocks.prefill(ours, cache, row, inputs[0, :length], torch.arange(length))]
        for t in range(length, length + frames):
            states.append(talker_blocks.step(ours, cache, inputs[0, t][None], torch.tensor([t]))[0])
        return torch.stack(states)

    states = prefill_and_steps()
    torch.testing.assert_close(states, reference[length - 1:], atol=1e-12, rtol=0)
    torch.testing.assert_close(ours.codec_head(states[-1]), upstream.codec_head(reference[-1]), atol=1e-12, rtol=0)
    with torch.inference_mode():  # as the engine's thread runs it: the fused CPU kernels where built
        fused = prefill_and_steps()
    # upstream's RMSNorm normalises in float32 even in float64; the fused kernel sums the squares in another order
    torch.testing.assert_close(fused, reference[length - 1:], atol=1e-6, rtol=0)


def test_a_removed_row_leaves_the_others_as_a_fresh_cache_of_them_would():
    """Three rows (prompts of 5, 9 and 70 tokens: the longest crosses a SLOT_MULTIPLE), two steps, then row 0
    leaves and two more steps: the last row's K/V entries and length move into the hole bit for bit, and every
    remaining row's hidden states are those of a fresh cache holding only the remaining rows, and those of each row
    decoded alone (float64, to 1e-12: the rows' bits may differ with the batch size, see the report of issue 32;
    a wrong row moved, a stale entry or a wrong length would differ by far more)."""
    talker = talker_from_upstream(upstream_talker(2, torch.float64))
    generator = torch.Generator().manual_seed(1)
    hidden = talker.config.hidden_size
    prompts = [torch.randn(n, hidden, generator=generator, dtype=torch.float64) for n in (5, 9, 70)]
    inputs = torch.randn(4, 3, hidden, generator=generator, dtype=torch.float64)  # step, row, hidden

    def run(rows: list[int], leave_after: int | None = None) -> dict[int, list[torch.Tensor]]:
        """Hidden states per row: prefill `rows`, four steps; rows[0] leaves after step `leave_after`."""
        cache, live, out = talker_blocks.RowCache(talker), list(rows), {r: [] for r in rows}
        for r in rows:
            out[r].append(talker_blocks.prefill(talker, cache, cache.add(), prompts[r], torch.arange(len(prompts[r]))))
        for s in range(4):
            positions = torch.tensor([len(prompts[r]) + s for r in live])
            states = talker_blocks.step(talker, cache, inputs[s, live], positions)
            for r, state in zip(live, states):
                out[r].append(state)
            if s == leave_after:
                last = cache.kv.kv[:, :, len(live) - 1, :, :cache.lengths[-1]].clone()
                cache.remove(0)
                live[0] = live.pop()
                assert cache.lengths == [len(prompts[r]) + s + 1 for r in live]
                assert torch.equal(cache.kv.kv[:, :, 0, :, :cache.lengths[0]], last)
        return out

    batched = run([0, 1, 2], leave_after=1)
    assert len(batched[0]) == 3 and len(batched[1]) == len(batched[2]) == 5
    remaining = run([2, 1])
    for r in (1, 2):
        alone = run([r])
        torch.testing.assert_close(torch.stack(batched[r]), torch.stack(remaining[r]), atol=1e-12, rtol=0)
        torch.testing.assert_close(torch.stack(batched[r]), torch.stack(alone[r]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_frames_talker_input_is_upstreams_sum_of_its_tables_bit_for_bit(dtype):
    """`QwenTTSModel.frame_inputs` (rows read by index) against upstream's forward: its 16 tables' embedding calls,
    concatenated and summed (the sum's order is the layout's: a change in it shows in bfloat16)."""
    from rvqspec.runtime.qwen_tts import QwenTTSModel

    tts = tiny_qwen3_tts(seed=1)
    tts.model.to(dtype)
    talker = tts.model.talker
    tables = [talker.get_input_embeddings()] + list(talker.code_predictor.get_input_embeddings())
    codes = min(table.num_embeddings for table in tables)
    frames = torch.randint(0, codes, (3, 16), generator=torch.Generator().manual_seed(0))
    upstream = torch.cat([table(frames[:, i:i + 1]) for i, table in enumerate(tables)], dim=1).sum(1)
    assert torch.equal(QwenTTSModel(tts).frame_inputs(frames), upstream)
