"""The stand-in Qwen3-TTS: a small Qwen3-style talker plus the project's MultiCodeDecoder.

Sequence of the talker (non-streaming: the whole text first, then the audio frames):

    index     0      1 .. B        B+1    B+2 .. B+1+T
    input     lang   text bytes    bos    frame 0 .. frame T-1
    output                         c0(0)  c0(1) .. c0(T-1), eos
    RoPE id   0      1 .. B        0      round((t + 1) * s), s = mean text bytes per frame of the language

The language and bos tokens are rows of the talker's codec table (upstream: `codec_language_id`,
`codec_bos_id`), text bytes rows of `text_embedding`; a frame's input is the sum of the embeddings of
its 16 codes, c0 through the talker's codec table and c1..c15 through the predictor's codec tables, as
upstream. The talker's final hidden state at the position that emits c0(t) conditions the predictor
for frame t (its position 0).

One table, shared: the talker's c0 table and the 15 codec tables are the predictor's stacked
`code_embed` (rows 0..talker_vocab-1 are the talker's table), so `StandinTTS` reads them from the
predictor and the saved checkpoint holds each tensor once, under the official names.

Deviations from upstream, all to keep the stand-in small and trainable on a CPU in minutes: plain
1-D RoPE instead of M-RoPE, with text-aligned ids for the audio frames (frame t sits near the bytes it
likely speaks, a prior that lets a small talker learn its alignment from 3 hours of speech; upstream
numbers the tokens in order); UTF-8 bytes instead of the Qwen text tokenizer, embedded at the talker
width without `text_projection`; no speaker/instruct tokens.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from rvqspec.core.checkpoint import PREDICTOR, official_layout, official_state_dict, read_tensors, save_predictor
from rvqspec.core.config import PredictorConfig
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import Block, KVCache, MultiCodeDecoder, RMSNorm, RotaryEmbedding, init_weights, resolve_dtype

TALKER = "talker."


@dataclass(frozen=True)
class TalkerConfig:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    text_vocab_size: int = 256  # UTF-8 bytes
    num_codes: int = 512  # codebook size of c0 (the codec's first codebook)
    languages: tuple[str, ...] = ("en", "de", "es", "ru")
    bytes_per_frame: tuple[float, ...] = ()  # mean text bytes per 80 ms frame, per language (1.0 if absent)

    # Special rows of the talker's codec table, after the codes (as upstream: codes, then specials).
    @property
    def codec_pad_id(self) -> int:
        return self.num_codes

    @property
    def codec_bos_id(self) -> int:
        return self.num_codes + 1

    @property
    def codec_eos_token_id(self) -> int:
        return self.num_codes + 2

    @property
    def codec_language_id(self) -> dict[str, int]:
        return {lang: self.num_codes + 3 + i for i, lang in enumerate(self.languages)}

    def frame_step(self, lang: str) -> float:
        """How far (in text bytes) the RoPE position advances per audio frame, for `lang`."""
        return dict(zip(self.languages, self.bytes_per_frame)).get(lang, 1.0)

    @property
    def vocab_size(self) -> int:
        return self.num_codes + 3 + len(self.languages)

    def upstream_fields(self) -> dict:
        """The talker_config fields of config.json (upstream names where upstream has them)."""
        fields = asdict(self)
        fields.pop("num_codes")
        fields["languages"] = list(self.languages)
        fields["bytes_per_frame"] = list(self.bytes_per_frame)
        fields.update(text_hidden_size=self.hidden_size, codec_pad_id=self.codec_pad_id,
                      codec_bos_id=self.codec_bos_id, codec_eos_token_id=self.codec_eos_token_id,
                      codec_language_id=self.codec_language_id, rope_scaling=None,
                      position_encoding="1-D RoPE (stand-in; upstream uses M-RoPE)")
        return fields

    @classmethod
    def from_upstream(cls, talker: dict) -> "TalkerConfig":
        try:
            languages = tuple(talker["languages"])
            bytes_per_frame = tuple(talker["bytes_per_frame"])
            num_codes = talker["vocab_size"] - 3 - len(languages)
            values = {k: talker[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                              "text_vocab_size")}
        except KeyError as e:
            raise RvqspecError(f"config.json talker_config lacks {e.args[0]!r}: this folder holds a code predictor "
                               "but not a stand-in talker (rebuild it with `rvqspec standin build`)") from None
        config = cls(num_codes=num_codes, languages=languages, bytes_per_frame=bytes_per_frame, **values)
        if talker.get("codec_eos_token_id") != config.codec_eos_token_id:
            raise RvqspecError("config.json talker_config has an unexpected special-token layout: "
                               "rebuild the stand-in with `rvqspec standin build`")
        return config


def predictor_config_for(talker: TalkerConfig, **sizes) -> PredictorConfig:
    """A predictor config that fits `talker` (16 groups of `talker.num_codes` codes); `sizes` set its width/depth."""
    return PredictorConfig(vocab_size=talker.num_codes, num_code_groups=16, talker_hidden_size=talker.hidden_size,
                           talker_vocab_size=talker.vocab_size, **sizes)


class Talker(nn.Module):
    """The talker's own weights: text table, decoder layers, final norm and the c0 head."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = c = config
        self.text_embed = nn.Embedding(c.text_vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            Block(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                  c.rms_norm_eps, qk_norm=True) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.codec_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self.cache: KVCache | None = None
        self.apply(init_weights)

    def setup_cache(self, slots: int) -> KVCache:
        c, weight = self.config, self.norm.weight
        self.cache = KVCache(c.num_hidden_layers, 1, c.num_key_value_heads, slots, c.head_dim, weight.dtype,
                             weight.device)
        return self.cache

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None = None, slots: Tensor | None = None) -> Tensor:
        """Final-norm hidden states [B, T, H]; causal over x without `slots`, else through the cache.

        `positions` ([T], or [B, T] for per-row positions) are RoPE ids, not the order of the tokens."""
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise RvqspecError(f"RoPE position {int(positions.max())} exceeds the talker's "
                               f"{self.config.max_position_embeddings}: use a shorter text")
        cos, sin = self.rope(positions, x.dtype)
        cache = self.cache if slots is not None else None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, slots)
        return self.norm(x)


