"""Cloned voices: a reference clip and its transcript per name, kept in one server data folder.

Each voice is a folder `<name>/` holding `audio.wav` (float32) and `voice.json`, written under a temporary name and
renamed into place, so a voice is there whole or not at all, and two registrations of one name cannot both win.
A name is checked against NAME before it becomes a path; nothing else from a request reaches the file system.
The engine's clone prompt of a voice is computed on first use and cached.
"""

import io
import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np

from rvqspec.engine.errors import RvqspecError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_CLIP_SECONDS = 60.0
MIN_CLIP_SECONDS = 0.5
MAX_TRANSCRIPT = 2000  # characters


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RvqspecError(f"name {str(name)[:80]!r} is not a voice name: use 1-64 letters, digits, '_' or '-'")
    return name


def decode_clip(data: bytes) -> tuple[np.ndarray, int]:
    """(mono float32 samples, sample rate) of a wav or flac file's bytes, within the clip length limits."""
    import soundfile

    try:
        audio, sample_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise RvqspecError(f"audio is not a readable wav or flac file ({e}): send the clip's file, base64-encoded") \
            from None
    seconds = len(audio) / sample_rate
    if not MIN_CLIP_SECONDS <= seconds <= MAX_CLIP_SECONDS:
        raise RvqspecError(f"audio is {seconds:.2f} s long: send a clip of {MIN_CLIP_SECONDS} to "
                           f"{MAX_CLIP_SECONDS:.0f} s")
    return audio.mean(axis=1).astype(np.float32), int(sample_rate)


class VoiceStore:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prompts: dict[str, object] = {}
        self.lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir()
                      if NAME.fullmatch(p.name) and (p / "voice.json").is_file())

    def __contains__(self, name: str) -> bool:
        return NAME.fullmatch(name) is not None and (self.folder / name / "voice.json").is_file()

    def add(self, name: str, audio: np.ndarray, sample_rate: int, transcript: str | None) -> None:
        """Store a voice; RvqspecError if the name is taken (it is never overwritten: delete it first)."""
        import soundfile

        target = self.folder / check_name(name)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=self.folder))
        try:
            soundfile.write(staging / "audio.wav", audio, sample_rate, subtype="FLOAT")
            (staging / "voice.json").write_text(json.dumps({"transcript": transcript, "sample_rate": sample_rate}))
            try:
                os.rename(staging, target)  # atomic; fails if the name exists (a non-empty folder)
            except OSError:
                raise RvqspecError(f"voice {name!r} already exists: DELETE /v1/audio/voices/{name} first") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)

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
