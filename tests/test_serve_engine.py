"""`rvqspec serve` on the real engine, in a server process on loopback: the shipped stand-in through the official
`openai` client and httpx (the audio is the Engine's for the same seed, streamed, whole, as SSE, and with requests
decoding together), a disconnect freeing its row, and a voice registered, spoken and deleted on a tiny Qwen3-TTS Base
checkpoint (random weights, a model that clones). The HTTP behaviour in detail: tests/test_serve.py."""

import base64
import threading

import httpx
import numpy as np
import openai
import pytest
import soundfile
from helpers.server import running
from helpers.upstream_tts import save_checkpoint, tiny_qwen3_tts
from test_serve import clip, sse_audio

from rvqspec.runtime import Engine
from rvqspec.serve.audio import to_int16
from rvqspec.serve.voices import decode_clip, samples

TEXT = "Hello there."
SERVE = ["-m", "rvqspec.cli", "serve", "--port", "0", "--max-batch", "4"]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("standin")
    with running([*SERVE, "--voices-dir", str(tmp / "voices")], tmp / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def engine():
    with Engine("standin", max_batch=4) as engine:
        yield engine


def alone(engine, text: str, seed: int, **args) -> np.ndarray:
    return to_int16(engine.speech(text, seed=seed, **args).audio())


def test_the_openai_client_streams_the_engines_audio_into_a_file(standin, engine, tmp_path):
    client = openai.OpenAI(base_url=f"{standin.url}/v1", api_key="unused", max_retries=0)
    with client.audio.speech.with_streaming_response.create(model="standin", voice="en", input=TEXT,
                                                            response_format="wav", extra_body={"seed": 5}) as response:
        response.stream_to_file(tmp_path / "out.wav")
    audio, sample_rate = soundfile.read(tmp_path / "out.wav", dtype="int16")
    assert sample_rate == engine.sample_rate and len(audio) > 0
    assert np.array_equal(audio, alone(engine, TEXT, 5, voice="en"))


def test_whole_and_sse_responses_are_the_engines_audio(standin, engine):
    want = alone(engine, TEXT, 6, voice="de").tobytes()
    body = {"model": "standin", "input": TEXT, "voice": "de", "seed": 6, "response_format": "pcm"}
    assert httpx.post(f"{standin.url}/v1/audio/speech", json=body, timeout=60).content == want
    sse = httpx.post(f"{standin.url}/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=60)
    assert sse_audio(sse.text) == want


def test_concurrent_requests_all_get_their_whole_audio(standin):
    """Four requests decoding together. (Their audio is not the lone request's of the same seed: a batched step's
    floats can tip a sampled code, so only a request decoded alone is compared with the Engine's.)"""
    texts = ["One two.", "Guten Tag.", "Buenos dias.", TEXT]
    got: dict[int, httpx.Response] = {}

    def request(seed: int) -> None:
        got[seed] = httpx.post(f"{standin.url}/v1/audio/speech", timeout=120, json={
            "model": "standin", "input": texts[seed], "seed": seed, "response_format": "pcm"})

    threads = [threading.Thread(target=request, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for response in got.values():
        assert response.status_code == 200 and len(response.content) >= 2 * 1280 and len(response.content) % 2 == 0
    assert standin.metrics()["rvqspec_active_rows"] == 0


def test_a_disconnect_mid_stream_frees_the_row(standin):
    body = {"model": "standin", "input": "A long sentence to speak, one word after another. " * 6, "seed": 1}
    with httpx.stream("POST", f"{standin.url}/v1/audio/speech", json=body, timeout=60) as response:
        pieces = response.iter_raw()
        next(pieces)
        assert standin.metrics()["rvqspec_active_rows"] == 1
    m = standin.wait_until(lambda m: m["rvqspec_active_rows"] == 0)
    assert m["rvqspec_active_rows"] == 0
    assert standin.wait_until(lambda now: False, timeout=0.3)["rvqspec_frames_total"] == m["rvqspec_frames_total"]


def test_a_4000_character_text_streams_sentence_by_sentence(standin):
    """Past LONG_TEXT bytes the server speaks sentence by sentence (one utterance of it is past the stand-in's
    positions: refused with "sentences": false); the first audio comes while the rest is decoded."""
    text = ("The quick brown fox jumps over the lazy dog, again and again. " * 70)[:4000]
    body = {"model": "standin", "input": text, "voice": "en", "seed": 3, "response_format": "pcm"}
    whole = httpx.post(f"{standin.url}/v1/audio/speech", json={**body, "sentences": False}, timeout=60)
    assert whole.status_code == 400 and "split it into sentences" in whole.json()["error"]["message"]
    with httpx.stream("POST", f"{standin.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        pieces = response.iter_raw()
        assert len(next(pieces) + next(pieces)) > 0
    assert standin.wait_until(lambda m: m["rvqspec_active_rows"] == 0)["rvqspec_active_rows"] == 0


def test_sentence_mode_is_the_engines_passage(standin, engine):
    text = "Hello there. How are you today?"
    body = {"model": "standin", "input": text, "voice": "en", "seed": 4, "response_format": "pcm", "sentences": True}
    got = np.frombuffer(httpx.post(f"{standin.url}/v1/audio/speech", json=body, timeout=60).content, "<i2")
    want = to_int16(engine.speech(text, voice="en", seed=4, sentences=True).audio())
    assert len(got) == len(want) and np.abs(got.astype(int) - want).max() <= 2  # streamed: chunks to float rounding


def test_the_stand_in_takes_non_streaming_mode_true_and_refuses_false(standin, engine):
    """The stand-in has one prompt, the whole text's (non_streaming_mode true, as upstream's default); false asks for a
    dual-track prompt it has not: a 400 naming the field."""
    body = {"model": "standin", "input": TEXT, "voice": "en", "seed": 8, "response_format": "pcm"}
    same = httpx.post(f"{standin.url}/v1/audio/speech", json={**body, "non_streaming_mode": True}, timeout=60)
    assert same.content == alone(engine, TEXT, 8, voice="en").tobytes()
    refused = httpx.post(f"{standin.url}/v1/audio/speech", json={**body, "non_streaming_mode": False}, timeout=60)
    assert refused.status_code == 400 and "no dual-track prompt" in refused.json()["error"]["message"]
    assert "non_streaming_mode" in refused.json()["error"]["message"]


def test_the_stand_in_refuses_voice_registration(standin):
    refused = httpx.post(f"{standin.url}/v1/audio/voices", json={"name": "anna", "audio": clip()})
    assert refused.status_code == 400 and "cannot clone" in refused.json()["error"]["message"]
    assert [v["id"] for v in httpx.get(f"{standin.url}/v1/audio/voices").json()["data"]] == ["en", "de", "es", "ru"]


def test_a_cloned_voice_round_trip_on_a_qwen3_tts_base_checkpoint(tmp_path):
    folder = save_checkpoint(tiny_qwen3_tts(0, model_type="base"), tmp_path / "tiny-base", {"max_new_tokens": 8})
    with running([*SERVE, "--model", str(folder), "--voices-dir", str(tmp_path / "voices")],
                 tmp_path / "server.log") as server:
        url = server.url
        added = httpx.post(f"{url}/v1/audio/voices", json={"name": "hum", "audio": clip(), "transcript": "a hum"},
                           timeout=60)
        assert added.status_code == 201, added.text
        body = {"model": "tiny-base", "input": "hello", "voice": "hum", "seed": 2, "response_format": "pcm"}
        spoken = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)
        assert spoken.status_code == 200 and spoken.content
        assert httpx.delete(f"{url}/v1/audio/voices/hum").status_code == 200
        assert httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60).status_code == 400
    with Engine(str(folder)) as engine:  # the clip as the server stores it: 16-bit at the model's rate
        stored = samples(decode_clip(base64.b64decode(clip()), engine.sample_rate))
        prompt = engine.clone_prompt(stored, engine.sample_rate, "a hum")
        assert spoken.content == alone(engine, "hello", 2, clone=prompt).tobytes()