class StandinTTS(nn.Module):
    """Talker + code predictor sharing the predictor's stacked code table."""

    def __init__(self, talker: Talker, predictor: MultiCodeDecoder):
        super().__init__()
        if predictor.config.talker_hidden_size != talker.config.hidden_size \
                or predictor.config.talker_vocab_size != talker.config.vocab_size \
                or predictor.config.vocab_size != talker.config.num_codes:
            raise RvqspecError("talker and code predictor sizes disagree (talker hidden/vocab vs the predictor's "
                               "talker_hidden_size/talker_vocab_size/vocab_size): rebuild the stand-in")
        self.talker, self.predictor = talker, predictor

    @property
    def config(self) -> TalkerConfig:
        return self.talker.config

    def codec_embed(self, ids: Tensor) -> Tensor:
        """Rows of the talker's codec table (c0 codes and specials): table 0 of `code_embed`."""
        return self.predictor.code_embed(ids)

    def frame_embed(self, codes: Tensor) -> Tensor:
        """Talker input of frames with codes [..., 16]: the sum of their 16 code embeddings (raw, unprojected)."""
        return self.predictor.code_embed(self.predictor.table_offset + codes).sum(-2)

    def language_id(self, lang: str) -> int:
        ids = self.config.codec_language_id
        if lang not in ids:
            raise RvqspecError(f"language {lang!r} is not known to the stand-in: use one of {', '.join(ids)}")
        return ids[lang]

    def prefix_positions(self, prefix_length: int) -> Tensor:
        """RoPE ids of [lang, bytes..., bos]: lang 0, byte i at i+1, and bos at 0 (it stands for frame -1)."""
        positions = torch.arange(prefix_length, device=self.talker.norm.weight.device)
        positions[-1] = 0
        return positions

    def frame_positions(self, frames: Tensor, lang: str) -> Tensor:
        """RoPE ids of audio frames `frames` (indices t): round((t + 1) * bytes per frame) of `lang`.

        Text-aligned positions: frame t sits near the text bytes it is likely to speak, so that the small
        talker finds its alignment through relative positions in minutes of CPU training (upstream counts
        positions on, which a large model trained on much data can afford)."""
        return ((frames + 1) * self.config.frame_step(lang)).round().long()

    def prefix_embed(self, text: str, lang: str) -> Tensor:
        """[lang, UTF-8 bytes..., bos] embedded: [B+2, H]."""
        return self.prefix_embeds([text], [lang])[0]

    def prefix_embeds(self, texts: list[str], langs: list[str]) -> list[Tensor]:
        """`prefix_embed` of many texts, with one lookup per table (cheaper backward in training)."""
        data = [list(text.strip().encode("utf-8")) for text in texts]
        if not all(data):
            raise RvqspecError("empty text: pass a sentence to synthesize")
        device = self.talker.norm.weight.device
        special = torch.tensor([[self.language_id(lang), self.config.codec_bos_id] for lang in langs], device=device)
        special = self.codec_embed(special)
        text_bytes = self.talker.text_embed(torch.tensor(sum(data, []), device=device)).split([len(d) for d in data])
        return [torch.cat([s[:1], t, s[1:]]) for s, t in zip(special, text_bytes)]


