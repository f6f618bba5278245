"""Tiny stand-in TTS systems, codecs, utterances and corpora for the tests."""

import json

import numpy as np
import torch

from rvqspec.standin.audio import write_wav
from rvqspec.standin.codec import CodecConfig, MelRVQCodec
from rvqspec.standin.talker import StandinTTS, TalkerConfig, new_standin, predictor_config_for
from rvqspec.standin.training import Utterance, teacher_forced_hidden
from rvqspec.tuning.corpus import Corpus, CorpusWriter, split_of

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16)


def tiny_standin(seed: int = 0, std: float = 0.3, num_codes: int = 24) -> StandinTTS:
    """A random tiny stand-in; weights ~ N(0, std) (norm gains 1) so that greedy paths depend on the input."""
    torch.manual_seed(seed)
    talker = TalkerConfig(num_codes=num_codes, bytes_per_frame=(1.7, 2.3, 1.4, 2.9), **TINY)
    tts = new_standin(talker, predictor_config_for(talker, **TINY))
    with torch.no_grad():
        for name, p in tts.named_parameters():
            if "norm" not in name:
                p.normal_(std=std)
    return tts.eval()


def tiny_codec(codes: int, seed: int = 0) -> MelRVQCodec:
    """A random 16-level codec over an 8-dim latent, `codes` entries per level (the talker's num_codes)."""
    generator = torch.Generator().manual_seed(seed)
    cfg = CodecConfig(codebook_size=codes, dim=8)
    features = cfg.mels_per_frame * cfg.mel.n_mels
    proj = torch.linalg.qr(torch.randn(features, cfg.dim, generator=generator)).Q
    codebooks = torch.randn(cfg.num_codebooks, codes, cfg.dim, generator=generator)
    return MelRVQCodec(cfg, torch.full((features,), -4.0), proj, codebooks)


def random_utterances(count: int, num_codes: int = 24, seed: int = 0) -> list[Utterance]:
    generator = torch.Generator().manual_seed(seed)
    texts = ["Guten Tag.", "Hello there, world!", "¿Qué tal?", "Привет."]
    return [Utterance(f"u{i}", ["de", "en", "es", "ru"][i % 4], texts[i % 4],
                      torch.randint(num_codes, (int(torch.randint(3, 9, (1,), generator=generator)), 16),
                                    generator=generator)) for i in range(count)]


def write_corpus(tts: StandinTTS, utts: list[Utterance], path) -> Corpus:
    with CorpusWriter(path, tts.config.hidden_size, hidden_dtype=torch.float32) as writer:
        for utt in utts:
            writer.add(utt.id, utt.lang, utt.codes, teacher_forced_hidden(tts, utt))
    return Corpus(path, validation_fraction=0.0)


def tiny_speech_corpus(folder, per_split: int = 3) -> None:
    """manifest.jsonl + noise-burst wavs, `per_split` sentences per language and split; the ids are picked so
    that the code corpus' own hash split (used by train-offsets) has a validation utterance."""
    rng = np.random.default_rng(0)
    rows, n = [], 0
    while not any(split_of(r["id"], 0.05) == "validation" for r in rows if r["split"] == "train"):
        rows = []
        for lang in ("en", "de", "es", "ru"):
            for split in ("train", "validation", "test"):
                for i in range(per_split):
                    n += 1
                    rows.append({"id": f"{lang}_{n}", "lang": lang, "split": split, "text": f"Satz {i} {lang}.",
                                 "wav": f"wavs/{lang}_{n}.wav", "duration": 1.0})
    for row in rows:
        write_wav(folder / row["wav"], (0.1 * rng.standard_normal(16000)).astype(np.float32))
    (folder / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
