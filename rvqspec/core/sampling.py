"""The deployed sampler: Hugging Face order (temperature, top-k, top-p, then a draw), or greedy."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rvqspec.core import draw
from rvqspec.core.errors import RvqspecError

MIN_TEMPERATURE = 1e-6  # logits of order 1e4 divided by less overflow float32 towards 1e38

Generators = torch.Generator | Sequence[torch.Generator] | None  # one for every row, one per row, or torch's global


def real(value) -> bool:
    """A finite int or float (not a bool, a string or a tensor)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Sampler:
    """Qwen3-TTS subtalker defaults: do_sample, temperature 0.9, top_k 50, top_p 1.0."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise RvqspecError(f"do_sample must be True or False, got {self.do_sample!r}")
        if not real(self.temperature) or (self.do_sample and not self.temperature >= MIN_TEMPERATURE):
            raise RvqspecError(f"temperature must be > 0 when sampling (at least {MIN_TEMPERATURE:g}: below, logits "
                               f"divided by it overflow), got {self.temperature!r} (use do_sample=False for greedy "
                               "decoding)")
        if not real(self.top_k) or self.top_k < 0 or int(self.top_k) != self.top_k:
            raise RvqspecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))  # e.g. 50.0 from a JSON config: topk needs an int
        if not real(self.top_p) or not 0 < self.top_p <= 1:
            raise RvqspecError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def process(self, logits: Tensor) -> Tensor:
        """Warped float32 logits [..., V]: removed tokens are -inf. Same arithmetic as HF's warpers."""
        scores = logits.float()
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
            remove = sorted_scores.softmax(-1).cumsum(-1) <= 1 - self.top_p
            remove[..., -1:] = False  # keep at least the most likely token
            scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        return scores

    def probs(self, logits: Tensor) -> Tensor:
        """The target distribution p~ [..., V] a draw comes from (one-hot at the argmax when greedy)."""
        if not self.do_sample:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return self.process(logits).softmax(-1)

    def sample(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One draw per row of `logits` [N, V] -> LongTensor [N]."""
        if not self.do_sample:
            return logits.float().argmax(-1)
        return torch.multinomial(self.process(logits).softmax(-1), 1, generator=generator).squeeze(-1)

    def sample_noise(self, logits: Tensor, noise: Tensor | None) -> Tensor:
        """One draw per row of `logits` [N, V] given its Exp(1) noise [N, V] (`fill_noise`: float32, or float64
        uniforms; None when greedy): argmax(p~ / noise), the very draw torch.multinomial makes for one sample (it makes
        the noise itself). Without top-p on a CPU, one native call (`draw`: p~ may differ from torch's softmax in its
        last bits)."""
        if not self.do_sample:
            return logits.float().argmax(-1)
        drawn = draw.draws(logits, noise, self.temperature, self.top_k) if self.top_p == 1.0 else None
        if drawn is not None:
            return drawn
        return self.process(logits).softmax(-1).div_(exponential(noise)).argmax(-1)  # in place: the same bits


def row_generators(generator: Generators, rows: int) -> list[torch.Generator | None]:
    """One generator per row: a sequence as it is (one per row), else `generator` for every row."""
    if isinstance(generator, torch.Generator) or generator is None:
        return [generator] * rows
    return list(generator)


def fill_noise(noise: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Row b of `noise` [rows, ...] filled with Exp(1) values from generators[b] (rows past them keep theirs); a
    float64 `noise` with the uniforms u they are made of (`exponential`: the same stream, the same values, made by
    the native draw for the few tokens it reads, `draw.takes_uniforms`).

    Each row takes its block in one call of the same size whatever the batch, so a row draws the same noise alone
    and in any batch, and its generator moves on by the same amount (one generator for several rows: in row
    order). A block [G-1, V] equals G-1 draws of [V] in turn: a frame's noise is the AR frame's draws."""
    uniforms = noise.dtype == torch.float64
    for row, generator in zip(noise, generators):
        row.uniform_(generator=generator) if uniforms else row.exponential_(generator=generator)
    return noise


def exponential(noise: Tensor) -> Tensor:
    """Exp(1) noise as float32 (`fill_noise`): float64 uniforms u made into torch's exponential_ values
    float(-log1p(-u)), bit for bit; float32 noise as it is."""
    return (-torch.log1p(-noise)).float() if noise.dtype == torch.float64 else noise


@dataclass(frozen=True)
class TalkerRules:
    """How a request's c0 is drawn from the talker's logits: upstream's `generate` logits processing in Hugging Face's
    order (repetition penalty over the row's earlier c0, no EOS before `min_new_tokens`, suppressed tokens), then
    `sampler` (temperature, top-k, top-p, the draw; or greedy). `allowed`: a bool mask [V] of the tokens not
    suppressed."""

    sampler: Sampler
    eos: int
    allowed: Tensor
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0

    def scores(self, logits: Tensor, earlier: Tensor) -> Tensor:
        """Processed float32 scores [V] of logits [V], `earlier` the row's c0 so far (LongTensor [n])."""
        scores = logits.float().clone()
        if self.repetition_penalty != 1.0 and len(earlier):
            picked = scores.gather(0, earlier)
            scores.scatter_(0, earlier, torch.where(picked < 0, picked * self.repetition_penalty,
                                                    picked / self.repetition_penalty))
        if len(earlier) < self.min_new_tokens and 0 <= self.eos < len(scores):  # an EOS past the head: unreachable
            scores[self.eos] = float("-inf")
        return scores.masked_fill(~self.allowed, float("-inf"))

    def draw(self, logits: Tensor, earlier: Tensor, generator: torch.Generator | None) -> int:
        """The row's next c0."""
        return int(self.sampler.sample(self.scores(logits, earlier)[None], generator))
