"""rvqspec.integrations.qwen_tts and `rvqspec synth` / `corpus from-audio` on tiny random upstream models."""

import re

import numpy as np
import pytest
import soundfile
import torch
from scipy.stats import chi2_contingency

from rvqspec import MultiCodeDecoder, Offsets, ReusedHeads, RvqspecError, default_tree
from rvqspec.cli.main import main
from rvqspec.core.quantize import QuantizedLinear
from rvqspec.integrations import deaccelerate
from rvqspec.integrations.base import HANDLE
from rvqspec.integrations.hub import resolve_model
from rvqspec.integrations.qwen_tts import accelerate, predictor_from_upstream
from rvqspec.tuning.corpus import Corpus
from rvqspec.tuning.qwen_tts_corpus import corpus_from_audio, talker_prompt, teacher_forced_hidden

from helpers.tiny import random_offsets, tiny_config
from helpers.upstream_models import frame_prompt, tiny_upstream_model, upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.upstream_tts import (FRAME_SAMPLES, SAMPLE_RATE, save_checkpoint, text_ids, tiny_qwen3_tts,  # noqa: E402
                                  write_wav)

GREEDY = dict(do_sample=False, subtalker_dosample=False)



@pytest.fixture(scope="module")
def tts():
    return tiny_qwen3_tts(seed=0)


def talker_codes(model, text: str = "hello there", frames: int = 8, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [T, 16], talker hidden states [T, H]) from upstream's generate, batch of one."""
    codes, hidden = model.generate(input_ids=[text_ids(text)], languages=["english"], speakers=["tiny"],
                                   max_new_tokens=frames, **{"non_streaming_mode": True, **GREEDY, **kwargs})
    return codes[0], hidden[0]


def test_greedy_codes_are_upstream_codes_ar_and_speculative(tts):
    reference, _ = talker_codes(tts.model)
    assert len(reference) >= 3  # enough frames to mean something (the talker did not stop at once)
    handle = accelerate(tts)
    try:
        codes, _ = talker_codes(tts.model)
        assert torch.equal(codes, reference)
        assert (handle.stats.frames, handle.stats.calls) == (len(reference), 15 * len(reference))
    finally:
        handle.undo()
    handle = accelerate(tts.model, drafter=ReusedHeads(), tree=default_tree(8))
    try:
        codes, _ = talker_codes(tts.model)
        assert torch.equal(codes, reference)
        assert handle.stats.frames == len(reference) and handle.stats.codes == 15 * len(reference)
    finally:
        handle.undo()


def test_waveform_of_each_entry_point_unchanged_when_greedy(tmp_path):
    """Custom voice, voice design and voice clone (in-context, with reference codes) all pass through the hook."""
    write_wav(tmp_path / "ref.wav", 0.5, seed=3)
    calls = {"custom_voice": lambda tts: tts.generate_custom_voice(text="hi there", speaker="tiny", language="english",
                                                                   max_new_tokens=5, **GREEDY),
             "voice_design": lambda tts: tts.generate_voice_design(text="hi there", instruct="calm", language="english",
                                                                   max_new_tokens=5, **GREEDY),
             "base": lambda tts: tts.generate_voice_clone(text="hi there", language="english", max_new_tokens=5,
                                                          ref_audio=str(tmp_path / "ref.wav"), ref_text="hello",
                                                          **GREEDY)}
    for kind, call in calls.items():
        tts = tiny_qwen3_tts(seed=1, model_type=kind)
        reference, sample_rate = call(tts)
        handle = accelerate(tts, drafter=ReusedHeads(), tree=default_tree(4))
        wavs, _ = call(tts)
        assert sample_rate == SAMPLE_RATE and handle.stats.frames > 0, kind
        np.testing.assert_array_equal(wavs[0], reference[0], err_msg=kind)


class CountingDecoder:
    """Counts the MultiCodeDecoder's forward calls (each is one predictor call for the whole batch)."""

    def __init__(self, handle):
        self.calls, self.forward = 0, handle.decoder.forward

        def counted(*args, **kwargs):
            self.calls += 1
            return self.forward(*args, **kwargs)

        handle.decoder.forward = counted