# ---------------------------------------------------------------- checkpoint


def talker_layout(c: TalkerConfig) -> dict[str, tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """Talker native key -> official keys; the layers map like the predictor's, under `talker.model.`."""
    as_predictor = PredictorConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        talker_hidden_size=c.hidden_size)
    layout = {native: (how, [(name.replace(PREDICTOR, TALKER), shape) for name, shape in parts])
              for native, (how, parts) in official_layout(as_predictor).items()
              if native.startswith("layers.") or native == "norm.weight"}
    text_table = (TALKER + "model.text_embedding.weight", (c.text_vocab_size, c.hidden_size))
    layout["text_embed.weight"] = ("cat", [text_table])
    layout["codec_head.weight"] = ("cat", [(TALKER + "codec_head.weight", (c.vocab_size, c.hidden_size))])
    return layout


def save_standin(tts: StandinTTS, folder: str | Path, dtype: torch.dtype = torch.float16,
                 extra: dict | None = None) -> None:
    """config.json (upstream nested layout + talker fields) and model.safetensors (official keys) in `dtype`."""
    cast = lambda module: {k: v.to(dtype) for k, v in module.state_dict().items()}  # noqa: E731
    # casts of tts in the official layout; built without the meta device (see MultiCodeDecoder.from_official)
    predictor, talker = MultiCodeDecoder(tts.predictor.config), Talker(tts.config)
    predictor.load_state_dict(cast(tts.predictor), assign=True)
    talker.load_state_dict(cast(tts.talker), assign=True)
    stand_in = dict(extra or {}, torch_dtype=str(dtype).removeprefix("torch."))
    fields = tts.config.upstream_fields() | {"stand_in": stand_in}
    save_predictor(predictor, folder, fields, extra_tensors=official_state_dict(talker, talker_layout(talker.config)))


def load_standin(folder: str | Path, dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu") -> StandinTTS:
    """The talker and the predictor of a stand-in folder; the predictor loads through `from_pretrained`."""
    folder, dtype, device = Path(folder), resolve_dtype(dtype), torch.device(device)
    predictor = MultiCodeDecoder.from_pretrained(folder, dtype, device)
    config = TalkerConfig.from_upstream(json.loads((folder / "config.json").read_text())["talker_config"])
    layout = talker_layout(config)
    tensors = read_tensors(folder, {name: shape for _, parts in layout.values() for name, shape in parts}, dtype)
    state = {native: torch.cat([tensors[name] for name, _ in parts]).to(device)
             for native, (_, parts) in layout.items()}
    talker = Talker(config)  # built like the predictor (MultiCodeDecoder.from_official)
    talker.load_state_dict(state, assign=True)
    return StandinTTS(talker.to(device).eval().requires_grad_(False), predictor)


def new_standin(talker: TalkerConfig, predictor: PredictorConfig) -> StandinTTS:
    return StandinTTS(Talker(talker), MultiCodeDecoder(predictor))
