"""Upstream qwen-tts models with random weights and small configs (no download), for the tests and the benchmarks.

`tiny_upstream_model(...)` / `upstream_model_like(config)`: upstream's own `Qwen3TTSForConditionalGeneration` around a
code predictor of given sizes (a one-layer talker); `tiny_qwen3_tts()`: a whole tiny text-to-speech system (talker +
predictor, 12 Hz speech tokenizer, a character-level text tokenizer) in upstream's `Qwen3TTSModel`. On top of
`upstream_config_dict` the system changes only what upstream's text-to-speech path needs: codec special tokens inside
the talker vocabulary (upstream suppresses the top 1024 ids but EOS, so the talker vocabulary is codebook + 1024 and
the specials sit in that top range), and the text model's special ids inside a small text vocabulary. qwen-tts and
transformers are imported when a builder runs (the `ref` extra), never on import.
"""

import math

import torch

from rvqspec.integrations.qwen_tts import import_qwen_tts

CODEBOOK = 32  # codes per codebook: predictor vocabulary and speech tokenizer codebooks
SPECIALS = 1024  # upstream suppresses the talker's last 1024 ids (all but EOS) while sampling c0
TEXT_VOCAB = 64
TEXT_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "assistant", "user", "\n"]  # text ids 0..4
TTS_PAD, TTS_BOS, TTS_EOS = 61, 62, 63
SAMPLE_RATE = 24000
FRAME_SAMPLES = 1920  # 12.5 frames a second


def upstream_classes():
    """(Qwen3TTSConfig, Qwen3TTSForConditionalGeneration) from the installed qwen-tts."""
    models = import_qwen_tts().core.models
    return models.Qwen3TTSConfig, models.Qwen3TTSForConditionalGeneration


def upstream_config_dict(talker_hidden: int, predictor_hidden: int, vocab: int, groups: int,
                         predictor_layers: int = 2, predictor_heads: int = 4, predictor_kv_heads: int = 2,
                         predictor_head_dim: int = 16, predictor_intermediate: int | None = None,
                         talker_vocab: int = 96, rope_theta: float = 1e6) -> dict:
    """A Qwen3TTSConfig dict: a one-layer talker of width `talker_hidden` around a code predictor of the
    given size. The talker only has to exist (its c0 table and hidden size matter to the predictor)."""
    talker_heads = 4
    talker_head_dim = talker_hidden // talker_heads
    half = talker_head_dim // 2  # M-RoPE: mrope_section must sum to head_dim / 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    predictor = dict(
        vocab_size=vocab, hidden_size=predictor_hidden, num_hidden_layers=predictor_layers,
        intermediate_size=predictor_intermediate or 3 * predictor_hidden, num_attention_heads=predictor_heads,
        num_key_value_heads=predictor_kv_heads, head_dim=predictor_head_dim, rope_theta=rope_theta,
        num_code_groups=groups, rms_norm_eps=1e-6)
    talker = dict(
        code_predictor_config=predictor, vocab_size=talker_vocab, hidden_size=talker_hidden,
        intermediate_size=2 * talker_hidden, num_hidden_layers=1, num_attention_heads=talker_heads,
        num_key_value_heads=2, num_code_groups=groups, text_hidden_size=32, text_vocab_size=16,
        rope_scaling={"rope_type": "default", "mrope_section": mrope_section, "interleaved": False},
        spk_id={"tiny": 0}, spk_is_dialect={"tiny": False}, codec_language_id={"english": 1})
    return dict(talker_config=talker, tts_model_type="custom_voice", tokenizer_type="qwen3_tts_tokenizer_12hz",
                tts_model_size="tiny")


def tiny_upstream_model(seed: int = 0, talker_hidden: int = 64, predictor_hidden: int = 64, vocab: int = 32,
                        groups: int = 16, head_scale: float = 1.0, **predictor) -> torch.nn.Module:
    """Upstream `Qwen3TTSForConditionalGeneration` with random weights (std 0.02), float32, eval mode.

    `head_scale` multiplies the predictor's lm_heads: with std-0.02 weights the logits of a tiny model are
    nearly flat, which makes sampling tests weak (every warper keeps almost everything) and greedy
    comparisons fragile (near-ties); a larger scale spreads them out.
    """
    config_cls, model_cls = upstream_classes()
    config = config_cls(**upstream_config_dict(talker_hidden, predictor_hidden, vocab, groups, **predictor))
    torch.manual_seed(seed)
    model = model_cls(config).float().eval().requires_grad_(False)
    for head in model.talker.code_predictor.lm_head:
        head.weight.mul_(head_scale)
    return model


