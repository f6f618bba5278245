"""Streaming: the incremental 12 Hz decoder equals the offline decode; streamed chunks of every qwen-tts entry
point concatenate to upstream's whole waveform (AR and speculative, batches); the worker is controlled by the
consumer (early stop, errors, a consumer that does not read, two streams at once)."""

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rvqspec import ReusedHeads, RvqspecError, default_tree
from rvqspec.core.frame_loop import check_chunks
from rvqspec.integrations.qwen_tts_audio import StreamingCodec, offline_decode
from rvqspec.integrations.stream import Stopped, stream

from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from rvqspec.integrations.qwen_tts import accelerate  # noqa: E402

from helpers.upstream_tts import CODEBOOK, tiny_qwen3_tts, tiny_speech_tokenizer, write_wav  # noqa: E402

GREEDY = dict(do_sample=False, subtalker_dosample=False)
TEXTS = ["hi there", "a longer sentence to say", "yes"]



@pytest.fixture(scope="module")
def tokenizer64():
    """The tiny speech tokenizer in float64: differences from the stream's logic stand out of the rounding."""
    tokenizer = tiny_speech_tokenizer()
    tokenizer.model.double()
    return tokenizer


def streamed(decoder, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state, pieces, start = StreamingCodec(decoder), [], 0
    for size in sizes:
        pieces.append(state.decode(codes[start:start + size]))
        start += size
    return torch.cat(pieces)


@settings(max_examples=12, deadline=None)
@given(frames=st.integers(1, 80), seed=st.integers(0, 10**6), data=st.data())
def test_incremental_decode_equals_offline_decode(tokenizer64, frames, seed, data):
    """Any split of any codes into chunks gives the offline decode's samples (float64: rounding only)."""
    codes = torch.randint(0, CODEBOOK, (frames, 16), generator=torch.Generator().manual_seed(seed))
    sizes = []
    while sum(sizes) < frames:
        sizes.append(data.draw(st.integers(1, frames - sum(sizes))))
    reference = tokenizer64.model.decoder.chunked_decode(codes.T[None]).reshape(-1)
    ours = streamed(tokenizer64.model.decoder, codes, sizes)
    assert ours.shape == reference.shape
    assert reference.std() > 0.05  # audible: a comparison of near-silence would pass anything
    assert torch.allclose(ours, reference, atol=1e-10, rtol=0)


def test_incremental_decode_restarts_like_upstream_every_300_frames(tokenizer64):
    """Upstream's decode restarts from 25 frames of context at frame 300: so does the stream (a stream that
    kept its state across would differ there)."""
    codes = torch.randint(0, CODEBOOK, (340, 16), generator=torch.Generator().manual_seed(0))
    reference = offline_decode(tokenizer64, codes)
    ours = streamed(tokenizer64.model.decoder, codes, [37] * 9 + [7]).float()
    assert torch.allclose(ours, reference, atol=1e-6, rtol=0)
    decoder = tokenizer64.model.decoder
    uninterrupted = decoder(codes.T[None]).reshape(-1).float()  # one pass, no restart: differs after 300
    assert (uninterrupted[300 * 1920:] - reference[300 * 1920:]).abs().max() > 1e-3


def test_incremental_decode_in_float32_is_within_rounding_of_the_offline_decode():
    """float32: the difference is the rounding of a different operation order, amplified by the decoder as
    much as a 1e-7 relative perturbation of its input is (the random decoder is ill-conditioned: real figures
    are in benchmarks/results/end-to-end.md)."""
    tokenizer = tiny_speech_tokenizer()
    codes = torch.randint(0, CODEBOOK, (60, 16), generator=torch.Generator().manual_seed(1))
    reference = offline_decode(tokenizer, codes)
    ours = streamed(tokenizer.model.decoder, codes, [3] + [12] * 4 + [9])
    snr = 10 * torch.log10(reference.pow(2).mean() / (ours - reference).pow(2).mean())
    assert snr > 60, f"SNR {snr:.1f} dB"


ENTRY_POINTS = {"custom_voice": "custom_voice", "voice_design": "voice_design", "base": "voice_clone"}


def speak(handle, kind: str, streaming: bool, ref: str | None = None, **kwargs):
    """The three texts through the entry point of `kind`: upstream's generate_*, or the handle's stream_*."""
    voice = {"custom_voice": dict(speaker=["tiny"] * 3), "voice_design": dict(instruct=["calm", "fast", "low"]),
             "base": dict(ref_audio=ref, ref_text="hello")}[kind]
    target, prefix = (handle, "stream_") if streaming else (handle.tts, "generate_")
    return getattr(target, prefix + ENTRY_POINTS[kind])(text=TEXTS, language="english", **voice, **kwargs)


def concatenated(chunks: list, rows: int) -> list[np.ndarray]:
    return [np.concatenate([audio[row] for audio, _ in chunks]) for row in range(rows)]


@pytest.mark.parametrize("drafter", [None, ReusedHeads()], ids=["ar", "speculative"])
@pytest.mark.parametrize("kind", list(ENTRY_POINTS))
def test_streamed_chunks_concatenate_to_the_whole_waveform(tmp_path, kind, drafter):
    """A batch of 3 texts through each entry point, greedy: the chunks (first 2 frames, then 3) of each row
    concatenate to the waveform of upstream's generate call; rows that are done get empty chunks."""
    write_wav(tmp_path / "ref.wav", 0.5, seed=3)
    tts = tiny_qwen3_tts(seed=1, model_type=kind)
    tts.model.speech_tokenizer.model.double()
    handle = accelerate(tts, drafter=drafter, tree=default_tree(8) if drafter else None)
    try:
        ref = str(tmp_path / "ref.wav")
        reference, sample_rate = speak(handle, kind, False, ref, max_new_tokens=12, **GREEDY)
        chunks = list(speak(handle, kind, True, ref, max_new_tokens=12, chunk_frames=3, first_chunk_frames=2,
                            **GREEDY))
    finally:
        handle.undo()
    assert {rate for _, rate in chunks} == {sample_rate}
    assert all(isinstance(audio, list) and len(audio) == 3 for audio, _ in chunks)
    assert len(chunks[0][0][0]) == 2 * 1920 and all(a.dtype == np.float32 for audio, _ in chunks for a in audio)
    for ours, theirs in zip(concatenated(chunks, 3), reference):
        assert ours.shape == theirs.shape and theirs.std() > 0.05, kind
        np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0, err_msg=kind)
    lengths = [len(a) for a in reference]
    if len(set(lengths)) > 1:  # a row that finished early gets empty chunks at the end
        assert any(len(audio[int(np.argmin(lengths))]) == 0 for audio, _ in chunks)


