"""rvqspec: RVQ position-aware speculative decoding for the depth decoders of Qwen3-TTS, Sesame CSM and the like."""

import os
import sys

# OpenMP workers that sleep between parallel regions: an Engine on 2+ cores runs its frame loop and its codec worker
# side by side, and a spinning worker of one takes the other's core (runtime/threads.py, `warn_if_openmp_spins`).
# libgomp reads the policy once, when torch loads: set here, before the imports below load torch, unless torch has
# loaded already (too late: the Engine warns) or the user chose a policy (as the `rvqspec` command does).
if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from rvqspec.core.config import CSM_1B, QWEN3_TTS_0_6B, QWEN3_TTS_1_7B, PredictorConfig
from rvqspec.core.decode import BatchResult, FrameResult, RoundStats, decode_frame, decode_frames
from rvqspec.core.drafters import MedusaHeads, Offsets, ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.policy import Policy
from rvqspec.core.quantize import quantize
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree, default_tree
from rvqspec.integrations import accelerate, deaccelerate
from rvqspec.runtime import Engine, QueueFull, TextStream

__all__ = ["PredictorConfig", "QWEN3_TTS_0_6B", "QWEN3_TTS_1_7B", "CSM_1B", "BatchResult", "FrameResult", "RoundStats",
           "decode_frame", "decode_frames",
           "MedusaHeads", "Offsets", "ReusedHeads", "RvqspecError", "MultiCodeDecoder", "Sampler", "Tree",
           "default_tree", "Policy", "accelerate", "deaccelerate", "quantize", "Engine", "QueueFull",
           "TextStream"]
