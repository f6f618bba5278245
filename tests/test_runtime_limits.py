"""Issue 54: every request says how it ended (`end_reason`), and one whose end code never comes ends within a budget
its text bounds (docs/limits.md): the shipped stand-in's normal speech is never cut (its margin shown), a tiny
qwen-tts that never draws its end code ends at its text budget with reason "length" (the Engine, `rvqspec synth`, the
server), an explicit max_new_tokens is kept exactly, and a normal request's codes are what they were. A long text in
sentence mode (runtime/passage.py) streams as its sentences spoken in turn, without a click at the joins."""

import json
import math

import numpy as np

import httpx
import pytest
import torch

from rvqspec.cli.demo import DEFAULT_TEXT
from rvqspec.cli.main import main
from rvqspec.runtime import Engine, Request

from helpers.engines import GREEDY, frames_of, never_ending
from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.upstream_tts import save_checkpoint, tiny_qwen3_tts  # noqa: E402

WAIT = 120
QWEN = dict(speaker="tiny", language="English")
TEXT = "hello there, how are you today"  # 30 characters: 30 tokens of the tiny tokenizer
NUMBERS = {"en": "Call 555 0134 at 9, or 2,500 times.", "de": "Ruf 555 0134 um 9 an, 2500 Mal.",
           "es": "Llama al 555 0134 a las 9, 2500 veces.", "ru": "Позвони 555 0134 в 9, 2500 раз."}


@pytest.fixture(scope="module")
def tts():
    return tiny_qwen3_tts(seed=0)


@pytest.fixture(scope="module")
def standin():
    with Engine("standin", seed=0) as engine:
        yield engine


def endless(engine: Engine) -> Engine:
    """The engine's tiny qwen-tts with its end code never drawn (its c0 logit at -1e9)."""
    eos = engine.model.upstream.config.codec_eos_token_id
    logits = engine.model.c0_logits
    engine.model.c0_logits = lambda hidden: logits(hidden).index_fill(-1, torch.tensor([eos]), -1e9)
    return engine


def test_standin_speech_ends_by_itself_far_within_its_budget(standin):
    """Each language's sentence and a sentence of digits (spoken as words: a digit is budgeted as such), sampled as
    the stand-in samples by default, decoding together: every one ends with "eos" within half its budget
    (benchmarks/results/speech-rate.md: the margins measured, and the greedy runaways that end at their budget)."""
    requests = [standin.submit("speech", seed=seed, text=text, language=lang) for lang in DEFAULT_TEXT
                for text in (DEFAULT_TEXT[lang], NUMBERS[lang]) for seed in (1,)]
    for request in requests:
        frames = len(request.wait(WAIT))
        assert request.end_reason == "eos" and 2 * frames <= request.prompt.max_new_tokens - 1, request.prompt


def test_a_runaway_request_ends_at_its_text_budget_and_an_explicit_limit_is_kept(tts):
    with endless(Engine(tts, drafter=None, seed=0)) as engine:
        request = engine.submit("custom_voice", text=TEXT, **QWEN)
        codes = request.wait(WAIT)
        assert request.end_reason == "length" and len(codes) == 8 * len(TEXT) - 1  # its last draw is never decoded
        (wav,), rate = engine.generate_custom_voice(text=TEXT, **QWEN)
        assert len(wav) / rate <= 30 and math.isclose(len(wav) / rate, len(codes) * engine.model.frame_seconds)
        kept = engine.submit("custom_voice", text=TEXT, max_new_tokens=41, **QWEN)
        assert len(kept.wait(WAIT)) == 40 and kept.end_reason == "length"
        short = engine.submit("custom_voice", text="yes", **QWEN)
        assert len(short.wait(WAIT)) == 125 - 1  # a short text's floor: 10 s


def test_normal_requests_end_with_eos_and_the_same_codes_as_without_a_budget(tts):
    with Engine(tts, drafter=None) as engine:
        budgeted = engine.submit("custom_voice", seed=3, text=TEXT, **QWEN, **GREEDY)
        unbounded = engine.submit("custom_voice", seed=3, text=TEXT, max_new_tokens=2048, **QWEN, **GREEDY)
        assert torch.equal(budgeted.wait(WAIT), unbounded.wait(WAIT))
        assert budgeted.end_reason == unbounded.end_reason == "eos"
        assert len(budgeted.codes) < budgeted.prompt.max_new_tokens == 8 * len(TEXT)


def test_cancelled_and_failed_requests_say_so(tts):
    with Engine(tts, drafter=None) as engine:
        prompt = engine.model.prompts("custom_voice", dict(text="hi", **QWEN, **GREEDY))[0]
        running = engine.enqueue(never_ending(prompt), 0)
        frames_of(running, 2)
        running.cancel()
        running.finished.wait(WAIT)
        assert running.end_reason == "cancelled"
        prompt.embeds = prompt.embeds * float("nan")
        failed = engine.enqueue(prompt, 0)
        failed.finished.wait(WAIT)
        assert failed.end_reason == "error"


