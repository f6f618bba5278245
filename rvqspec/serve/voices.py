"""Cloned voices: a reference clip and its transcript per name, kept in one server data folder.

Each voice is a folder `<name>/` holding `audio.wav` (16-bit PCM at the model's rate) and `voice.json`, written under
a temporary name and renamed into place, so a voice is there whole or not at all, and two registrations of one name
cannot both win. A name is checked against NAME before it becomes a path; nothing else from a request reaches the
file system. The engine's clone prompt of a voice is computed on first use and cached.

An upload is bounded before it is decoded: its header (format, rate, channels, frames) is probed and refused past the
limits, and at most the header's frame count is decoded (so at most MAX_CLIP_SECONDS at MAX_RATE: ~23 MB of float32
whatever the file says). It is stored at the model's rate in 16 bits (~2.9 MB for 60 s at 24 kHz), within the store's
quota on the number of voices and their bytes.
"""

import io
import json
import math
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np

from rvqspec.core.errors import RvqspecError
from rvqspec.serve.audio import to_int16

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_CLIP_SECONDS = 60.0
MIN_CLIP_SECONDS = 0.5
MIN_RATE, MAX_RATE = 8000, 48000  # Hz of an upload
MAX_CHANNELS = 2
CLIP_FORMATS = {"WAV", "WAVEX", "FLAC"}  # soundfile's names of wav and flac files
MAX_PEAK = 2.0  # past this a float clip is no recording (full scale is 1.0; a little over it is clipped)
MAX_VOICES = 100
VOICES_QUOTA = 1024 * 2 ** 20  # bytes of all voices together


class StoreFull(RvqspecError):
    """The voices quota is used up: delete voices, or raise the quota (a server answers 507)."""


class VoiceExists(RvqspecError):
    """A voice of that name is registered already: delete it first (a server answers 409)."""


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RvqspecError(f"name {str(name)[:80]!r} is not a voice name: use 1-64 letters, digits, '_' or '-'")
    return name


