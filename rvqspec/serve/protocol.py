"""The OpenAI speech API's protocol, apart from the routes (app.py): a request body's fields checked into what the
engine takes (`parse_speech`, `parse_voice`), and a refusal (`ApiError`) in OpenAI's error shape.

Every refusal is a JSON body {"error": {"message", "type", "param", "code"}} whose message names the field and the
fix; it always encodes (text the client sent is escaped where UTF-8 cannot hold it), and it holds no exception text
of the server's own (no reprs, no addresses: those go to the log).
"""

import base64
import binascii
import json
import math
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from rvqspec.core.errors import RvqspecError
from rvqspec.runtime.sentences import is_long
from rvqspec.serve.audio import FORMATS
from rvqspec.serve.voices import VoiceStore, check_name

MAX_INPUT = 4096  # characters of `input` (OpenAI's limit), of `instructions` and of a voice's `transcript`
SPEECH_FIELDS = {"model", "input", "voice", "response_format", "instructions", "speed", "stream_format", "seed",
                 "temperature", "top_k", "top_p", "language", "sentences", "non_streaming_mode"}
VOICE_FIELDS = {"name", "audio", "transcript"}
UNSUPPORTED_FORMATS = {"mp3", "opus", "aac"}


class ApiError(Exception):
    """A refusal: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        error = {"message": encodable(self.message), "type": self.kind, "param": encodable(self.param),
                 "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


def encodable(text: str | None) -> str | None:
    """`text` with what UTF-8 cannot encode (lone surrogates a client sent) backslash-escaped."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class Speech:
    """A checked speech request: the engine's arguments and how to send the audio."""

    args: dict = field(default_factory=dict)  # engine.speech keyword arguments
    response_format: str = "wav"
    stream_format: str = "audio"
    clone: str | None = None  # a registered voice's name

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.stream_format == "sse" else FORMATS[self.response_format]


@dataclass
class VoiceUpload:
    """A checked voice registration: the clip's file still undecoded (VoiceStore.register decodes it)."""

    name: str
    clip: bytes  # a wav or flac file
    transcript: str | None


# ---------------------------------------------------------------- fields

def json_object(data: bytes) -> dict:
    """A request body (bytes) as the JSON object it must be."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON: send a JSON object (Content-Type: application/json)") \
            from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body is a JSON {type(body).__name__}, not an object: send {{\"input\": ...}}")
    return body


def optional(body: dict, name: str, kind: type, default=None):
    """body[name] when present and not null, checked to be of `kind` (int: not a bool; float: any finite number)."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        word = {str: "a string", int: "an integer", float: "a finite number", bool: "true or false"}[kind]
        raise ApiError(400, f"{name} must be {word}, got {json.dumps(value)[:80]}: send {word} (or leave it out)",
                       param=name)
    if kind is str:
        check_text(name, value)
    return value