def test_one_text_streams_one_array_and_sampling_streams_what_it_draws():
    tts = tiny_qwen3_tts(seed=1)
    handle = accelerate(tts, drafter=ReusedHeads(), tree=default_tree(8))
    try:
        chunks = list(handle.stream_custom_voice(text="hi there", speaker="tiny", language="english",
                                                 max_new_tokens=10, chunk_frames=4))
        assert all(isinstance(audio, np.ndarray) and audio.ndim == 1 for audio, _ in chunks)
        assert handle.stats.frames == sum(len(audio) for audio, _ in chunks) // 1920 > 0
    finally:
        handle.undo()


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rvqspec")]


@pytest.fixture
def handle():
    """A tiny qwen-tts model accelerated (AR), undone after the test."""
    handle = accelerate(tiny_qwen3_tts(seed=1))
    yield handle
    handle.undo()


def test_leaving_the_loop_stops_generation_within_a_frame_and_joins_the_worker(handle):
    for audio, _ in handle.stream_custom_voice(text="hi there", speaker="tiny", language="english",
                                               max_new_tokens=200, chunk_frames=1, min_new_tokens=200,
                                               **GREEDY):
        frames_when_left = handle.stats.frames
        break
    assert not worker_threads()
    assert handle.stats.frames <= frames_when_left + 1 + 4  # in flight: one frame, and 4 queued chunks
    assert handle.stats.frames < 50
    assert "forward" not in vars(handle.talker)  # the tap is gone


def test_an_error_in_the_worker_reaches_the_consumer(handle):
    with pytest.raises(ValueError, match="[Ss]peaker"):
        list(handle.stream_custom_voice(text="hi", speaker="nobody", language="english"))
    assert not worker_threads()


def test_a_consumer_that_does_not_read_holds_generation(handle):
    """With the queue full (4 chunks), the worker waits: frames stop growing while nobody reads."""
    chunks = handle.stream_custom_voice(text="hi there", speaker="tiny", language="english", max_new_tokens=100,
                                        min_new_tokens=100, chunk_frames=1, first_chunk_frames=1, **GREEDY)
    next(chunks)
    time.sleep(1.0)
    held = handle.stats.frames
    assert held <= 1 + 4 + 1
    time.sleep(0.3)
    assert handle.stats.frames == held
    chunks.close()
    assert not worker_threads()


