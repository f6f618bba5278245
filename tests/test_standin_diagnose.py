"""`rvqspec standin diagnose`: recorded codes completed by the predictor, truncated, or synthesized, each
routed to the recogniser."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rvqspec.cli.main import main
from rvqspec.core.decode import decode_frame
from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler
from rvqspec.standin import quality, synthesis
from rvqspec.standin.build import build
from rvqspec.standin.diagnose import complete_levels, diagnose
from rvqspec.standin.settings import Settings, load_utterances
from rvqspec.standin.talker import save_standin
from rvqspec.standin.training import Utterance, teacher_forced_hidden

from helpers.standin import random_utterances, tiny_codec, tiny_speech_corpus, tiny_standin

GREEDY = Sampler(do_sample=False)


def test_completion_from_recorded_c0_is_greedy_ar_decoding():
    tts = tiny_standin(seed=5)
    utt = random_utterances(2, seed=1)[1]
    hidden = teacher_forced_hidden(tts, utt)
    completed = complete_levels(tts.predictor, hidden, utt.codes, 1, GREEDY)
    assert torch.equal(completed[:, 0], utt.codes[:, 0])
    for t in range(len(utt.codes)):
        assert completed[t, 1:].tolist() == decode_frame(tts.predictor, hidden[t], utt.codes[t, 0], GREEDY).codes.tolist()
    assert not torch.equal(completed, utt.codes)  # random recorded codes are not what the predictor picks


def test_completion_keeps_the_recorded_levels_and_conditions_on_them():
    tts = tiny_standin(seed=5)
    utt = random_utterances(2, seed=1)[1]
    hidden = teacher_forced_hidden(tts, utt)
    assert torch.equal(complete_levels(tts.predictor, hidden, utt.codes, 16, GREEDY), utt.codes)
    from_c0 = complete_levels(tts.predictor, hidden, utt.codes, 1, GREEDY)
    from_c3 = complete_levels(tts.predictor, hidden, utt.codes, 4, GREEDY)
    assert torch.equal(from_c3[:, :4], utt.codes[:, :4])
    assert not torch.equal(from_c3[:, 4:], from_c0[:, 4:])  # later draws see the recorded c1..c3
    with pytest.raises(ValueError, match="keep must be in 1..16"):
        complete_levels(tts.predictor, hidden, utt.codes, 0, GREEDY)
    with pytest.raises(ValueError, match="fraction must be in"):
        complete_levels(tts.predictor, hidden, utt.codes, 4, GREEDY, fraction=1.5)


def test_a_fraction_of_the_recorded_levels_is_kept_and_the_rest_drawn():
    tts = tiny_standin(seed=6)
    codes = torch.randint(24, (300, 16), generator=torch.Generator().manual_seed(0))
    utt = Utterance("long", "en", "A long sentence for many frames.", codes)
    hidden = teacher_forced_hidden(tts, utt)
    assert torch.equal(complete_levels(tts.predictor, hidden, codes, 6, GREEDY, fraction=0.0),
                       complete_levels(tts.predictor, hidden, codes, 1, GREEDY))
    assert torch.equal(complete_levels(tts.predictor, hidden, codes, 6, GREEDY, fraction=1.0),
                       complete_levels(tts.predictor, hidden, codes, 6, GREEDY))
    half = complete_levels(tts.predictor, hidden, codes, 6, GREEDY, torch.Generator().manual_seed(1), fraction=0.5)
    kept = (half[:, 1:6] == codes[:, 1:6]).float().mean()
    assert 0.45 < kept < 0.62  # half kept, plus the draws that happen to equal the recording (~1/24 of the rest)
    assert torch.equal(half[:, 0], codes[:, 0])


def test_diagnose_routes_each_version_to_the_recogniser(tmp_path, monkeypatch):
    work, assets = tmp_path / "work", tmp_path / "assets"
    tiny_speech_corpus(work / "corpus")
    tiny_codec(24).save(assets / "codec.safetensors")
    s = Settings(work=work, assets=assets)
    build(s, "encode", "encode")
    save_standin(tiny_standin(seed=2), s.model_dir)
    decoded = []

    def vocoder(codes):  # the waveform's length tells the fake recogniser how many levels it got
        decoded.append(codes)
        return np.zeros(codes.shape[1])

    monkeypatch.setattr(quality, "codec_vocoder", lambda path: vocoder)
    synthesized = torch.zeros(4, 16, dtype=torch.long)  # free synthesis is tested elsewhere; here only its routing
    monkeypatch.setattr(synthesis, "synthesize_codes", lambda tts, text, lang, generator: SimpleNamespace(codes=synthesized))
    monkeypatch.setattr(quality, "WhisperASR", lambda: lambda wav, lang: "Satz 0 en." if len(wav) == 16 else "")
    figures = diagnose(s, "en", limit=3, levels=(1, 3), fractions=(0.5,))
    recorded = [u.codes for u in load_utterances(s, "test") if u.lang == "en"]
    # test sentences "Satz 0/1/2 en."; heard "Satz 0 en." from 16 levels: 2 of 9 words wrong; truncated: nothing
    assert figures["wer"] == pytest.approx({"codec": 2 / 9, "first 1 levels": 1.0, "first 3 levels": 1.0,
                                            "recorded c0 + model": 2 / 9, "recorded c0..c2 + model": 2 / 9,
                                            "recorded c0, 50% of c1..c2 + model": 2 / 9,
                                            "model (AR)": 2 / 9, "chance": 2 / 9}, abs=1e-4)
    assert figures["sentences"] == 3 and figures["heard"]["codec"] == "Satz 0 en."
    codec_rows, first1, first3, from_c0, from_c3, mixed, free = (decoded[i * 3:(i + 1) * 3] for i in range(7))
    assert all(codes is synthesized for codes in free)
    assert all(torch.equal(a, b) for a, b in zip(codec_rows, recorded))
    assert all(torch.equal(a, b[:, :1]) for a, b in zip(first1, recorded))
    assert all(torch.equal(a[:, :3], b[:, :3]) and a.shape == b.shape for a, b in zip(from_c3, recorded))
    assert all(torch.equal(a[:, :1], b[:, :1]) for a, b in zip(from_c0 + mixed, recorded))
    with pytest.raises(RvqspecError, match="test sentences of language 'xx'"):
        diagnose(s, "xx")
    assert main(["standin", "diagnose", "--work", str(work), "--lang", "xx"]) == 2
