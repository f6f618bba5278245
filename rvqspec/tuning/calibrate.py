"""`rvqspec calibrate`: acceptance statistics of a drafter, sparse trees grown from them, and a report.

Acceptance (docs/design.md, section 3) is measured on free-running synthesis: talker states and c0 come from the
corpus (train split), the predictor samples c1..c15 with the deployed sampler, consuming its own codes.
One teacher-forced pass over the sampled frame then gives every h_i and every target distribution p~
at once: for position i, depth j and rank r, the probability that p~ (given the sampled prefix up to
c_{i+j-1}) puts on the drafter's rank-r candidate for c_{i+j} is the chance that this draft is accepted
when its parent is. a[j][r] is its mean over frames and positions; one tree per tree size N is grown from it.

Prediction: tokens/step of a frame = 15 / expected predictor calls. The expectation runs over the
rounds of a frame (prefill, then one call per round) with the acceptance measured at each position k
(a node's acceptance = the product along its path, as in the tree growth), nodes past c15 pruned and
no bonus after c15: so it accounts for the prefill and the frame end, and assumes the acceptances of
successive depths independent. Measured: the same ratio from decoding held-out (validation split)
frames with `decode_frame` and the tree, under the same sampler.
"""

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.decode import decode_frame, tokens_per_step
from rvqspec.core.drafters import DEFAULT_DEPTH, Drafter, ReusedHeads, check_depth
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.policy import calls_distribution, report_size
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree, grow_tree
from rvqspec.tuning.corpus import Corpus, check_codes


@torch.inference_mode()
def sample_codes(model: MultiCodeDecoder, talker_hidden: Tensor, c0: Tensor, sampler: Sampler,
                 generator: torch.Generator | None = None) -> Tensor:
    """Free-running synthesis of B frames at once: codes [B, G] (c0, then c1..c15 sampled in order).

    Each step reruns the causal pass over the prefix (no cache): O(G^2) tokens, but batched over frames,
    which is far cheaper than decoding frame by frame. Same distribution as `decode_frame`."""
    codes = c0.reshape(-1, 1).to(model.device)
    for g in range(1, model.config.num_code_groups):
        hidden = model.teacher_forced_hidden(talker_hidden, torch.cat([codes, codes[:, :1]], dim=1))[:, g]
        codes = torch.cat([codes, sampler.sample(model.head_logits(hidden, g), generator)[:, None]], dim=1)
    return codes


@dataclass
class Acceptance:
    per_position: Tensor  # [G-2, K, m]: row i-1 = drafts from h_i; mean p~ of the rank-r candidate at depth j
    top1: Tensor  # [G-1] mean top-1 probability of p~ for c1..c15
    entropy: Tensor  # [G-1] mean entropy of p~ (nats)
    frames: int

    @property
    def pooled(self) -> Tensor:
        """a[j][r]: the mean over all positions i with i+j <= G-1."""
        depth = self.per_position.shape[1]
        valid = self.per_position.shape[0] - torch.arange(depth)  # G-1-j positions for depth j
        return self.per_position.sum(0) / valid[:, None]


@torch.inference_mode()
def measure_acceptance(model: MultiCodeDecoder, drafter: Drafter, talker_hidden: Tensor, c0: Tensor,
                       sampler: Sampler, top_m: int, generator: torch.Generator | None = None,
                       batch_size: int = 256) -> Acceptance:
    last, depth = model.config.num_residual_codes, drafter.depth
    sums = torch.zeros(last - 1, depth, top_m, dtype=torch.float64)
    top1 = torch.zeros(last, dtype=torch.float64)
    entropy = torch.zeros(last, dtype=torch.float64)
    for start in range(0, len(c0), batch_size):
        hidden_in = talker_hidden[start:start + batch_size].to(model.device)
        codes = sample_codes(model, hidden_in, c0[start:start + batch_size], sampler, generator)
        h = model.teacher_forced_hidden(hidden_in, codes)
        logits = torch.stack([model.head_logits(h[:, g], g) for g in range(1, h.shape[1])], dim=1)
        target = sampler.probs(logits)  # p~ of c1..c15 (the heads of a quantized model too)
        top1 += target.max(-1).values.sum(0).double().cpu()
        entropy += torch.special.entr(target).sum(-1).sum(0).double().cpu()
        for j in range(1, depth + 1):
            candidates = drafter.teacher_forced_logits(model, h, j).topk(top_m, dim=-1).indices  # i = 1..last-j
            sums[:last - j, j - 1] += target[:, j:].gather(-1, candidates).sum(0).double().cpu()
    frames = len(c0)
    return Acceptance(sums / frames, top1 / frames, entropy / frames, frames)


