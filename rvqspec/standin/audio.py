"""Small wav helpers shared by the corpus builder and the codec: 16 kHz mono float32 everywhere."""

import os
from math import gcd
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000


def _soundfile():
    try:
        import soundfile
    except ImportError as e:
        from rvqspec.core.errors import RvqspecError

        raise RvqspecError("soundfile not found: pip install soundfile") from e
    return soundfile


def resample(wav: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling (exact rational ratio, e.g. 22050 -> 16000 is 320/441)."""
    if sr_in == sr_out:
        return wav.astype(np.float32)
    from scipy.signal import resample_poly

    g = gcd(sr_in, sr_out)
    return resample_poly(wav, sr_out // g, sr_in // g).astype(np.float32)


def read_wav(path: str | Path, sr: int = SAMPLE_RATE) -> np.ndarray:
    """Read any soundfile-readable file as mono float32 at `sr`."""
    wav, sr_in = _soundfile().read(str(path), dtype="float32", always_2d=True)
    return resample(wav.mean(axis=1), sr_in, sr)


def write_wav(path: str | Path, wav: np.ndarray, sr: int = SAMPLE_RATE) -> None:
    """Write 16-bit PCM through a temp file + os.replace, so a killed run never leaves half a wav."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    _soundfile().write(str(tmp), np.clip(wav, -1.0, 1.0), sr, subtype="PCM_16", format="WAV")
    os.replace(tmp, path)


def trim_silence(wav: np.ndarray, sr: int = SAMPLE_RATE, rel_db: float = -40.0, pad_s: float = 0.1) -> np.ndarray:
    """Cut leading/trailing samples quieter than `rel_db` below the peak, keeping `pad_s` of margin."""
    loud = np.flatnonzero(np.abs(wav) > np.abs(wav).max() * 10 ** (rel_db / 20))
    if loud.size == 0:
        return wav
    pad = int(pad_s * sr)
    return wav[max(0, loud[0] - pad) : loud[-1] + pad + 1]
