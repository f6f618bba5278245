"""rvqspec: RVQ position-aware speculative decoding for the depth decoders of Qwen3-TTS, Sesame CSM and the like."""

from rvqspec.engine.config import CSM_1B, QWEN3_TTS_0_6B, QWEN3_TTS_1_7B, PredictorConfig
from rvqspec.engine.decode import BatchResult, FrameResult, RoundStats, decode_frame, decode_frames
from rvqspec.engine.drafters import MedusaHeads, Offsets, ReusedHeads
from rvqspec.engine.errors import RvqspecError
from rvqspec.engine.model import MultiCodeDecoder
from rvqspec.engine.policy import Policy
from rvqspec.engine.quantize import quantize
from rvqspec.engine.sampling import Sampler
from rvqspec.engine.tree import Tree, default_tree
from rvqspec.integrations import accelerate, deaccelerate
from rvqspec.runtime import Engine, QueueFull

__all__ = ["PredictorConfig", "QWEN3_TTS_0_6B", "QWEN3_TTS_1_7B", "CSM_1B", "BatchResult", "FrameResult", "RoundStats",
           "decode_frame", "decode_frames",
           "MedusaHeads", "Offsets", "ReusedHeads", "RvqspecError", "MultiCodeDecoder", "Sampler", "Tree",
           "default_tree", "Policy", "accelerate", "deaccelerate", "quantize", "Engine", "QueueFull"]