def predicted_calls(tree: Tree, per_position: Tensor) -> float:
    """Expected predictor calls for one frame (prefill included) with `tree`, see the module docstring."""
    return sum(calls * p for calls, p in enumerate(calls_distribution(tree, per_position)))


def measure_tree(model: MultiCodeDecoder, drafter: Drafter, tree: Tree, talker_hidden: Tensor, c0: Tensor,
                 sampler: Sampler, generator: torch.Generator | None = None) -> dict:
    """Tokens/step, calls/frame and tokens/round of actually decoding the frames with `tree`, and each frame's
    calls (the decoding policy takes a batch's slowest row from their distribution)."""
    results = [decode_frame(model, h, c, sampler, generator, drafter, tree) for h, c in zip(talker_hidden, c0)]
    per_frame = [result.calls for result in results]
    calls, frames, codes = sum(per_frame), len(c0), len(c0) * model.config.num_residual_codes
    return {"measured_tokens_per_step": tokens_per_step(results), "measured_calls_per_frame": calls / frames,
            "measured_tokens_per_round": (codes - frames) / max(calls - frames, 1), "measured_frame_calls": per_frame}


def load_drafter(spec: str, model: MultiCodeDecoder, depth: int) -> Drafter:
    if spec == "reused":
        check_depth(depth, model)
        return ReusedHeads(model, depth)
    drafter = Drafter.load(spec, model)
    return drafter.to(model.device, model.dtype)




@dataclass(frozen=True)
class CalibrationSettings:
    frames: int = 1000  # train-split frames for the acceptance statistics
    eval_frames: int = 200  # held-out (validation-split) frames decoded with each tree
    seed: int = 0
    sampler: Sampler = field(default_factory=Sampler)  # the deployed one: acceptance depends on it
    depth: int = DEFAULT_DEPTH  # K of the reused heads (drafter files carry their own)
    validation_fraction: float = 0.05


def calibrate(model_path: str | Path, drafter_spec: str, corpus_path: str | Path, sizes: list[int],
              out: str | Path, settings: CalibrationSettings = CalibrationSettings(), dtype: str = "float32",
              device: str = "cpu", weights: str | None = None) -> dict:
    """Measure acceptance, grow and save one tree per size N in `sizes`, measure each; returns the report. `weights`: calibrate
    the model quantized to that scheme (`rvqspec.quantize`), whose acceptance is its own."""
    out, s, sampler, seed = Path(out), settings, settings.sampler, settings.seed
    model = MultiCodeDecoder.from_pretrained(model_path, dtype, device, weights)
    corpus = Corpus(corpus_path, s.validation_fraction)
    corpus.check_model(model)
    drafter = load_drafter(drafter_spec, model, s.depth)
    generator = torch.Generator(model.device).manual_seed(seed)
    codes, hidden = corpus.sample("train", s.frames, seed)
    check_codes(codes, model)
    top_m = min(max(sizes), model.config.vocab_size)
    acceptance = measure_acceptance(model, drafter, hidden, codes[:, 0], sampler, top_m, generator)
    eval_codes, eval_hidden = corpus.sample("validation", s.eval_frames, seed + 1)
    check_codes(eval_codes, model)
    report = {"model": beside(model_path, out), "weights": model.weights,
              "drafter": {"spec": drafter_spec if drafter_spec == "reused" else beside(drafter_spec, out),
                          "kind": drafter.kind, "depth": drafter.depth},
              "corpus": beside(corpus_path, out), "sampler": asdict(sampler), "seed": seed,
              "frames": acceptance.frames, "eval_frames": len(eval_codes),
              "acceptance": acceptance.pooled.tolist(), "acceptance_per_position": acceptance.per_position.tolist(),
              "target_top1": acceptance.top1.tolist(), "target_entropy_nats": acceptance.entropy.tolist(), "trees": []}
    trees = []  # written once all are measured: an interrupted run leaves an earlier calibration in `out` whole
    for size in sizes:
        tree = grow_tree(acceptance.pooled, size)
        row = {"size": size, "file": f"tree-N{size}.json", "nodes": tree.size, "depth": tree.max_depth,
               "predicted_tokens_per_round": tree.meta["predicted_tokens_per_round"],
               "predicted_tokens_per_step": model.config.num_residual_codes / predicted_calls(tree, acceptance.per_position)}
        row.update(measure_tree(model, drafter, tree, eval_hidden, eval_codes[:, 0], sampler, generator))
        tree.meta.update({k: v for k, v in row.items() if k not in ("size", "file", "measured_frame_calls")},
                         drafter=drafter.kind, sampler=asdict(sampler))
        trees.append(tree)
        report["trees"].append(row)
    for tree, row in zip(trees, report["trees"]):
        tree.save(out / row["file"])
    save_text(out / "report.md", report_markdown(report))
    save_json(out / "report.json", report)  # last: the report names the trees that belong to it
    return report