def test_synth_ends_a_runaway_at_its_budget_and_says_so(tts, tmp_path, monkeypatch, capsys):
    """`rvqspec synth` runs upstream's own loop: its budget goes to upstream as max_new_tokens."""
    import rvqspec.cli.synth as synth

    folder = save_checkpoint(tiny_qwen3_tts(seed=1), tmp_path / "checkpoint", dict(GREEDY))
    load = synth.load_tts

    def endless_load(*args):
        loaded = load(*args)
        eos = loaded.model.talker.config.codec_eos_token_id
        loaded.model.talker.codec_head.register_forward_hook(
            lambda module, inputs, logits: logits.index_fill(-1, torch.tensor([eos]), -1e9))
        return loaded

    monkeypatch.setattr(synth, "load_tts", endless_load)
    argv = ["synth", "--model", str(folder), "--text", "a short line", "--device", "cpu", *sum(
        (["--" + k, v] for k, v in QWEN.items()), [])]
    assert main([*argv, "--out", str(tmp_path / "cut.wav")]) == 0
    out = capsys.readouterr().out
    assert "124 frames" in out and "cut at its frame budget (125 frames, end reason: length)" in out
    assert main([*argv, "--out", str(tmp_path / "kept.wav"), "--max-new-tokens", "41", "--stream"]) == 0
    out = capsys.readouterr().out
    assert "3.20 s of audio" in out and "end reason: length" in out


def test_the_server_says_a_runaway_was_cut(tts, tmp_path):
    """Header (flac), SSE done event and /metrics, on the real engine in the app (in process)."""
    import anyio

    from rvqspec.serve.app import create_app
    from rvqspec.serve.voices import VoiceStore

    async def speak(client, **body) -> httpx.Response:
        return await client.post("/v1/audio/speech", json={"model": engine.name, "input": TEXT, "voice": "tiny",
                                                           "language": "English", **body}, timeout=WAIT)

    async def run() -> tuple:
        app = create_app(engine, VoiceStore(tmp_path / "voices"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            flac = await speak(client, response_format="flac")
            sse = await speak(client, response_format="pcm", stream_format="sse")
            metrics = (await client.get("/metrics")).text
        return flac, sse, metrics

    with endless(Engine(tts, drafter=None, seed=0)) as engine:
        flac, sse, metrics = anyio.run(run)
    assert flac.status_code == 200 and flac.headers["x-end-reason"] == "length"
    assert json.loads(sse.text.strip().splitlines()[-1][6:]) == {"type": "speech.audio.done", "end_reason": "length"}
    assert 'rvqspec_speech_ends_total{reason="length"} 2.0' in metrics


@pytest.mark.long
def test_a_long_text_streams_as_its_sentences_spoken_in_turn(standin):
    """Sentence mode (opt-in: the default is one utterance) equals the sentences spoken one after another from one
    generator, while another request decodes beside it; it streams, and no join clicks (the sample step across a
    join is under the median step within the speech)."""
    text = "It was a sunny day! Did you see it? Yes, I did."  # each end mark; 2 joins
    engine = standin
    one = engine.speech(text, voice="en", seed=5)
    one.cancel()  # (decoded to its end, it took a row beside the rest of this test and of the next ones)
    assert isinstance(one, Request)
    passage = engine.speech(text, voice="en", seed=5, sentences=True)
    beside = engine.speech("Guten Tag, wie geht's?", voice="de", seed=1)
    chunks = list(passage)
    beside.wait(WAIT)
    generator, turns = torch.Generator().manual_seed(5), []
    for prompt in passage.prompts:
        turns.append(engine.queue(prompt, generator))
        turns[-1].wait(WAIT)
    assert len(passage.prompts) == 3 and passage.end_reason == "eos" and len(chunks) > 4
    assert torch.equal(passage.codes, torch.cat([turn.codes for turn in turns]))
    audio = [turn.audio() for turn in turns]
    whole = np.concatenate(audio)
    np.testing.assert_allclose(np.concatenate(chunks), whole, atol=1e-4, rtol=0)  # streamed: the vocoder's chunks
    steps = np.abs(np.diff(whole))
    for join in np.cumsum([len(a) for a in audio])[:-1]:
        assert abs(whole[join] - whole[join - 1]) < np.median(steps)


def test_synth_speaks_a_long_text_sentence_by_sentence_with_the_seed_carried_on(tmp_path, capsys):
    """`synth --sentences on`: the wav is upstream's loop speaking each sentence in turn after one torch.manual_seed
    (sampled: the seed matters), each within its own budget."""
    import soundfile

    from rvqspec.cli.synth import write_wav
    from rvqspec.integrations.qwen_tts import accelerate, generate_speech, load_tts
    from rvqspec.runtime.qwen_tts import upstream_text_budget

    folder = save_checkpoint(tiny_qwen3_tts(seed=1), tmp_path / "checkpoint", {"max_new_tokens": 12})
    text, sentences = "Hello there. How are you?", ["Hello there.", "How are you?"]
    argv = ["synth", "--model", str(folder), "--text", text, "--device", "cpu", "--seed", "3", "--sentences", "on",
            "--out", str(tmp_path / "passage.wav"), *sum((["--" + k, v] for k, v in QWEN.items()), [])]
    assert main(argv) == 0
    assert "spoken sentence by sentence: 2 sentences" in capsys.readouterr().out
    tts = load_tts(folder, "cpu", torch.float32)
    accelerate(tts)
    torch.manual_seed(3)
    wavs = [generate_speech(tts, sentence, max_new_tokens=upstream_text_budget(tts, sentence), **QWEN)[0][0]
            for sentence in sentences]
    write_wav(tmp_path / "turns.wav", np.concatenate(wavs), tts.model.speech_tokenizer.get_output_sample_rate())
    got, want = (soundfile.read(tmp_path / name, dtype="int16")[0] for name in ("passage.wav", "turns.wav"))
    assert len(wavs[0]) > 0 and np.array_equal(got, want)
