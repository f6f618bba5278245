"""The whole frame loop of a TTS model, serving many requests at once: `Engine` (engine.py) over the scheduler's
continuous batching (scheduler.py), requests and their audio (request.py), and one adapter per model family
(qwen_tts.py, standin.py). Above `engine/` and `integrations/`, which it uses; nothing below imports it."""

from rvqspec.runtime.engine import Engine
from rvqspec.runtime.request import QueueFull, Request

__all__ = ["Engine", "QueueFull", "Request"]