def check_text(name: str, text: str) -> None:
    """Refuse text UTF-8 cannot encode (a lone surrogate, as JSON's "\\ud800" escape gives): 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{name} holds an unpaired surrogate (U+{ord(text[e.start]):04X} at character "
                       f"{e.start}): send valid Unicode text", param=name) from None


def check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0][:80]!r}: the fields are {', '.join(sorted(known))}",
                       param=unknown[0][:80])


def check_range(name: str, value, ok: bool, allowed: str) -> None:
    if value is not None and not ok:
        raise ApiError(400, f"{name} is {value}: use {allowed}", param=name)


# ---------------------------------------------------------------- POST /v1/audio/speech

def parse_speech(body: dict, engine, voices: VoiceStore) -> Speech:
    """The request to `engine` that `body` asks for; ApiError at the first field at fault (in this order: unknown
    fields, model, input, formats, sampling, voice)."""
    check_fields(body, SPEECH_FIELDS)
    check_model(body, engine.name)
    text = check_input(body)
    speech = check_formats(Speech(response_format=optional(body, "response_format", str, "wav"),
                                  stream_format=optional(body, "stream_format", str, "audio")))
    sampling = parse_sampling(body)
    voice, speech.clone = parse_voice_choice(body, engine.voices(), voices)
    speech.args = dict(text=text, voice=voice, instructions=optional(body, "instructions", str),
                       language=optional(body, "language", str), **sampling,
                       sentences=optional(body, "sentences", bool, is_long(text)),
                       non_streaming_mode=optional(body, "non_streaming_mode", bool))
    return speech


def check_model(body: dict, served: str) -> None:
    model = optional(body, "model", str)
    if model is None:
        raise ApiError(400, f"model is missing: send \"model\": \"{served}\" (GET /v1/models)", param="model")
    if model != served:
        raise ApiError(404, f"model {model[:80]!r} is not served here: use {served!r} (GET /v1/models)",
                       param="model", code="model_not_found")


def check_input(body: dict) -> str:
    """The text to speak: not empty, and it and the instructions within MAX_INPUT characters."""
    text = optional(body, "input", str, "")
    if not text.strip():
        raise ApiError(400, "input is missing or empty: send the text to speak", param="input")
    for name in ("input", "instructions"):
        if len(optional(body, name, str, "")) > MAX_INPUT:
            raise ApiError(400, f"{name} is over {MAX_INPUT} characters: split the text into several requests",
                           param=name)
    return text


def check_formats(speech: Speech) -> Speech:
    if speech.response_format not in FORMATS:
        extra = " (no mp3/opus/aac encoder here)" if speech.response_format in UNSUPPORTED_FORMATS else ""
        raise ApiError(400, f"response_format {speech.response_format[:40]!r} is not supported{extra}: use "
                       f"{', '.join(FORMATS)}", param="response_format")
    if speech.stream_format not in ("audio", "sse"):
        raise ApiError(400, f"stream_format {speech.stream_format[:40]!r}: use 'audio' or 'sse'", param="stream_format")
    return speech


def parse_sampling(body: dict) -> dict:
    """The engine's sampling arguments (seed, temperature, top_k, top_p), each None when not sent; speed only 1.0."""
    speed = optional(body, "speed", float, 1.0)
    check_range("speed", speed, speed == 1.0, "1.0 (this server does not change the speaking rate)")
    seed, top_k = optional(body, "seed", int), optional(body, "top_k", int)
    temperature, top_p = optional(body, "temperature", float), optional(body, "top_p", float)
    check_range("seed", seed, seed is not None and 0 <= seed < 2 ** 63, "an integer from 0 to 2**63 - 1")
    check_range("temperature", temperature, temperature is not None and 0 < temperature <= 100, "a number in (0, 100]")
    check_range("top_k", top_k, top_k is not None and top_k >= 1, "an integer >= 1")
    check_range("top_p", top_p, top_p is not None and 0 < top_p <= 1, "a number in (0, 1]")
    return dict(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)


def parse_voice_choice(body: dict, builtin: list[str], voices: VoiceStore) -> tuple[str | None, str | None]:
    """(the built-in voice, the registered voice's name) that `voice` names: one of them, or neither (not sent)."""
    voice = optional(body, "voice", str)
    if voice is None or voice in builtin:
        return voice, None
    if voice not in voices:
        listed = ", ".join(builtin + voices.names()) or "none"
        raise ApiError(400, f"voice {voice[:80]!r} is not a voice of this server: use one of {listed} "
                       "(GET /v1/audio/voices), or register it (POST /v1/audio/voices)", param="voice")
    return None, voice


# ---------------------------------------------------------------- POST /v1/audio/voices

def parse_voice(body: dict, builtin: list[str]) -> VoiceUpload:
    """The registration `body` asks for (a name none of the `builtin` voices has, a base64 clip, its transcript)."""
    check_fields(body, VOICE_FIELDS)
    name, audio = optional(body, "name", str), optional(body, "audio", str)
    transcript = optional(body, "transcript", str)
    try:
        check_name(name)
    except RvqspecError as e:
        raise ApiError(400, str(e), param="name") from None
    if name in builtin:
        raise ApiError(400, f"{name!r} is a built-in voice: pick another name", param="name")
    if transcript is not None and len(transcript) > MAX_INPUT:
        raise ApiError(400, f"transcript is over {MAX_INPUT} characters: send the clip's words", param="transcript")
    if not audio:
        raise ApiError(400, "audio is missing: send the clip's wav or flac file, base64-encoded", param="audio")
    try:
        clip = base64.b64decode("".join(audio.split()), validate=True)  # line breaks (base64's output) allowed
    except binascii.Error:
        raise ApiError(400, "audio is not base64: send the clip's wav or flac file, base64-encoded", param="audio") \
            from None
    return VoiceUpload(name, clip, transcript)
