"""rvqspec: RVQ position-aware speculative decoding for the depth decoders of Qwen3-TTS, Sesame CSM and the like."""

from rvqspec.config import CSM_1B, QWEN3_TTS_0_6B, QWEN3_TTS_1_7B, PredictorConfig
from rvqspec.decode import BatchResult, FrameResult, RoundStats, decode_frame, decode_frames
from rvqspec.drafters import MedusaHeads, Offsets, ReusedHeads
from rvqspec.errors import RvqspecError
from rvqspec.integrations import accelerate, deaccelerate
from rvqspec.model import MultiCodeDecoder
from rvqspec.policy import Policy
from rvqspec.sampling import Sampler
from rvqspec.tree import Tree, default_tree

__all__ = ["PredictorConfig", "QWEN3_TTS_0_6B", "QWEN3_TTS_1_7B", "CSM_1B", "BatchResult", "FrameResult", "RoundStats",
           "decode_frame", "decode_frames",
           "MedusaHeads", "Offsets", "ReusedHeads", "RvqspecError", "MultiCodeDecoder", "Sampler", "Tree",
           "default_tree", "Policy", "accelerate", "deaccelerate"]