@pytest.mark.parametrize("drafter", [None, ReusedHeads()], ids=["ar", "speculative"])
def test_a_batch_of_texts_through_each_entry_point_is_upstream_and_one_call_per_step(tmp_path, drafter):
    """Three texts in one generate call (a batch of 3 rows per frame step), greedy: the same waveforms as
    upstream's batched generate, and at most 15 predictor calls per batched step (AR: exactly 15)."""
    write_wav(tmp_path / "ref.wav", 0.5, seed=3)
    texts, languages = ["hi there", "a longer sentence to say", "yes"], ["english"] * 3
    calls = {"custom_voice": lambda tts: tts.generate_custom_voice(text=texts, speaker=["tiny"] * 3,
                                                                   language=languages, max_new_tokens=6, **GREEDY),
             "voice_design": lambda tts: tts.generate_voice_design(text=texts, instruct=["calm", "fast", "low"],
                                                                   language=languages, max_new_tokens=6, **GREEDY),
             "base": lambda tts: tts.generate_voice_clone(text=texts, language=languages, max_new_tokens=6,
                                                          ref_audio=str(tmp_path / "ref.wav"), ref_text="hello",
                                                          **GREEDY)}
    for kind, call in calls.items():
        tts = tiny_qwen3_tts(seed=1, model_type=kind)
        reference, _ = call(tts)
        handle = accelerate(tts, drafter=drafter, tree=default_tree(8) if drafter else None)
        counter = CountingDecoder(handle)
        try:
            wavs, _ = call(tts)
        finally:
            handle.undo()
        assert len(wavs) == 3 and handle.stats.steps > 0 and len(handle.stats.rows) == 3, kind
        for ours, theirs in zip(wavs, reference):
            np.testing.assert_array_equal(ours, theirs, err_msg=kind)
        assert counter.calls == handle.stats.calls <= 15 * handle.stats.steps, kind
        assert handle.stats.frames == sum(row.frames for row in handle.stats.rows)
        if drafter is None:
            assert handle.stats.calls == 15 * handle.stats.steps and handle.stats.tree_sizes == {0: handle.stats.steps}
        else:
            assert handle.stats.tree_sizes == {8: handle.stats.steps}
            assert handle.stats.row_calls == sum(row.calls for row in handle.stats.rows) < 15 * handle.stats.frames


def test_the_policy_decides_per_batch_size(tts, tmp_path, monkeypatch):
    """tree='auto' (the default with a drafter): the policy's choice for each batch size decodes it, from the
    latency table of this model's setting in the device file; the codes stay upstream's."""
    from rvqspec.core.device_file import update_device_file
    from rvqspec.core.policy import setting_key

    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))
    key = setting_key(predictor_from_upstream(tts.model.talker))
    # Rounds as cheap as AR steps for one row, 20x dearer for three: speculate alone, AR in a batch of three.
    table = {"1": {"0": 1.0} | {str(n): 1.0 for n in (4, 8, 16, 32, 64)},
             "4": {"0": 1.0} | {str(n): 20.0 for n in (4, 8, 16, 32, 64)}}
    update_device_file({"latency": {key: {"ms": table}}})
    reference, _ = talker_codes(tts.model)
    handle = accelerate(tts, drafter=ReusedHeads())
    try:
        assert torch.equal(talker_codes(tts.model)[0], reference)
        single = dict(handle.stats.tree_sizes)
        handle.stats.reset()
        tts.generate_custom_voice(text=["hi there", "hello", "yes"], speaker="tiny", language="english",
                                  max_new_tokens=4, **GREEDY)
        batched = dict(handle.stats.tree_sizes)
    finally:
        handle.undo()
    assert list(single) == [handle.policy.choose(1)] and handle.policy.choose(1) > 0
    assert batched == {0: handle.stats.steps} and handle.policy.choose(3) == 0
    assert "AR: speculation predicted at best" in handle.explain(3) and "measured on this device" in handle.explain(3)


def test_undo_restores_upstream_generate(tts):
    predictor = tts.model.talker.code_predictor
    reference, _ = talker_codes(tts.model)
    handle = accelerate(tts.model.talker)
    with pytest.raises(RvqspecError, match="already accelerated"):
        accelerate(tts)
    deaccelerate(tts)
    assert "generate" not in vars(predictor) and not hasattr(tts.model.talker, HANDLE)
    counted = handle.stats.frames
    codes, _ = talker_codes(tts.model)
    assert torch.equal(codes, reference) and handle.stats.frames == counted  # upstream ran, not rvqspec
    with pytest.raises(RvqspecError, match="not accelerated"):
        deaccelerate(tts)
    with pytest.raises(RvqspecError, match="already undone"):
        handle.undo()


