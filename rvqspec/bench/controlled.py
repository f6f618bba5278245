"""Acceptance-controlled code predictors: real architecture, random layers, heads with a peak of chosen strength.

No trained real-size weights exist here, yet the speed-up a user with real weights sees depends on how often
drafts are accepted. So the random-weight predictor gets inputs and heads that make acceptance a dial:

- code c of every table is embedded (scaled by `EMBED_SCALE`, so it dominates the residual stream over the
  random layers) along one random direction u_c; c0 uses u_{c0 mod V}. The final hidden state after code c
  then points (almost) along d_c, the projected u_c;
- every head row v is `strength * d_v / (|d_v| sqrt(hidden))`: the final norm gives the hidden state RMS 1,
  so the logit of the previous code is about `strength` and every other logit `strength * cos(d_v, d_c)`,
  near 0. `strength` is the peak's logit margin (before the temperature), whatever the model's size.

The drafts of `ReusedHeads` read the same directions, so their rank-0 candidate at every depth is the code
before the root: accepted while the frame keeps repeating it. Acceptance grows with `strength`;
`calibrate_strength` bisects it to a target tokens/step under the deployed sampler with the core's real rounds, or
to a target per-round acceptance (drafts accepted per round with room for the whole tree): the measure that
carries the paper's acceptance over to a depth decoder with longer frames (CSM's 31 codes), whose tokens/step
at the same acceptance is higher because its frame end cuts fewer rounds short.
Timing does not depend on weight values, so per-call latencies measured here hold for real weights.
"""

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from rvqspec.core.config import QWEN3_TTS_0_6B, PredictorConfig
from rvqspec.core.decode import FrameResult, decode_frame, tokens_per_step as decoded_tokens_per_step
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder, resolve_dtype
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree

PAPER_ACCEPTANCE = {16: 2.25, 32: 2.47, 64: 2.60}  # tokens/step at tree size N, paper section 3.4
PAPER_HEADLINE = 32  # the tree size of the paper's headline figure: other sizes decode at its strength (`at_strength`)
EMBED_SCALE = 30.0  # code embeddings' RMS; the random layers add O(1) per block to the residual stream


@dataclass
class ControlledPredictor:
    model: MultiCodeDecoder
    directions: Tensor  # [V, hidden] unit vectors: where the final hidden state points after each code
    strength: float = 0.0  # logit margin of the peak

    def set_strength(self, strength: float) -> None:
        """Heads of every codebook peak on the previous code with logit margin `strength` (0: uniform targets)."""
        if not strength >= 0:
            raise RvqspecError(f"peak strength must be >= 0, got {strength}")
        scale = strength / self.model.config.hidden_size ** 0.5
        with torch.no_grad():
            self.model.heads.copy_((scale * self.directions).expand_as(self.model.heads))
        self.strength = float(strength)

    def frames(self, count: int, seed: int = 0) -> list[tuple[Tensor, int]]:
        """`count` random (talker_hidden, c0) inputs."""
        c = self.model.config
        generator = torch.Generator().manual_seed(seed)
        hidden = torch.randn(count, c.talker_hidden_size, generator=generator).to(self.model.dtype)
        codes = torch.randint(c.talker_vocab_size, (count,), generator=generator).tolist()
        return list(zip(hidden, codes))


@torch.no_grad()
def controlled_predictor(config: PredictorConfig, strength: float = 0.0, seed: int = 0,
                         dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
                         ) -> ControlledPredictor:
    """A random-weight MultiCodeDecoder of `config` with controlled embeddings and heads (see module doc)."""
    torch.manual_seed(seed)
    model = MultiCodeDecoder(config).eval()
    c = config
    codes = torch.randn(c.vocab_size, c.talker_hidden_size) * EMBED_SCALE  # u_c, shared by all tables
    model.code_embed.weight.copy_(torch.cat([codes[torch.arange(c.talker_vocab_size) % c.vocab_size],
                                             codes.repeat(c.num_code_groups - 1, 1)]))
    directions = model.project(codes)
    directions = directions / directions.norm(dim=-1, keepdim=True)
    model = model.to(torch.device(device), resolve_dtype(dtype))
    predictor = ControlledPredictor(model, directions.to(model.device, model.dtype))
    predictor.set_strength(strength)
    return predictor


def decode_controlled(predictor: ControlledPredictor, tree: Tree, frames: list[tuple[Tensor, int]], sampler: Sampler,
                      seed: int = 0) -> list[FrameResult]:
    """Each frame of `frames` decoded speculatively with ReusedHeads (as deep as the tree) and `tree`."""
    model, generator = predictor.model, torch.Generator(predictor.model.device).manual_seed(seed)
    drafter = ReusedHeads(model, max(tree.max_depth, 1))
    return [decode_frame(model, h, c0, sampler, generator, drafter=drafter, tree=tree) for h, c0 in frames]


def round_acceptance(results: list[FrameResult], tree: Tree, last: int) -> float:
    """Drafts accepted per round, over the rounds with room for the whole tree (k + depth <= last): what the
    drafts and the tree achieve, not cut short by the frame end (so it does not depend on the frame's length)."""
    accepted = []
    for result in results:
        k = 1  # codes emitted: the prefill gives c1
        for round_ in result.rounds:
            if k + tree.max_depth <= last:
                accepted.append(round_.accepted)
            k += 1 + round_.accepted
    return sum(accepted) / max(len(accepted), 1)