def upstream_model_like(config, seed: int = 0) -> torch.nn.Module:
    """Upstream model (random weights, float32, eval) whose code predictor has the sizes of `config`, an
    `rvqspec.PredictorConfig` such as `rvqspec.QWEN3_TTS_0_6B`; the talker around it has one layer."""
    return tiny_upstream_model(
        seed, talker_hidden=config.talker_hidden_size, predictor_hidden=config.hidden_size, vocab=config.vocab_size,
        groups=config.num_code_groups, predictor_layers=config.num_hidden_layers,
        predictor_heads=config.num_attention_heads, predictor_kv_heads=config.num_key_value_heads,
        predictor_head_dim=config.head_dim, predictor_intermediate=config.intermediate_size,
        talker_vocab=config.talker_vocab_size, rope_theta=config.rope_theta)


def frame_prompt(model: torch.nn.Module, talker_hidden: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    """The predictor's prefill input [B, 2, talker_hidden] as upstream's talker builds it:
    cat(talker hidden state, talker codec_embedding(c0)). talker_hidden [B, H], c0 [B]."""
    return torch.cat([talker_hidden[:, None], model.talker.get_input_embeddings()(c0[:, None])], dim=1)


def upstream_generate(model: torch.nn.Module, talker_hidden: torch.Tensor, c0: torch.Tensor, sampler) -> torch.Tensor:
    """Codes [B, G-1] from upstream `talker.code_predictor.generate`, called as upstream's talker calls it,
    with an `rvqspec.Sampler`'s settings."""
    predictor = model.talker.code_predictor
    settings = dict(do_sample=True, top_k=sampler.top_k, top_p=sampler.top_p, temperature=sampler.temperature) \
        if sampler.do_sample else dict(do_sample=False)
    return predictor.generate(inputs_embeds=frame_prompt(model, talker_hidden, c0),
                              max_new_tokens=predictor.config.num_code_groups - 1, **settings)


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
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from transformers import EncodecFeatureExtractor

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
    make_audible(model.decoder)
    tokenizer = qwen_tts.Qwen3TTSTokenizer()
    tokenizer.model, tokenizer.config, tokenizer.device = model.eval(), model.config, torch.device("cpu")
    tokenizer.feature_extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE)
    return tokenizer


@torch.no_grad()
def make_audible(decoder, seed: int = 0) -> None:
    """Weights that keep the signal's scale through the decoder (std 0.02 leaves ~1e-8 of audio, where any
    waveform comparison passes): fan-in scaled layers, damped residual branches, the output at std ~0.2."""
    torch.manual_seed(seed)
    for name, tensor in [*decoder.named_buffers(), *decoder.named_parameters()]:
        if name.endswith("embedding_sum"):  # codebooks start at zero: every code would decode to silence
            tensor.normal_()
    for module in decoder.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Linear)):
            module.weight.normal_(0, 1 / math.sqrt(module.weight[0].numel()))
        if isinstance(module, torch.nn.ConvTranspose1d):
            fan_in = module.weight.shape[0] * module.weight.shape[2] / module.stride[0]
            module.weight.normal_(0, 1 / math.sqrt(fan_in))
        if type(module).__name__ == "Qwen3TTSTokenizerV2DecoderDecoderResidualUnit":
            module.conv2.conv.weight.mul_(0.1)
    last, outputs = decoder.decoder[-1], []
    hook = last.register_forward_hook(lambda module, inputs, output: outputs.append(output))  # before the clamp
    decoder(torch.randint(0, CODEBOOK, (1, decoder.config.num_quantizers, 40)))
    hook.remove()
    last.conv.weight.mul_(0.2 / float(outputs[0].std()))


def tiny_text_processor():
    """Upstream's `Qwen3TTSProcessor` around a real `Qwen2TokenizerFast` with a tiny vocabulary: the chat
    special tokens, then one token per letter or punctuation mark (text ids < TEXT_VOCAB)."""
    import_qwen_tts()
    from qwen_tts.core.models import Qwen3TTSProcessor
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {token: i for i, token in enumerate([*TEXT_SPECIAL_TOKENS, *"abcdefghijklmnopqrstuvwxyz ,.'!?/", "[UNK]"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per character
    tokenizer = Qwen2TokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["assistant", "user", "\n"])
    return Qwen3TTSProcessor(tokenizer=tokenizer)


def tiny_qwen3_tts(seed: int = 0, model_type: str = "custom_voice"):
    """Upstream's user-facing `Qwen3TTSModel` around the tiny model, speech tokenizer and text processor."""
    qwen_tts = import_qwen_tts()
    model = tiny_tts_model(seed, model_type=model_type)
    model.load_speech_tokenizer(tiny_speech_tokenizer(seed))
    return qwen_tts.Qwen3TTSModel(model, tiny_text_processor(), generate_defaults={})