def beside(path: str | Path, folder: Path) -> str:
    """`path` relative to the report's folder: the report works from any working directory and moves with its
    inputs (`rvqspec bench --calibration` resolves it against the report's folder)."""
    return os.path.relpath(Path(path).resolve(), Path(folder).resolve())


def report_markdown(report: dict) -> str:
    acceptance = report["acceptance"]
    ranks = min(8, len(acceptance[0]))
    lines = [f"# Calibration of {report['drafter']['kind']} drafts ({report['drafter']['spec']})", "",
             f"Model `{report['model']}`, corpus `{report['corpus']}`, sampler {report['sampler']}.",
             f"Acceptance from {report['frames']} free-running frames (train split); tokens/step measured on "
             f"{report['eval_frames']} held-out frames (validation split).", "",
             "## a[j][r]: mean target probability of the rank-r draft at depth j", "",
             "| depth | " + " | ".join(f"r={r}" for r in range(ranks)) + " | sum of all ranks |",
             "|---|" + "---|" * (ranks + 1)]
    lines += [f"| {j + 1} | " + " | ".join(f"{a:.3f}" for a in row[:ranks]) + f" | {sum(row):.3f} |"
              for j, row in enumerate(acceptance)]
    lines += ["", "## Trees", "",
              "Predicted tokens/step: expectation over the rounds of a frame with per-position acceptance, prefill "
              "and frame end included (independence of depths assumed). Tokens/round: codes per speculative round "
              "(predicted: 1 + sum of node values, ignoring the frame end; measured: includes the truncated last rounds).",
              "", "| N | depth | predicted tokens/round | measured tokens/round | predicted tokens/step | "
              "measured tokens/step | measured calls/frame |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {report_size(t)} | {t['depth']} | {t['predicted_tokens_per_round']:.3f} | "
              f"{t['measured_tokens_per_round']:.3f} | {t['predicted_tokens_per_step']:.3f} | "
              f"{t['measured_tokens_per_step']:.3f} | {t['measured_calls_per_frame']:.2f} |" for t in report["trees"]]
    lines += ["", "## Target distribution per codebook (c1..c15)", "",
              "| codebook | " + " | ".join(str(g + 1) for g in range(len(report["target_top1"]))) + " |",
              "|---|" + "---|" * len(report["target_top1"]),
              "| mean top-1 p~ | " + " | ".join(f"{p:.2f}" for p in report["target_top1"]) + " |",
              "| mean entropy (nats) | " + " | ".join(f"{e:.2f}" for e in report["target_entropy_nats"]) + " |", ""]
    return "\n".join(lines)