def test_calls_that_are_not_the_frame_call_go_to_upstream():
    model = tiny_upstream_model(seed=2, vocab=8, head_scale=10.0)
    predictor = model.talker.code_predictor
    inputs = frame_prompt(model, torch.randn(2, 64), torch.tensor([1, 5]))
    handle = accelerate(model)
    try:
        short = predictor.generate(inputs_embeds=inputs, max_new_tokens=3, do_sample=False)
        assert handle.stats.frames == 0 and short.shape == (2, 3)  # upstream's own generate ran
        foreign = inputs.clone()
        foreign[:, 1] += 1e-3  # not a row of the talker's c0 table: the c0 cannot be recovered
        predictor.generate(inputs_embeds=foreign, max_new_tokens=15, do_sample=False)
        assert handle.stats.frames == 0
    finally:
        handle.undo()


def test_greedy_frames_match_when_talker_is_wider_than_predictor():
    """The 1.7B layout: the talker is wider than the predictor, so inputs pass small_to_mtp_projection."""
    model = tiny_upstream_model(seed=6, talker_hidden=96, predictor_hidden=64, vocab=16, head_scale=10.0)
    predictor = model.talker.code_predictor
    inputs = frame_prompt(model, torch.randn(4, 96), torch.tensor([0, 3, 9, 15]))
    reference = predictor.generate(inputs_embeds=inputs, max_new_tokens=15, do_sample=False)
    for drafter in (None, ReusedHeads()):
        handle = accelerate(model, drafter=drafter, tree=default_tree(6) if drafter else None)
        try:
            assert torch.equal(predictor.generate(inputs_embeds=inputs, max_new_tokens=15, do_sample=False), reference)
        finally:
            handle.undo()
        assert handle.stats.frames == 4


def test_decoder_follows_a_dtype_change_after_accelerate():
    model = tiny_upstream_model(seed=5, vocab=8, head_scale=10.0)
    predictor = model.talker.code_predictor
    handle = accelerate(model)
    model.double()
    inputs = frame_prompt(model, torch.randn(3, 64, dtype=torch.float64), torch.tensor([0, 4, 7]))
    try:
        ours = predictor.generate(inputs_embeds=inputs, max_new_tokens=15, do_sample=False)
        assert handle.decoder.dtype == torch.float64 and handle.stats.frames == 3
    finally:
        handle.undo()
    assert torch.equal(ours, predictor.generate(inputs_embeds=inputs, max_new_tokens=15, do_sample=False))


def sample_frames(model, hidden: torch.Tensor, c0: int, count: int, seed: int, **sampling) -> torch.Tensor:
    """Codes [count, 15] from `count` frames with the same input, as upstream's talker asks for them."""
    predictor = model.talker.code_predictor
    torch.manual_seed(seed)
    inputs = frame_prompt(model, hidden.expand(count, -1), torch.full((count,), c0))
    out = predictor.generate(inputs_embeds=inputs, max_new_tokens=15, do_sample=True, output_hidden_states=True,
                             return_dict_in_generate=True, **sampling)
    return out.sequences


def min_p_value(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    """Smallest chi-square p-value, over the 15 codebooks, of 'a and b have the same code histogram'."""
    p_values = []
    for position in range(a.shape[1]):
        table = np.stack([np.bincount(x[:, position].numpy(), minlength=vocab) for x in (a, b)])
        p_values.append(chi2_contingency(table[:, table.sum(0) > 0])[1])
    return min(p_values)


def test_sampled_codes_match_upstream_in_distribution():
    """Chi-square, per codebook, of upstream's sampled codes against rvqspec's (AR and speculative) under the
    subtalker settings the caller passes. The test has the power to see a wrong sampler at this sample size:
    at the same threshold it flags codes sampled with the temperature or the top-k ignored."""
    vocab, count, alpha = 8, 300, 1e-3 / 15  # family-wise 1e-3 over the 15 codebooks
    model = tiny_upstream_model(seed=3, vocab=vocab, head_scale=6.0)
    hidden, c0 = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)), 5
    settings = dict(temperature=0.4, top_k=4, top_p=0.95)
    upstream = sample_frames(model, hidden, c0, count, seed=10, **settings)
    for seed, wrong in enumerate(({"temperature": 1.0}, {"top_k": 0})):
        codes = sample_frames(model, hidden, c0, count, seed=20 + seed, **{**settings, **wrong})
        assert min_p_value(upstream, codes, vocab) < alpha, wrong
    for seed, drafter in enumerate((None, ReusedHeads())):
        handle = accelerate(model, drafter=drafter, tree=default_tree(4) if drafter else None)
        try:
            ours = sample_frames(model, hidden, c0, count, seed=30 + seed, **settings)
        finally:
            handle.undo()
        assert handle.stats.frames == count
        assert min_p_value(upstream, ours, vocab) > alpha, drafter


