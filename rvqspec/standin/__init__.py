"""The shipped stand-in TTS model: an offline multilingual speech corpus (speech.py), a mel-RVQ codec with 16
codebooks at 12.5 frames/s (codec.py), a mini talker (talker.py), its training and build, synthesis, Whisper
quality checks and the evaluation of rvqspec on it (evaluate.py)."""
