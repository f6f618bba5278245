"""Measurement: timing, acceptance-controlled models, the one-stream and batched benchmarks, their reports and the device file."""
