"""Recordings for a code corpus: a folder of audio clips, each with its transcript in <name>.txt beside it."""

import json
from pathlib import Path

from rvqspec.core.errors import RvqspecError

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg")


def audio_with_transcripts(folder: str | Path) -> list[tuple[Path, str]]:
    """(audio file, transcript) for every audio file under `folder`; each needs <name>.txt beside it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RvqspecError(f"audio folder {folder} does not exist")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
    if not files:
        raise RvqspecError(f"no audio ({', '.join(AUDIO_SUFFIXES)}) under {folder}")
    missing = [p for p in files if not p.with_suffix(".txt").is_file()]
    if missing:
        raise RvqspecError(f"{len(missing)} of {len(files)} audio files have no transcript (e.g. {missing[0]} needs "
                           f"{missing[0].with_suffix('.txt').name} beside it): the talker is conditioned on the text, "
                           "so write each transcript to <name>.txt")
    return [(p, p.with_suffix(".txt").read_text(encoding="utf-8").strip()) for p in files]


def load_recording(path: Path, sample_rate: int | None = None):
    """(mono waveform, its sample rate), resampled to `sample_rate` if given; an undecodable file is named (the
    corpus being written is then not finished: its writer aborts)."""
    import librosa

    try:
        return librosa.load(path, sr=sample_rate, mono=True)
    except Exception as e:  # librosa's audio file readers raise many types
        raise RvqspecError(f"{path} cannot be decoded as audio ({type(e).__name__}): convert it to wav, or "
                           "remove it and its transcript") from None


def utterance_id(path: Path, folder: str | Path) -> str:
    """A recording's corpus id: its path under the audio folder, without suffix."""
    return path.relative_to(folder).with_suffix("").as_posix()


def is_csm_checkpoint(folder: Path) -> bool:
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "csm"
    except (OSError, ValueError, AttributeError):
        return False
