"""The tests' side of the tiny qwen-tts system: a float64 variant, text ids, saving it as a checkpoint folder, a
random wav. The system itself (`tiny_qwen3_tts`, its parts and constants) is built by rvqspec.bench.upstream, shared
with benchmarks/, and re-exported here."""

import json
from pathlib import Path

import numpy as np
import torch

from rvqspec.bench.upstream import (  # noqa: F401 - the builders, for the tests that import them from here
    CODEBOOK, FRAME_SAMPLES, SAMPLE_RATE, tiny_qwen3_tts, tiny_speech_tokenizer, tiny_text_processor,
    tiny_tts_config_dict)


def tiny_qwen3_tts64(seed: int = 1):
    """The tiny qwen-tts with its speech tokenizer's decoder in float64: streamed and whole decodes then agree to
    1e-6 (tests/test_streaming.py)."""
    tts = tiny_qwen3_tts(seed=seed)
    tts.model.speech_tokenizer.model.double()
    return tts


def text_ids(text: str) -> torch.Tensor:
    """Ids [1, L] of `text` in the chat layout upstream's entry points use."""
    chat = f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tiny_text_processor()(text=chat, return_tensors="pt")["input_ids"]


def save_checkpoint(tts, folder: Path, generate_defaults: dict) -> Path:
    """Write `tts` as a checkpoint folder that `Qwen3TTSModel.from_pretrained` loads, laid out like the real
    ones: config.json + weights, generation_config.json, text tokenizer files, speech_tokenizer/."""
    tts.model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["speaker_encoder_config"].pop("model_type")  # upstream's save writes it, its config class rejects it
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(generate_defaults))
    tts.processor.save_pretrained(folder)
    speech_tokenizer = tts.model.speech_tokenizer
    speech_tokenizer.model.save_pretrained(folder / "speech_tokenizer")
    speech_tokenizer.feature_extractor.save_pretrained(folder / "speech_tokenizer")
    return folder


def write_wav(path, seconds: float, seed: int) -> None:
    import soundfile

    rng = np.random.default_rng(seed)
    soundfile.write(path, (0.1 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32), SAMPLE_RATE)