def probe_clip(data: bytes):
    """The clip's header (soundfile.info: nothing decoded), refused unless a wav or flac file within the limits."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        raise RvqspecError("audio is not a readable wav or flac file: send the clip's file, base64-encoded") from None
    if info.format not in CLIP_FORMATS:
        raise RvqspecError(f"audio is a {info.format} file: send wav or flac")
    if not MIN_RATE <= info.samplerate <= MAX_RATE:
        raise RvqspecError(f"audio's sample rate is {info.samplerate} Hz: send a clip at {MIN_RATE} to {MAX_RATE} Hz")
    if not 1 <= info.channels <= MAX_CHANNELS:
        raise RvqspecError(f"audio has {info.channels} channels: send a mono (or stereo) clip")
    check_seconds(info.frames / info.samplerate)
    return info


def check_seconds(seconds: float) -> None:
    if not MIN_CLIP_SECONDS <= seconds <= MAX_CLIP_SECONDS:
        raise RvqspecError(f"audio is {seconds:.2f} s long: send a clip of {MIN_CLIP_SECONDS} to "
                           f"{MAX_CLIP_SECONDS:.0f} s")


def decode_clip(data: bytes, sample_rate: int) -> np.ndarray:
    """A wav or flac file's bytes as mono 16-bit samples at `sample_rate` (the model's), bounded and checked: the
    header probed first, at most its frame count decoded, samples finite and within MAX_PEAK."""
    import soundfile

    info = probe_clip(data)
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as file:
            audio = file.read(frames=info.frames, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError):
        raise RvqspecError("audio could not be decoded (a damaged file): send the clip's file again") from None
    check_seconds(len(audio) / info.samplerate)  # a header that claims more than the file holds
    if not np.isfinite(audio).all():
        raise RvqspecError("audio holds nan or inf samples: send a recording (finite samples)")
    peak = float(np.abs(audio).max())
    if peak == 0:
        raise RvqspecError("audio is silent (every sample 0): send a recording of the voice")
    if peak > MAX_PEAK:
        raise RvqspecError(f"audio's peak is {peak:.3g} (full scale is 1.0): send a recording of the voice, "
                           "normalised to full scale at most")
    return to_int16(resample(audio.mean(axis=1), info.samplerate, sample_rate))


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Polyphase resampling by the exact ratio (scipy's resample_poly)."""
    if rate == target:
        return audio
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return resample_poly(audio, target // g, rate // g).astype(np.float32)


def samples(pcm: np.ndarray) -> np.ndarray:
    """16-bit samples as float32, as soundfile reads the stored file (x / 32768): the clone prompt made at
    registration is then the one a restarted server makes from the file."""
    return pcm.astype(np.float32) / 32768.0


class VoiceStore:
    """The registered voices, in one folder (as the module says); its methods may be called from several threads."""

    def __init__(self, folder: str | Path, max_voices: int = MAX_VOICES, quota: int = VOICES_QUOTA):
        self.folder, self.max_voices, self.quota = Path(folder), max_voices, quota
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prompts: dict[str, object] = {}
        self.lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir()
                      if NAME.fullmatch(p.name) and (p / "voice.json").is_file())

    def __contains__(self, name: str) -> bool:
        return NAME.fullmatch(name) is not None and (self.folder / name / "voice.json").is_file()

    def register(self, name: str, clip: bytes, transcript: str | None, engine) -> None:
        """Decode an uploaded wav or flac file (bounded: `decode_clip`), make `engine`'s clone prompt of it (refused
        here rather than at the first synthesis), store both (`add`)."""
        pcm = decode_clip(clip, engine.sample_rate)
        prompt = engine.clone_prompt(samples(pcm), engine.sample_rate, transcript)
        self.add(name, pcm, engine.sample_rate, transcript, prompt)

    def add(self, name: str, pcm: np.ndarray, sample_rate: int, transcript: str | None, prompt: object) -> None:
        """Store a voice (16-bit samples) and its clone prompt; VoiceExists if the name is taken (it is never
        overwritten: delete it first), StoreFull past the quota."""
        import soundfile

        target = self.folder / check_name(name)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=self.folder))
        try:
            soundfile.write(staging / "audio.wav", pcm, sample_rate, subtype="PCM_16")
            (staging / "voice.json").write_text(json.dumps({"transcript": transcript, "sample_rate": sample_rate}))
            with self.lock:  # the quota checked and the voice renamed in at once
                self.check_room(folder_bytes(staging))
                try:
                    os.rename(staging, target)  # atomic; fails if the name exists (a non-empty folder)
                except OSError:
                    raise VoiceExists(f"voice {name!r} already exists: DELETE /v1/audio/voices/{name} first") \
                        from None
                self.prompts[name] = prompt
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def check_room(self, size: int) -> None:
        names = self.names()
        if len(names) >= self.max_voices:
            raise StoreFull(f"the server holds {len(names)} voices, its most (--max-voices): delete one "
                            "(DELETE /v1/audio/voices/NAME), or restart it with a higher --max-voices")
        used = sum(folder_bytes(self.folder / name) for name in names)
        if used + size > self.quota:
            raise StoreFull(f"the voices use {used / 2 ** 20:.1f} MiB of the {self.quota / 2 ** 20:.0f} MiB quota, "
                            f"this one needs {size / 2 ** 20:.1f} MiB: delete voices, or restart the server with a "
                            "higher --voices-quota")

    def delete(self, name: str) -> bool:
        """Remove a voice; False if there was none of that name."""
        if name not in self:
            return False
        doomed = Path(tempfile.mkdtemp(prefix=".del-", dir=self.folder)) / name
        try:
            os.rename(self.folder / name, doomed)
        except FileNotFoundError:  # deleted meanwhile
            return False
        finally:
            with self.lock:
                self.prompts.pop(name, None)
            shutil.rmtree(doomed.parent, ignore_errors=True)
        return True

    def prompt(self, name: str, engine) -> object:
        """The engine's clone prompt for a stored voice (computed once per voice)."""
        import soundfile

        with self.lock:
            if name in self.prompts:
                return self.prompts[name]
        folder = self.folder / name
        meta = json.loads((folder / "voice.json").read_text())
        audio, sample_rate = soundfile.read(folder / "audio.wav", dtype="float32")
        prompt = engine.clone_prompt(audio, sample_rate, meta["transcript"])
        with self.lock:
            return self.prompts.setdefault(name, prompt)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