def test_two_streams_of_one_model_each_get_their_own_audio():
    tts = tiny_qwen3_tts(seed=1)
    tts.model.speech_tokenizer.model.double()
    handle = accelerate(tts, drafter=ReusedHeads(), tree=default_tree(8))
    try:
        texts = ["hi there", "yes"]
        reference = {text: tts.generate_custom_voice(text=text, speaker="tiny", language="english",
                                                     max_new_tokens=10, **GREEDY)[0][0] for text in texts}
        got, errors = {}, []

        def consume(text: str) -> None:
            try:
                got[text] = np.concatenate([audio for audio, _ in handle.stream_custom_voice(
                    text=text, speaker="tiny", language="english", max_new_tokens=10, chunk_frames=2, **GREEDY)])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(text,)) for text in texts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        for text in texts:
            np.testing.assert_allclose(got[text], reference[text], atol=1e-6, rtol=0)
    finally:
        handle.undo()


@pytest.mark.parametrize("chunk_frames", [0, -3, 301, 2.5, True, "12"])
def test_bad_chunk_sizes_are_refused_before_any_work(chunk_frames, handle):
    with pytest.raises(RvqspecError, match="chunk_frames must be a whole number of frames from 1 to 300"):
        check_chunks(chunk_frames, None)
    with pytest.raises(RvqspecError, match="chunk_frames"):
        handle.stream_custom_voice(text="hi", speaker="tiny", language="english", chunk_frames=chunk_frames)
    assert not worker_threads()


def test_the_wrong_entry_point_and_a_partial_model_are_refused():
    tts = tiny_qwen3_tts(seed=1)
    handle = accelerate(tts)
    try:
        with pytest.raises(RvqspecError, match=r"custom_voice model: stream it with handle.stream_custom_voice"):
            handle.stream_voice_design(text="hi", instruct="calm")
    finally:
        handle.undo()
    handle = accelerate(tts.model)
    try:
        with pytest.raises(RvqspecError, match="accelerate the Qwen3TTSModel itself"):
            handle.stream_custom_voice(text="hi", speaker="tiny")
    finally:
        handle.undo()


def test_keyboard_interrupt_in_the_consumer_leaves_nothing_running():
    def produce(channel) -> None:
        for i in range(10**6):
            channel.check()
            channel.send(i)

    with pytest.raises(KeyboardInterrupt):
        for i in stream(produce):
            if i == 3:
                raise KeyboardInterrupt
    assert not worker_threads()


def test_stopped_is_raised_in_the_worker_once_the_consumer_left():
    seen = []

    def produce(channel) -> None:
        try:
            while True:
                channel.send(1)
        except Stopped:
            seen.append("stopped")
            raise

    items = stream(produce)
    next(items)
    items.close()
    assert seen == ["stopped"] and not worker_threads()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from helpers.upstream_tts import save_checkpoint

    return save_checkpoint(tiny_qwen3_tts(seed=1), tmp_path_factory.mktemp("checkpoint"),
                           {"max_new_tokens": 10, "do_sample": False, "subtalker_dosample": False})


def test_synth_stream_writes_the_whole_waveform_and_reports_first_audio(checkpoint, tmp_path, monkeypatch, capsys):
    import soundfile

    from rvqspec.cli.main import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = ["synth", "--model", str(checkpoint), "--text", "a short line", "--speaker", "tiny", "--language",
              "English", "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "whole.wav")]) == 0
    assert main([*common, "--out", str(tmp_path / "streamed.wav"), "--stream", "--chunk-frames", "2"]) == 0
    printed = capsys.readouterr().out
    assert "streamed: first audio after" in printed and "real-time factor" in printed
    whole, _ = soundfile.read(tmp_path / "whole.wav")
    streamed, _ = soundfile.read(tmp_path / "streamed.wav")
    np.testing.assert_allclose(streamed, whole, atol=2 / 32768)  # 16-bit files: one step apart at most
    assert not list(tmp_path.glob("*.part.wav"))


def test_an_interrupted_synth_stream_leaves_no_file(checkpoint, tmp_path, monkeypatch):
    """Each chunk leaves a valid wav (a player can follow it); Ctrl-C removes the partial file, joins the worker."""
    import soundfile

    from rvqspec.cli import synth

    seen = []
    real_write = soundfile.SoundFile.write

    def write_then_interrupt(self, data):
        real_write(self, data)
        if seen:
            raise KeyboardInterrupt
        self.flush()
        seen.append(soundfile.info(self.name).frames)  # readable mid-stream, with the samples so far

    monkeypatch.setattr(soundfile.SoundFile, "write", write_then_interrupt)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KeyboardInterrupt):
        synth.run_synth(synth_args(checkpoint, tmp_path / "out.wav"))
    assert seen and seen[0] > 0
    assert not list(tmp_path.iterdir()) and not worker_threads()


def synth_args(checkpoint, out):
    from rvqspec.cli.main import build_parser

    return build_parser().parse_args(["synth", "--model", str(checkpoint), "--text", "a short line", "--speaker", "tiny",
                              "--language", "English", "--device", "cpu", "--out", str(out), "--stream",
                              "--chunk-frames", "2"])
