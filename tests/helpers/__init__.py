"""Fixtures shared by the tests: tiny models and configs, synthetic frames, tiny upstream (qwen-tts, transformers CSM) and stand-in systems."""