def tokens_per_step(predictor: ControlledPredictor, tree: Tree, frames: list[tuple[Tensor, int]],
                    sampler: Sampler, seed: int = 0) -> float:
    """Codes emitted per predictor call over `frames`, speculative decoding with ReusedHeads and `tree`."""
    return decoded_tokens_per_step(decode_controlled(predictor, tree, frames, sampler, seed))


class Calibrated(NamedTuple):
    """What `calibrate_strength` found; the predictor is left at `strength`."""

    strength: float  # the heads' peak strength
    measured: float  # `metric` at it
    frame_calls: list[int]  # each frame's calls at it
    metric: str  # "tokens_per_step" or "round_acceptance"
    target: float  # what the bisection aimed at


def calibrate_strength(predictor: ControlledPredictor, tree: Tree, target: float, sampler: Sampler,
                       frames: list[tuple[Tensor, int]], iterations: int = 7, low: float = 1.0,
                       high: float = 16.0, seed: int = 0, metric: str = "tokens_per_step") -> Calibrated:
    """Bisect the peak strength (log scale, same frames and draws each time) until `metric` hits `target`:
    "tokens_per_step", or "round_acceptance" (drafts accepted per round with room for the tree)."""
    last = predictor.model.config.num_residual_codes
    ceiling = tokens_per_step_ceiling(predictor.model.config, tree) if metric == "tokens_per_step" else tree.max_depth
    floor = 1.0 if metric == "tokens_per_step" else 0.0
    if not floor < target < ceiling:
        raise RvqspecError(f"target {metric.replace('_', ' ')} {target} is out of reach: it must lie in ({floor:g}, "
                           f"{ceiling:.2f}) for a tree of depth {tree.max_depth}")
    best = None
    for _ in range(iterations):
        middle = math.sqrt(low * high)
        predictor.set_strength(middle)
        results = decode_controlled(predictor, tree, frames, sampler, seed)
        calls = [result.calls for result in results]
        measured = (decoded_tokens_per_step(results) if metric == "tokens_per_step"
                    else round_acceptance(results, tree, last))
        if best is None or abs(measured - target) < abs(best.measured - target):
            best = Calibrated(middle, measured, calls, metric, target)
        low, high = (middle, high) if measured < target else (low, middle)
    predictor.set_strength(best.strength)
    return best


def at_strength(predictor: ControlledPredictor, tree: Tree, strength: float, sampler: Sampler,
                frames: list[tuple[Tensor, int]], seed: int = 0) -> Calibrated:
    """`tree`'s tokens/step and calls per frame with the heads at `strength` (left there): a size the paper did not
    measure, at the operating point of one it did."""
    predictor.set_strength(strength)
    results = decode_controlled(predictor, tree, frames, sampler, seed)
    measured = decoded_tokens_per_step(results)
    return Calibrated(strength, measured, [result.calls for result in results], "tokens_per_step", measured)


def calibrate_to_paper(predictor: ControlledPredictor, tree: Tree, sampler: Sampler, frames: list[tuple[Tensor, int]],
                       iterations: int, round_target: Callable[[], float]) -> Calibrated:
    """Bisect `predictor` to the paper's acceptance with `tree` (N = tree.size): Qwen3-TTS's frame length to the
    paper's tokens/step at N; another frame length (CSM) to the drafts accepted per round that the 0.6B shows
    there, `round_target()` (e.g. `paper_round_acceptance`, or this run's 0.6B rows)."""
    if predictor.model.config.num_residual_codes == QWEN3_TTS_0_6B.num_residual_codes:
        return calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[tree.size], sampler, frames, iterations)
    return calibrate_strength(predictor, tree, round_target(), sampler, frames, iterations, metric="round_acceptance")


def log_calibration(log, n: int, c: Calibrated) -> None:
    log(f"    N={n}: peak strength {c.strength:.3f} gives {c.measured:.3f} {c.metric.replace('_', ' ')} "
        f"(target {c.target:.3f})")


def paper_round_acceptance(tree: Tree, target: float, sampler: Sampler, frames: int, iterations: int,
                           dtype: torch.dtype | str, device: str | torch.device = "cpu") -> float:
    """Drafts accepted per round that the 0.6B predictor shows with `tree` at `target` tokens/step (the paper's):
    what a depth decoder with another frame length is set to, to run at the paper's acceptance."""
    reference = controlled_predictor(QWEN3_TTS_0_6B, dtype=dtype, device=device)
    chosen = reference.frames(frames, seed=1)
    calibrate_strength(reference, tree, target, sampler, chosen, iterations)
    results = decode_controlled(reference, tree, chosen, sampler)
    return round_acceptance(results, tree, reference.model.config.num_residual_codes)


def tokens_per_step_ceiling(config: PredictorConfig, tree: Tree) -> float:
    """Tokens/step when every draft is accepted: 1 code from the prefill, then depth+1 per call."""
    rounds = math.ceil((config.num_residual_codes - 1) / (tree.max_depth + 1))
    return config.num_residual_codes / (1 + rounds)
