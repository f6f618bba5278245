"""The stand-in TTS: talker shapes, official-layout save/load, KV-cached synthesis vs teacher forcing, training,
and the build pipeline end to end on a tiny corpus."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from rvqspec.core.decode import decode_frame
from rvqspec.core.drafters import Offsets, ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree
from rvqspec.standin.build import build
from rvqspec.standin.settings import Settings
from rvqspec.standin.synthesis import synthesize_codes
from rvqspec.standin.talker import TalkerConfig, load_standin, save_standin
from rvqspec.standin.training import (Utterance, joint_loss, make_batch, optimize, predictor_confidence, predictor_loss,
                                      talker_hidden, teacher_forced_hidden, train_joint, train_predictor)

from helpers.standin import TINY, random_utterances, tiny_codec, tiny_speech_corpus, tiny_standin, write_corpus

GREEDY = Sampler(do_sample=False)


def test_batch_shapes_and_targets():
    tts = tiny_standin()
    utts = random_utterances(3)
    batch = make_batch(tts, utts)
    lengths = [len(u.text.encode()) + 2 + len(u.codes) for u in utts]
    assert batch.inputs.shape == (3, max(lengths), 32)
    assert batch.frame_codes.shape == (sum(len(u.codes) for u in utts), 16)
    for row, utt in enumerate(utts):
        targets = batch.c0_targets[row]
        first = len(utt.text.encode()) + 1  # the bos position emits c0 of frame 0
        assert targets[first:first + len(utt.codes)].tolist() == utt.codes[:, 0].tolist()
        assert int(targets[first + len(utt.codes)]) == tts.config.codec_eos_token_id
        assert (targets[:first] == -100).all() and (targets[first + len(utt.codes) + 1:] == -100).all()
    hidden = talker_hidden(tts, batch)
    assert hidden.shape == batch.inputs.shape
    frame_hidden = hidden[batch.frame_rows, batch.frame_positions]
    c0_loss, residual_loss = joint_loss(tts, batch, 1.0, torch.Generator())
    torch.testing.assert_close(residual_loss, predictor_loss(tts.predictor, frame_hidden, batch.frame_codes))
    assert c0_loss.isfinite()


def test_frame_input_is_the_sum_of_the_shared_code_tables():
    tts = tiny_standin()
    codes = torch.randint(24, (16,))
    table = tts.predictor.code_embed.weight
    expected = sum(table[int(tts.predictor.table_offset[t]) + int(codes[t])] for t in range(16))
    torch.testing.assert_close(tts.frame_embed(codes), expected)
    # c0 goes through the talker's codec table, which is the predictor's table 0 (one tensor, not a copy)
    with torch.no_grad():
        table[int(codes[0])] += 1.0
    torch.testing.assert_close(tts.frame_embed(codes), expected + 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_save_load_round_trip_in_the_official_layout(tmp_path, dtype):
    tts = tiny_standin()
    save_standin(tts, tmp_path, dtype, extra={"codec": "test"})
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("talker.codec_head.weight").dtype == dtype
    assert {"talker.model.layers.1.self_attn.q_proj.weight", "talker.model.layers.0.mlp.down_proj.weight",
            "talker.model.norm.weight", "talker.model.text_embedding.weight", "talker.codec_head.weight",
            "talker.model.codec_embedding.weight", "talker.code_predictor.model.codec_embedding.14.weight",
            "talker.code_predictor.lm_head.0.weight"} <= keys
    config = json.loads((tmp_path / "config.json").read_text())["talker_config"]
    assert config["codec_eos_token_id"] == tts.config.codec_eos_token_id and config["stand_in"]["codec"] == "test"
    predictor = MultiCodeDecoder.from_pretrained(tmp_path)  # the loader of official checkpoints
    back = load_standin(tmp_path)
    for name, value in tts.state_dict().items():
        assert torch.equal(back.state_dict()[name], value.to(dtype).float()), name
    for name, value in tts.predictor.state_dict().items():
        assert torch.equal(predictor.state_dict()[name], value.to(dtype).float()), name


def test_load_refuses_a_plain_predictor_checkpoint(tmp_path):
    tts = tiny_standin()
    tts.predictor.save_pretrained(tmp_path)
    with pytest.raises(RvqspecError, match="standin build"):
        load_standin(tmp_path)


def test_cached_synthesis_matches_teacher_forcing():
    """Greedy synthesis through the KV cache gives the states a teacher-forced pass gives, and argmax c0."""
    tts = tiny_standin(seed=3).double()
    synthesis = synthesize_codes(tts, "Hallo Welt.", "de", sampler=GREEDY, talker_sampler=GREEDY, max_frames=6)
    assert synthesis.frames >= 2
    utt = Utterance("x", "de", "Hallo Welt.", synthesis.codes)
    hidden = teacher_forced_hidden(tts, utt)
    torch.testing.assert_close(synthesis.hidden.double(), hidden)
    logits = tts.talker.codec_head(hidden)[:, :tts.config.num_codes]
    assert logits.argmax(-1).tolist() == synthesis.codes[:, 0].tolist()
    for t in range(synthesis.frames):
        assert decode_frame(tts.predictor, hidden[t], synthesis.codes[t, 0], GREEDY).codes.tolist() \
            == synthesis.codes[t, 1:].tolist()


def test_speculative_synthesis_is_identical_when_greedy():
    tts = tiny_standin(seed=4)
    kwargs = dict(sampler=GREEDY, talker_sampler=GREEDY, max_frames=5)
    ar = synthesize_codes(tts, "Hello.", "en", **kwargs)
    spec = synthesize_codes(tts, "Hello.", "en", drafter=ReusedHeads(), tree=default_tree(8), **kwargs)
    assert torch.equal(ar.codes, spec.codes)
    assert ar.calls_per_frame == 15 and spec.calls_per_frame <= 15
    assert spec.tokens_per_step == pytest.approx(15 * spec.frames / spec.predictor_calls)


def test_synthesis_rejects_bad_input():
    tts = tiny_standin()
    with pytest.raises(RvqspecError, match="language 'xx'"):
        synthesize_codes(tts, "Hello.", "xx")
    with pytest.raises(RvqspecError, match="empty text"):
        synthesize_codes(tts, "  ", "en")


def test_joint_then_predictor_training_lower_the_losses(tmp_path):
    utts = random_utterances(4)
    tts = tiny_standin(std=0.02)
    batch = make_batch(tts, utts)
    with torch.no_grad():
        before = [float(x) for x in joint_loss(tts, batch, 1.0, torch.Generator())]
    report = train_joint(tts, utts, utts, steps=15, predictor_fraction=0.5, lr=2e-2, warmup=2, max_positions=10_000,
                         log=lambda _: None)
    with torch.no_grad():
        after = [float(x) for x in joint_loss(tts, make_batch(tts, utts), 1.0, torch.Generator())]
    assert report["steps"] == 15 and after[0] < before[0] - 0.5 and after[1] < before[1] - 0.5
    corpus = write_corpus(tts, utts, tmp_path / "corpus")
    codes, hidden = next(corpus.batches("train", 1000))
    table = tts.predictor.code_embed.weight.clone()
    with torch.no_grad():
        before = float(predictor_loss(tts.predictor, hidden, codes))
    report = train_predictor(tts.predictor, corpus, corpus, steps=15, lr=2e-2, batch_frames=8, warmup=2,
                             log=lambda _: None)
    with torch.no_grad():
        after = float(predictor_loss(tts.predictor, hidden, codes))
    assert report["steps"] == 15 and after < before - 0.5
    assert torch.equal(tts.predictor.code_embed.weight, table)  # shared with the talker: frozen in phase 3
    confidence = predictor_confidence(tts, corpus, Sampler())
    assert confidence["frames"] == sum(len(u.codes) for u in utts) and len(confidence["top1"]) == 15
    assert all(1 / 24 <= p <= 1 for p in confidence["top1"]) and 0 <= confidence["mean_entropy"] <= 3.2


def test_build_pipeline_from_encode_to_calibrate(tmp_path, capsys):
    work, assets = tmp_path / "work", tmp_path / "assets"
    tiny_speech_corpus(work / "corpus")
    tiny_codec(24).save(assets / "codec.safetensors")
    s = Settings(work=work, assets=assets, talker=TalkerConfig(num_codes=24, **TINY), predictor_sizes=TINY,
                 joint_steps=3, predictor_steps=3, predictor_batch_frames=16, offsets_epochs=1)
    log = build(s, "encode", "calibrate")
    assert list(log["stages"]) == ["encode", "joint", "code-corpus", "predictor", "offsets", "calibrate"]
    frames = log["stages"]["encode"]["result"]["frames"]
    assert frames == 36 * 13 and sum(log["stages"]["code-corpus"]["result"]["frames"].values()) == frames
    predictor = MultiCodeDecoder.from_pretrained(s.model_dir)  # the official-checkpoint loader
    tts = load_standin(s.model_dir)
    assert tts.config.bytes_per_frame == pytest.approx([len("Satz 0 en.") / 13] * 4, rel=0.05)
    assert torch.equal(tts.predictor.heads, predictor.heads)
    Offsets.load(s.offsets_file, predictor)
    assert sorted(p.name for p in s.trees_dir.glob("tree-N*.json")) == [f"tree-N{n}.json" for n in (16, 32, 4, 64, 8)]
    report = json.loads(s.report_file.read_text())
    assert report["asset_bytes"] == sum(f.stat().st_size for f in assets.rglob("*") if f.is_file()
                                        and f != s.report_file)
    assert report["corpus"]["de"]["test"] == {"sentences": 3, "hours": round(3 / 3600, 3)}
    assert report["codec"] is None  # the codec stage (and its WER report) did not run here
    # finished stages are skipped; a forced one redoes the stages after it
    capsys.readouterr()
    build(s, "code-corpus", "offsets", force=("predictor",))
    printed = capsys.readouterr().out
    assert "== code-corpus: done already" in printed and "== predictor\n" in printed and "== offsets\n" in printed
    with pytest.raises(RvqspecError, match="unknown stage"):
        build(s, "nonsense")


def test_training_keeps_the_epoch_with_the_best_validation_loss():
    weight = torch.nn.Parameter(torch.zeros(2))
    seen = []

    def evaluate() -> dict:
        seen.append(weight.detach().clone())
        return {"loss": [3.0, 1.0, 2.0][len(seen) - 1]}

    report = optimize([weight], lambda epoch: [None], lambda _: ((weight - 5) ** 2).sum(), steps=3, lr=0.1, warmup=1,
                      minutes=None, evaluate=evaluate, log=lambda _: None, log_every=10)
    assert report["best_epoch"] == 2 and torch.equal(weight.detach(), seen[1]) and not torch.equal(seen[1], seen[2])


def test_intelligibility_scores_against_the_text_the_chance_level_and_the_recordings(tmp_path, monkeypatch):
    from rvqspec.standin import quality
    from rvqspec.standin.build import intelligibility

    tiny_speech_corpus(tmp_path / "corpus", per_split=2)
    texts = {"en": "Satz 0 en.", "de": "Satz 1 de."}  # what the fake recogniser hears, per language

    class HearsOneSentence:
        def __call__(self, wav, lang):
            return texts.get(lang, "")

    monkeypatch.setattr(quality, "WhisperASR", HearsOneSentence)
    monkeypatch.setattr(quality, "codec_vocoder", lambda path: lambda codes: np.zeros(len(codes) * 1280))
    figures = intelligibility(Settings(work=tmp_path, quality_limit=2), tiny_standin(seed=3))
    assert list(figures) == ["en", "de", "es", "ru"] and figures["en"]["sentences"] == 2
    # en: test texts "Satz 0 en.", "Satz 1 en."; heard "Satz 0 en." twice: 1 of 6 words wrong, chance the same
    sixth = pytest.approx(1 / 6, abs=1e-4)  # figures are rounded to 4 digits
    assert figures["en"]["wer"] == sixth and figures["en"]["chance_wer"] == sixth
    assert figures["de"]["wer"] == sixth and figures["es"]["wer"] == 1.0
    assert figures["en"]["original_wer"] == figures["en"]["wer"]  # the recordings are heard the same here
    assert figures["en"]["examples"][0] == {"text": "Satz 0 en.", "heard": "Satz 0 en."}
