"""Audio chunks (float32 mono) as the bytes of a response format, and as server-sent events.

wav and pcm stream: pcm is 16-bit signed little-endian samples at the model's rate (the `X-Sample-Rate` header
names it; OpenAI's is 24 kHz), wav the same samples after a header whose sizes say "unknown length" (0xFFFFFFFF),
as streamed wav is written, since the length is not known when the first bytes leave. flac is encoded once the
audio is complete: its header counts the samples.
"""

import base64
import io
import json
import struct
from collections.abc import Iterable

import numpy as np

FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}  # response_format -> media type
UNKNOWN_SIZE = 0xFFFFFFFF


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1] as 16-bit integers (clipped, rounded to nearest)."""
    return np.rint(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


def pcm_bytes(audio: np.ndarray) -> bytes:
    return to_int16(audio).tobytes()


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono PCM wav header of unknown length (RIFF and data sizes 0xFFFFFFFF)."""
    return (b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", UNKNOWN_SIZE))


def flac_bytes(chunks: Iterable[np.ndarray], sample_rate: int) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    audio = np.concatenate([np.zeros(0, np.float32), *chunks])
    soundfile.write(buffer, to_int16(audio), sample_rate, format="FLAC", subtype="PCM_16")
    return buffer.getvalue()


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def sse_delta(data: bytes) -> bytes:
    """One `speech.audio.delta` event: the next bytes of the response format, base64-encoded (OpenAI's shape)."""
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
