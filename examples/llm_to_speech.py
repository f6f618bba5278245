"""An LLM's answer spoken as it is written: the deltas of an OpenAI-compatible chat stream go to `rvqspec serve`'s
WebSocket (/v1/audio/speech/stream) as they come, and the audio it sends back is written to a wav file as it comes.

    rvqspec serve --model /path/to/Qwen3-TTS-12Hz-0.6B-CustomVoice &
    OPENAI_BASE_URL=http://localhost:11434/v1 OPENAI_API_KEY=unused \\
        python examples/llm_to_speech.py --llm-model qwen3:4b --voice Vivian "Tell me about the sea." answer.wav

Needs `openai` and `websockets` (pip install openai websockets). The speech server's key, if it has one:
RVQSPEC_API_KEY. The protocol: docs/live-speech.md.
"""

import argparse
import asyncio
import json
import os
import wave

import openai
from websockets.asyncio.client import connect


async def llm_deltas(model: str, question: str):
    """The answer's text deltas as the LLM writes them."""
    client = openai.AsyncOpenAI()
    stream = await client.chat.completions.create(model=model, stream=True,
                                                  messages=[{"role": "user", "content": question}])
    async for event in stream:
        if event.choices and event.choices[0].delta.content:
            yield event.choices[0].delta.content


async def send_text(websocket, deltas) -> None:
    async for delta in deltas:
        await websocket.send(json.dumps({"type": "input.text", "text": delta}))
    await websocket.send(json.dumps({"type": "input.done"}))


async def speak(args) -> None:
    key = os.environ.get("RVQSPEC_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with connect(args.server, additional_headers=headers, max_size=None) as websocket:
        await websocket.send(json.dumps({"type": "session.config", "voice": args.voice, "language": args.language,
                                         "response_format": "pcm"}))
        sender = asyncio.create_task(send_text(websocket, llm_deltas(args.llm_model, args.question)))
        with wave.open(args.out, "wb") as wav:
            async for message in websocket:  # until the server closes the session
                if isinstance(message, bytes):
                    wav.writeframes(message)  # 16-bit mono PCM, as it is decoded
                    continue
                event = json.loads(message)
                if event["type"] == "audio.start":
                    wav.setnchannels(1)
                    wav.setsampwidth(2)
                    wav.setframerate(event["sample_rate"])
                    print(f"first audio ({event['mode']} mode, {event['model']})")
                elif event["type"] == "error":
                    raise SystemExit(f"speech server: {event['message']}")
        await sender


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question")
    p.add_argument("out", help="the wav file to write")
    p.add_argument("--llm-model", required=True, help="the chat model (OPENAI_BASE_URL's server)")
    p.add_argument("--server", default="ws://127.0.0.1:8000/v1/audio/speech/stream")
    p.add_argument("--voice", help="a voice of the speech server (GET /v1/audio/voices)")
    p.add_argument("--language", default="Auto")
    asyncio.run(speak(p.parse_args()))


if __name__ == "__main__":
    main()
