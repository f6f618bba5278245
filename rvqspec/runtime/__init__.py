"""The whole frame loop of a TTS model, serving many requests at once: `Engine` (engine.py) over the scheduler's
continuous batching (scheduler.py), requests and their audio (request.py), the codec workers that turn frames into
audio (codec_worker.py), text that arrives over time (live_text.py), admission at real time (capacity.py), the thread budget (threads.py), and one adapter per
model family (qwen_tts.py, csm.py, standin.py) under the contract in adapter.py. Its loop shares the frame-loop
toolkit of `accelerate()`'s (`core/frame_loop.py`: the policy's set-up, Stats, chunk clocks, polling, argument
checks). Above `core/`, `integrations/` (only to load and wrap upstream's models) and `standin/`, which it uses;
nothing below imports it."""

from rvqspec.runtime.engine import Engine
from rvqspec.runtime.live_text import TextStream
from rvqspec.runtime.request import QueueFull, Request

__all__ = ["Engine", "QueueFull", "Request", "TextStream"]
