"""The stand-in TTS model's data side: an offline multilingual corpus (corpus.py), a mel-RVQ codec
with 16 codebooks at 12.5 frames/s (codec.py) and its Whisper-WER check (quality.py)."""