def test_generator_makes_draws_reproducible_without_touching_global_rng():
    model = tiny_upstream_model(seed=4, vocab=8, head_scale=10.0)
    hidden = torch.randn(1, 64)
    runs = []
    for _ in range(2):
        handle = accelerate(model, generator=torch.Generator().manual_seed(7))
        try:
            torch.manual_seed(0)
            seeded = torch.get_rng_state()
            runs.append(sample_frames(model, hidden, 3, 20, seed=0, temperature=0.9, top_k=50))
            assert torch.equal(torch.get_rng_state(), seeded)  # every draw came from the generator
        finally:
            handle.undo()
    assert torch.equal(runs[0], runs[1])


def test_offsets_for_another_model_size_are_refused(tmp_path, tts):
    other = MultiCodeDecoder(tiny_config(hidden=32, vocab=32))
    Offsets.for_model(other).save(tmp_path / "offsets.safetensors")
    drafter = Offsets.load(tmp_path / "offsets.safetensors")
    with pytest.raises(RvqspecError, match="trained for a code predictor with .* train one for this model"):
        accelerate(tts, drafter=drafter)
    assert "generate" not in vars(tts.model.talker.code_predictor)  # nothing was hooked


def test_trained_offsets_leave_greedy_codes_unchanged(tmp_path, tts):
    reference, _ = talker_codes(tts.model)
    random_offsets(predictor_from_upstream(tts.model.talker), seed=5).save(tmp_path / "offsets.safetensors")
    handle = accelerate(tts, drafter=Offsets.load(tmp_path / "offsets.safetensors"), tree=default_tree(6))
    try:
        assert torch.equal(talker_codes(tts.model)[0], reference)
    finally:
        handle.undo()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tts):
    """`tts` saved as a checkpoint folder, loaded back by the CLI through `Qwen3TTSModel.from_pretrained`."""
    return save_checkpoint(tts, tmp_path_factory.mktemp("checkpoint"), {"max_new_tokens": 6})


@pytest.mark.parametrize("flags, calls_per_frame", [([], None), (["--no-spec"], "15.00"),
                                                    (["--weights", "w8a8", "--talker-weights", "w8a8"], None)])
def test_synth_cli_text_to_waveform(checkpoint, tmp_path, monkeypatch, capsys, flags, calls_per_frame):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out.wav"
    assert main(["synth", "--model", str(checkpoint), "--text", "a short line", "--speaker", "tiny",
                 "--language", "English", "--out", str(out), "--device", "cpu", *flags]) == 0
    report = capsys.readouterr().out
    frames = int(re.search(r"(\d+) frames", report)[1])
    measured = re.search(r"(\d+\.\d+) calls/frame, (\d+\.\d+) tokens/step", report)
    assert measured and float(measured[1]) * float(measured[2]) == pytest.approx(15, abs=0.1), report  # 2 decimals each
    assert calls_per_frame in (None, measured[1])
    wav, sample_rate = soundfile.read(out)
    assert sample_rate == SAMPLE_RATE and frames >= 1 and len(wav) == frames * FRAME_SAMPLES
    assert np.isfinite(wav).all() and np.abs(wav).max() > 0


