"""Tuning a drafter for a checkpoint: code corpora (the format; from recordings), offsets/Medusa training, tree calibration."""
