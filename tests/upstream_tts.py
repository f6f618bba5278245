"""A whole tiny qwen-tts system with random weights (no download): talker + predictor, 12 Hz speech tokenizer,
a character-level text processor, wrapped in upstream's own `Qwen3TTSModel`.

Builds on `upstream_models.upstream_config_dict` and changes only what upstream's text-to-speech path needs
on top of it: codec special tokens inside the talker vocabulary (upstream suppresses the top 1024 ids but
EOS, so the talker vocabulary is codebook + 1024 and the specials sit in that top range), and the text
model's special ids inside a small text vocabulary.
"""

import re

import numpy as np
import torch

from rvqspec.integrations.qwen_tts import import_qwen_tts
from upstream_models import upstream_config_dict

CODEBOOK = 32  # codes per codebook: predictor vocabulary and speech tokenizer codebooks
SPECIALS = 1024  # upstream suppresses the talker's last 1024 ids (all but EOS) while sampling c0
TEXT_VOCAB = 64
TEXT_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "assistant", "user", "\n"]  # text ids 0..4
TTS_PAD, TTS_BOS, TTS_EOS = 61, 62, 63
SAMPLE_RATE = 24000
FRAME_SAMPLES = 1920  # 12.5 frames a second


def tiny_tts_config_dict(model_type: str = "custom_voice", talker_layers: int = 1) -> dict:
    config = upstream_config_dict(talker_hidden=64, predictor_hidden=64, vocab=CODEBOOK, groups=16,
                                  talker_vocab=CODEBOOK + SPECIALS)
    first = CODEBOOK + 8  # codec specials, all inside the suppressed range
    config["talker_config"].update(
        num_hidden_layers=talker_layers, text_vocab_size=TEXT_VOCAB, codec_pad_id=first, codec_bos_id=first + 1,
        codec_eos_token_id=first + 2, codec_think_id=first + 3, codec_nothink_id=first + 4,
        codec_think_bos_id=first + 5, codec_think_eos_id=first + 6, codec_language_id={"english": first + 7},
        spk_id={"tiny": first + 8}, spk_is_dialect={"tiny": False})
    config.update(tts_model_type=model_type, tts_pad_token_id=TTS_PAD, tts_bos_token_id=TTS_BOS,
                  tts_eos_token_id=TTS_EOS, im_start_token_id=0, im_end_token_id=1,
                  # Base (voice clone) models: the x-vector goes into the talker, so enc_dim = talker width
                  speaker_encoder_config=dict(enc_dim=64, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16,
                                              enc_res2net_scale=4, enc_se_channels=16))
    return config


def tiny_tts_model(seed: int = 0, head_scale: float = 20.0, model_type: str = "custom_voice") -> torch.nn.Module:
    """Upstream `Qwen3TTSForConditionalGeneration`, random weights (std 0.02), float32, eval.

    `head_scale` multiplies the predictor's and the talker's output heads so that greedy choices are far
    from ties (float differences between two implementations cannot flip them) and sampling is peaked."""
    qwen_tts = import_qwen_tts()
    config = qwen_tts.core.models.Qwen3TTSConfig(**tiny_tts_config_dict(model_type))
    torch.manual_seed(seed)
    model = qwen_tts.core.models.Qwen3TTSForConditionalGeneration(config).float().eval().requires_grad_(False)
    for head in [*model.talker.code_predictor.lm_head, model.talker.codec_head]:
        head.weight.mul_(head_scale)
    return model


def tiny_speech_tokenizer(seed: int = 0):
    """Upstream's `Qwen3TTSTokenizer` around a tiny random 12 Hz model (Mimi encoder, 16 codebooks of 32)."""
    qwen_tts = import_qwen_tts()
    from transformers import EncodecFeatureExtractor

    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

    encoder = dict(hidden_size=32, num_filters=4, num_residual_layers=1, codebook_size=CODEBOOK, codebook_dim=16,
                   num_quantizers=16, num_semantic_quantizers=1, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, intermediate_size=64, frame_rate=12.5, upsample_groups=32,
                   vector_quantization_hidden_dimension=16)
    decoder = dict(codebook_size=CODEBOOK, codebook_dim=16, hidden_size=32, latent_dim=32, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, intermediate_size=64, num_hidden_layers=1, decoder_dim=32)
    torch.manual_seed(seed)
    model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(encoder_config=encoder, decoder_config=decoder))
    with torch.no_grad():  # codebooks start at zero (every frame would get code 0): spread them out
        for name, tensor in model.named_buffers():
            if name.endswith("embed_sum"):
                tensor.normal_()
        for name, tensor in model.named_parameters():
            if name.endswith("embedding_sum"):
                tensor.normal_()
    tokenizer = qwen_tts.Qwen3TTSTokenizer()
    tokenizer.model, tokenizer.config, tokenizer.device = model.eval(), model.config, torch.device("cpu")
    tokenizer.feature_extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE)
    return tokenizer


class CharProcessor:
    """Text processor for the tiny model: its special tokens, then one id per character (ids 5..60)."""

    pattern = re.compile("|".join(re.escape(t) for t in TEXT_SPECIAL_TOKENS) + "|.", re.DOTALL)

    def ids(self, text: str) -> list[int]:
        pieces = self.pattern.findall(text)
        return [TEXT_SPECIAL_TOKENS.index(p) if p in TEXT_SPECIAL_TOKENS else 5 + ord(p) % (TTS_PAD - 5)
                for p in pieces]

    def __call__(self, text, return_tensors=None, padding=None):
        texts = text if isinstance(text, list) else [text]
        return {"input_ids": torch.tensor([self.ids(t) for t in texts])}


def tiny_qwen3_tts(seed: int = 0, model_type: str = "custom_voice"):
    """Upstream's user-facing `Qwen3TTSModel` around the tiny model, tokenizer and processor."""
    qwen_tts = import_qwen_tts()
    model = tiny_tts_model(seed, model_type=model_type)
    model.load_speech_tokenizer(tiny_speech_tokenizer(seed))
    return qwen_tts.Qwen3TTSModel(model, CharProcessor(), generate_defaults={})


def text_ids(text: str) -> torch.Tensor:
    """Ids [1, L] of `text` in the chat layout upstream's entry points use."""
    return CharProcessor()(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]


def write_wav(path, seconds: float, seed: int) -> None:
    import soundfile

    rng = np.random.default_rng(seed)
    soundfile.write(path, (0.1 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32), SAMPLE_RATE)