def test_synth_cli_refuses_offsets_of_another_model(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    Offsets.for_model(MultiCodeDecoder(tiny_config(hidden=32, vocab=32))).save(tmp_path / "offsets.safetensors")
    assert main(["synth", "--model", str(checkpoint), "--text", "hi", "--speaker", "tiny", "--out",
                 str(tmp_path / "out.wav"), "--device", "cpu", "--drafter", str(tmp_path / "offsets.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained for a code predictor" in err and not (tmp_path / "out.wav").exists()


@pytest.mark.parametrize("non_streaming_mode", [True, False])
def test_teacher_forced_hidden_is_upstream_past_hidden(tts, non_streaming_mode):
    """The hidden state recorded for a frame is the one upstream's talker fed the predictor for it (upstream's
    generate returns them), text conditioning included: streaming mode feeds the text along the frames."""
    text = "speech for the corpus"
    codes, upstream_hidden = talker_codes(tts.model, text, frames=12, non_streaming_mode=non_streaming_mode,
                                          do_sample=True, subtalker_dosample=True)
    prompt = talker_prompt(tts, text, language="english", speaker="tiny", non_streaming_mode=non_streaming_mode)
    hidden = teacher_forced_hidden(tts.model.talker, prompt, codes)
    torch.testing.assert_close(hidden, upstream_hidden, atol=1e-5, rtol=1e-5)


def test_corpus_from_audio(checkpoint, tmp_path, monkeypatch, capsys, tts):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    audio = tmp_path / "audio"
    (audio / "sub").mkdir(parents=True)
    for name, seconds in (("a", 0.4), ("sub/b", 0.3)):
        write_wav(audio / f"{name}.wav", seconds, seed=len(name))
        (audio / f"{name}.txt").write_text(f"words of {name}\n")
    assert main(["corpus", "from-audio", "--model", str(checkpoint), "--audio", str(audio), "--out",
                 str(tmp_path / "corpus"), "--language", "English", "--speaker", "tiny", "--device", "cpu"]) == 0
    assert "2 utterances" in capsys.readouterr().out
    corpus = Corpus(tmp_path / "corpus", validation_fraction=0.0)
    entries = {entry["id"]: (codes, hidden) for entry, codes, hidden in corpus.utterances_of("train")}
    assert set(entries) == {"a", "sub/b"}
    codes, hidden = entries["sub/b"]
    expected_codes = tts.model.speech_tokenizer.encode(str(audio / "sub/b.wav")).audio_codes[0]
    assert torch.equal(codes, expected_codes) and len(codes) == 4  # 0.3 s at 12.5 frames/s, rounded up
    prompt = talker_prompt(tts, "words of sub/b", language="English", speaker="tiny")
    expected_hidden = teacher_forced_hidden(tts.model.talker, prompt, expected_codes)
    torch.testing.assert_close(hidden.float(), expected_hidden, atol=2e-3, rtol=1e-3)  # stored as float16


def test_corpus_from_audio_needs_transcripts(tmp_path, tts):
    write_wav(tmp_path / "a.wav", 0.2, seed=0)
    with pytest.raises(RvqspecError, match=r"1 of 1 audio files have no transcript .* a\.txt"):
        corpus_from_audio(tts, tmp_path, tmp_path / "corpus")


def test_synth_names_a_truncated_checkpoint(checkpoint, tmp_path, monkeypatch, capsys):
    import shutil

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    broken = shutil.copytree(checkpoint, tmp_path / "broken")
    weights = next(p for p in broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["synth", "--model", str(broken), "--text", "hi", "--out", str(tmp_path / "o.wav"), "--device",
                 "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot load" in err and not (tmp_path / "o.wav").exists()


def test_corpus_from_audio_names_an_undecodable_file_and_writes_no_corpus(tmp_path, tts):
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "bad.wav").write_bytes(b"RIFF not really a wave file")
    (tmp_path / "clips" / "bad.txt").write_text("hello")
    with pytest.raises(RvqspecError, match=r"bad\.wav cannot be decoded as audio"):
        corpus_from_audio(tts, tmp_path / "clips", tmp_path / "corpus")
    assert not (tmp_path / "corpus" / "index.json").exists()


def test_resolve_model_finds_cached_snapshot_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--Qwen--Qwen3-TTS-12Hz-0.6B-CustomVoice"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice") == repo / "snapshots" / "abc123"


@pytest.mark.parametrize("argv, message", [
    (["synth", "--model", "{tmp}/missing/folder", "--text", "hi", "--out", "{tmp}/o.wav"], "does not exist"),
    (["synth", "--model", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "--text", "hi", "--out", "{tmp}/o.wav"],
     "not on disk .*huggingface-cli download Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"),
    (["synth", "--model", "{tmp}", "--text", "hi", "--out", "{tmp}/o.wav", "--no-spec", "--tree", "t.json"],
     "--no-spec decodes autoregressively"),
    (["synth", "--model", "{tmp}", "--text", "hi", "--out", "{tmp}/o.wav", "--drafter", "{tmp}/none.safetensors"],
     "drafter file .* does not exist"),
    (["corpus", "from-audio", "--model", "{tmp}", "--audio", "{tmp}/none", "--out", "{tmp}/c"],
     "audio folder .* does not exist"),
])
def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rvqspec ")
    assert re.search(message, err), err


def test_an_accelerated_model_serves_two_threads(tts):
    """The decoder's state belongs to each call: two threads generating with one accelerated model get the codes
    each gets alone (greedy), AR and speculative."""
    import threading

    for drafter in (None, ReusedHeads()):
        handle = accelerate(tts, drafter=drafter, tree=default_tree(8) if drafter else None)
        try:
            alone = {text: talker_codes(tts.model, text)[0] for text in ("hello there", "a different sentence")}
            results = []

            def work(text: str) -> None:
                for _ in range(3):
                    results.append((text, talker_codes(tts.model, text)[0]))

            threads = [threading.Thread(target=work, args=(text,)) for text in alone]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            handle.undo()
        assert len(results) == 6 and all(torch.equal(codes, alone[text]) for text, codes in results)


def test_quantized_weights_through_accelerate_keep_speculation_exact(tts):
    """accelerate(..., weights="w8a8"): the decoder holds int8 weights; greedy speculative codes are its AR codes."""
    with pytest.raises(RvqspecError, match="unknown weights scheme 'w4'"):
        accelerate(tts, weights="w4")
    reference, _ = talker_codes(tts.model)
    codes = {}
    for name, drafter, tree in (("ar", None, "auto"), ("spec", ReusedHeads(), default_tree(8))):
        handle = accelerate(tts, drafter=drafter, tree=tree, weights="w8a8")
        try:
            assert handle.decoder.weights == "w8a8"
            codes[name], _ = talker_codes(tts.model)
        finally:
            handle.undo()
    assert torch.equal(codes["ar"], codes["spec"])
    assert torch.equal(talker_codes(tts.model)[0], reference)  # undone: upstream's own codes again


def test_talker_weights_quantize_the_talker_alone_and_keep_speculation_exact(tts):
    """accelerate(..., talker_weights="w8a8"): every linear layer of the talker outside its code predictor is int8
    while the handle lives; the talker's states move (a different model), greedy speculative codes equal the AR
    codes of the same quantized talker, and undo() puts the very float layers back."""
    talker = tts.model.talker
    linears = {name: m for name, m in talker.named_modules() if isinstance(m, torch.nn.Linear)}
    reference, reference_hidden = talker_codes(tts.model)
    codes, hidden = {}, {}
    for name, drafter, tree in (("ar", None, "auto"), ("spec", ReusedHeads(), default_tree(8))):
        handle = accelerate(tts, drafter=drafter, tree=tree, talker_weights="w8a8")
        try:
            now = dict(talker.named_modules())
            swapped = {n for n in linears if isinstance(now[n], QuantizedLinear)}
            assert swapped == {n for n in linears if not n.startswith("code_predictor.")} and "codec_head" in swapped
            codes[name], hidden[name] = talker_codes(tts.model)
        finally:
            handle.undo()
    assert torch.equal(codes["ar"], codes["spec"])
    assert not torch.equal(hidden["ar"][:3], reference_hidden[:3])
    assert all(dict(talker.named_modules())[n] is m for n, m in linears.items())
    assert torch.equal(talker_codes(tts.model)[0], reference)
    with pytest.raises(RvqspecError, match="unknown weights scheme 'w4'"):
        accelerate(tts, talker_weights="w4")
    assert all(dict(talker.named_modules())[n] is m for n, m in linears.items())
    accelerate(tts).undo()  # the refused call left no handle behind


@pytest.mark.parametrize("write", ["load_state_dict", "lora_merge", "data_copy"])
def test_weights_changed_after_accelerate_are_followed(write):
    """accelerate copies the predictor's weights; an in-place change afterwards used to go unnoticed (its codes then
    differed from upstream's)."""
    tts, other = tiny_qwen3_tts(seed=0), tiny_qwen3_tts(seed=5)
    predictor, theirs = tts.model.talker.code_predictor, other.model.talker.code_predictor
    handle = accelerate(tts, drafter=ReusedHeads(), tree=default_tree(8))
    try:
        before, _ = talker_codes(tts.model)
        with torch.no_grad():
            if write == "load_state_dict":
                predictor.load_state_dict(theirs.state_dict())
            for mine, new in zip(predictor.parameters(), theirs.parameters()):
                if write == "data_copy":
                    mine.data.copy_(new)
                elif write == "lora_merge":
                    mine.add_(new - mine)
        accelerated, _ = talker_codes(tts.model)
    finally:
        handle.undo()
    upstream, _ = talker_codes(tts.model)
    assert torch.equal(accelerated, upstream) and not torch.equal(upstream, before)
