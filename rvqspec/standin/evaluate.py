"""`rvqspec eval`: the paper's Tables 2 and 3 on the stand-in, and a distribution check on real decoding.

Everything is measured on free-running synthesis of the held-out test sentences (talker + predictor,
the predictor's inner loop through `decode_frame`, deployed sampler for both):

- Table 2: tokens/step (codes emitted / predictor calls, the prefill included) of each drafter at one
  fixed tree (the shipped calibrated tree of --tree nodes) and the parameters each drafter adds.
- Table 3: per language, tokens/step and Whisper WER of AR vs speculative (offsets) synthesis; the
  audio goes through the stand-in's codec and vocoder, transcripts through `rvqspec.standin.quality`.
- Distribution check: per codebook, the code histograms of AR and speculative synthesis over the test
  set, compared with a chi-square test of the 2 x K contingency table (rare codes merged into one bin).
  A free-running talker makes AR and speculative runs diverge, so only distributions are compared, and
  frames of one utterance are not independent: the asymptotic chi-square p-value assumes they are, so
  the verdict uses a permutation p-value of the same statistic that swaps the AR/speculative labels of
  whole utterances (valid because the two runs of a sentence use independent random streams, so under
  the null hypothesis they are exchangeable). Holm's step-down method combines the codebooks.

Every figure is a mean over seeds with its spread (sample std, min, max). Outputs: eval.json and
eval.md in --out (eval-quick.* with --quick), written atomically.
"""

import time
from pathlib import Path

import numpy as np
import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.standin.quality import error_rates, transcripts
from rvqspec.standin.settings import OFFSETS_FILE, Settings
from rvqspec.standin.synthesis import Run, first_per_lang, synthesize_all

DRAFTERS = ("reused", "offsets", "medusa")  # Table 2 rows (the paper's); other kinds are measured from their files
TABLE3_DRAFTER = "offsets"  # the paper's speculative decoder
DEFAULT_NODES = 32  # the paper's operating point for Tables 2 and 3 (2.47 tokens/step at N = 32)
MANIFEST = Path("data/standin/corpus/manifest.jsonl")
MEDUSA_DIR = Path("data/standin/medusa")
MEDUSA_STEPS = 1500  # batches of 32 frames: about a third of an epoch of the stand-in's train corpus
ALPHA = 0.05
PERMUTATIONS = 1999
MIN_BIN_COUNT = 10  # codes seen fewer times (AR + speculative) are merged into one bin

# The paper's figures (Qwen3-TTS 0.6B, Fleurs), shown next to ours.
PAPER_TABLE2 = {"reused": {"tokens_per_step": 1.70, "added_parameters": "0"},
                "medusa": {"tokens_per_step": 2.60, "added_parameters": "~94M (~+16%)"},
                "offsets": {"tokens_per_step": 2.47, "added_parameters": "3,072 (~+5e-4%)"}}
# Per language: speculative tokens/step, AR WER %, speculative WER % (CER for ja and zh).
PAPER_TABLE3 = {"en": (2.45, 4.25, 3.99), "de": (2.46, 6.4, 5.58), "es": (2.44, 7.28, 5.98),
                "ru": (2.46, 9.55, 8.26), "ja": (2.46, 8.55, 7.71), "zh": (2.45, 7.43, 7.18)}


def medusa_command(model: Path, out: Path = MEDUSA_DIR) -> str:
    return (f"rvqspec train-offsets --drafter medusa --model {model} --corpus {Settings().code_corpus('train')} "
            f"--out {out}")


# ---------------------------------------------------------------- inputs


def load_tree(spec: str, trees_dir: Path):
    """A tree file, or a budget N naming trees_dir/tree-N{N}.json."""
    from rvqspec.core.tree import Tree

    path = trees_dir / f"tree-N{spec}.json" if spec.isdigit() else Path(spec)
    if not path.is_file():
        raise RvqspecError(f"tree {path} does not exist: calibrate it with `rvqspec standin build --from calibrate` "
                           "or pass --tree FILE")
    return Tree.load(path)


def load_drafters(specs: list[str], model, model_dir: Path, corpus: Path | None,
                  offsets: Path = OFFSETS_FILE, medusa: Path = MEDUSA_DIR / "medusa.safetensors"
                  ) -> tuple[dict, dict, dict]:
    """The drafters to measure (Table 2 rows by kind), for each one that cannot be had the command that makes it,
    and the file each came from. A spec is a kind (offsets: the shipped file; medusa: `medusa`, trained on the
    code corpus `corpus` when missing or made for an earlier build of the model, unless `corpus` is None) or a
    trained drafter file, which stands for its kind."""
    from rvqspec.core.drafters import Drafter, MedusaHeads, Offsets, ReusedHeads, model_fingerprint

    drafters, missing, files = {}, {}, {}
    for spec in specs:
        if spec not in DRAFTERS:
            drafter = Drafter.load(spec, model)
            drafters[drafter.kind], files[drafter.kind] = drafter, spec
        elif spec == "reused":
            drafters[spec] = ReusedHeads(model)
        elif spec == "offsets":
            if offsets.is_file():
                drafters[spec], files[spec] = Offsets.load(offsets, model), str(offsets)
            else:
                missing[spec] = "rvqspec standin build --from offsets --to calibrate"
        elif medusa.is_file() and MedusaHeads.load(medusa, model).fingerprint == model_fingerprint(model):
            drafters[spec], files[spec] = MedusaHeads.load(medusa, model), str(medusa)
        elif corpus is not None:
            drafters[spec], files[spec] = train_medusa_heads(model, model_dir, corpus, medusa), str(medusa)
        else:
            missing[spec] = medusa_command(model_dir, medusa.parent)
    return drafters, missing, files


def train_medusa_heads(model, model_dir: Path, corpus: Path, out_file: Path):
    """Medusa heads for the stand-in (not shipped: 6M parameters), trained like the offsets but for only
    MEDUSA_STEPS batches (a full epoch takes ~9 minutes of CPU here); saved to `out_file`."""
    from rvqspec.core.drafters import MedusaHeads
    from rvqspec.tuning.train import TrainSettings, train

    work = out_file.parent
    if not (corpus / "index.json").is_file():
        raise RvqspecError(f"Medusa heads are not trained and the code corpus {corpus} is missing: build it with "
                           f"`rvqspec standin build --to code-corpus`, then run `{medusa_command(model_dir, work)}`")
    print(f"training Medusa heads for {MEDUSA_STEPS} steps: {medusa_command(model_dir, work)} "
          f"--max-steps {MEDUSA_STEPS}", flush=True)
    train(model_dir, corpus, work, TrainSettings(drafter="medusa"), epochs=1, max_steps=MEDUSA_STEPS, force=True,
          progress=False)
    heads = MedusaHeads.for_model(model)  # the run stops mid-epoch, so its drafter is in the checkpoint
    heads.load_state_dict(torch.load(work / "last.pt", weights_only=True)["drafter"])
    heads.save(out_file, {"steps": str(MEDUSA_STEPS)})
    return heads


def medusa_training(path: Path) -> str:
    """How long the heads in `path` were trained, from the metadata `train_medusa_heads` or `train` wrote."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if "steps" in meta:
        return f"{meta['steps']} batches of 32 frames"
    return f"{meta['epoch']} epoch(s)" if "epoch" in meta else "an unrecorded number of steps"


def parameter_count(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


# ---------------------------------------------------------------- synthesis


def tokens_per_step(runs: list[Run]) -> float:
    codes = sum(r.frames * (r.codes.shape[1] - 1) for r in runs)
    return codes / max(sum(r.calls for r in runs), 1)


def spread(values: list[float | None]) -> dict | None:
    """Mean, sample std, min and max over seeds (None when nothing was measured)."""
    if not values or any(v is None for v in values):
        return None
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), "std": float(array.std(ddof=1)) if len(array) > 1 else 0.0,
            "min": float(array.min()), "max": float(array.max()), "per_seed": [float(v) for v in array]}


# ---------------------------------------------------------------- quality


# ---------------------------------------------------------------- two-sample test


def code_counts(runs: list[Run], codebook: int, vocab: int) -> np.ndarray:
    """[utterances, vocab] histogram of one codebook's codes, per utterance."""
    return np.stack([np.bincount(r.codes[:, codebook].numpy(), minlength=vocab)[:vocab] for r in runs])


def merge_rare(pooled: np.ndarray, min_count: int = MIN_BIN_COUNT) -> np.ndarray:
    """[V] bin index per code: codes seen >= min_count times keep a bin; the rest share one (folded into
    the smallest kept bin when even together they are rarer than min_count). Codes never seen get -1."""
    keep = np.flatnonzero(pooled >= min_count)
    bins = np.full(len(pooled), -1)
    bins[keep] = np.arange(len(keep))
    rare = np.flatnonzero((pooled > 0) & (pooled < min_count))
    if len(rare):
        if pooled[rare].sum() >= min_count or not len(keep):
            bins[rare] = len(keep)
        else:
            bins[rare] = bins[keep[np.argmin(pooled[keep])]]
    return bins


def chi_square_statistic(tables: np.ndarray) -> np.ndarray:
    """Pearson's statistic of 2 x K tables [..., 2, K] (no continuity correction)."""
    rows, cols = tables.sum(-1, keepdims=True), tables.sum(-2, keepdims=True)
    expected = rows * cols / tables.sum((-2, -1), keepdims=True)
    return ((tables - expected) ** 2 / np.where(expected > 0, expected, 1)).sum((-2, -1))


def two_sample_test(a: np.ndarray, b: np.ndarray, permutations: int = PERMUTATIONS, seed: int = 0) -> dict:
    """Do the codes in per-utterance histograms a, b [U, V] come from one distribution?

    Chi-square on the pooled 2 x K table (rare codes merged) with its asymptotic p-value, and the
    permutation p-value of the same statistic under random swaps of the a/b labels of paired utterances."""
    from scipy.special import chdtrc  # chi-square survival function (lighter import than scipy.stats)

    if a.shape != b.shape:
        raise RvqspecError(f"two-sample test needs paired histograms of one shape, got {a.shape} and {b.shape}")
    bins = merge_rare(a.sum(0) + b.sum(0))
    k = int(bins.max()) + 1
    if k < 2:
        return {"chi2": 0.0, "dof": 0, "p_chi2": 1.0, "p_permutation": 1.0, "bins": k}
    merge = np.zeros((a.shape[1], k))
    merge[bins >= 0, bins[bins >= 0]] = 1
    a, b = a @ merge, b @ merge  # [U, K]
    observed = float(chi_square_statistic(np.stack([a.sum(0), b.sum(0)])))
    swaps = np.random.default_rng(seed).integers(0, 2, (permutations, len(a))).astype(np.float64)
    first = a.sum(0) + swaps @ (b - a)  # row "a" after swapping the chosen utterances
    null = chi_square_statistic(np.stack([first, (a + b).sum(0) - first], axis=1))
    return {"chi2": observed, "dof": k - 1, "p_chi2": float(chdtrc(k - 1, observed)),
            "p_permutation": float((1 + np.sum(null >= observed - 1e-9)) / (1 + permutations)), "bins": k}


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control, any dependence)."""
    p = np.asarray(pvalues, dtype=np.float64)
    order = np.argsort(p)
    adjusted = np.minimum(1.0, np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order]))
    out = np.empty_like(p)
    out[order] = adjusted
    return out.tolist()


def distribution_check(ar: list[Run], spec: list[Run], vocab_sizes: list[int], alpha: float = ALPHA,
                       permutations: int = PERMUTATIONS) -> dict:
    """Per codebook, AR vs speculative code histograms (`two_sample_test`), Holm-combined verdict."""
    rows = [{"codebook": g, **two_sample_test(code_counts(ar, g, v), code_counts(spec, g, v), permutations, seed=g)}
            for g, v in enumerate(vocab_sizes)]
    for row, adjusted in zip(rows, holm([r["p_permutation"] for r in rows])):
        row["p_holm"] = adjusted
    differing = [r["codebook"] for r in rows if r["p_holm"] < alpha]
    verdict = (f"no codebook differs at family-wise level {alpha} (Holm over {len(rows)} codebooks, permutation "
               "p-values): consistent with identical distributions" if not differing else
               f"codebooks {differing} differ at family-wise level {alpha} (Holm, permutation p-values)")
    return {"alpha": alpha, "permutations": permutations, "utterances": len(ar),
            "frames": {"ar": sum(r.frames for r in ar), "spec": sum(r.frames for r in spec)},
            "codebooks": rows, "min_p_holm": min(r["p_holm"] for r in rows), "differing": differing,
            "verdict": verdict}


# ---------------------------------------------------------------- the evaluation


def evaluate(tts, sentences: list[dict], drafters: dict, tree, seeds: list[int], vocoder=None, asr=None,
             missing: dict | None = None, wer_per_lang: int | None = None, max_frames: int | None = None,
             progress: bool = True) -> dict:
    """Synthesize every sentence AR and with every drafter, per seed; tables 2 and 3 and the distribution
    check. `vocoder` (codes -> wav) and `asr` (wav, lang -> text) are needed for WER (None skips it), which
    is scored on the first `wer_per_lang` sentences of each language (vocoder and Whisper are the slow part).
    `max_frames` caps an utterance (default: synthesize_codes' cap from the text length)."""
    modes = ["ar", *drafters]
    runs: dict[str, dict[int, list[Run]]] = {mode: {} for mode in modes}
    start = time.perf_counter()
    for seed in seeds:
        for mode in modes:
            t0 = time.perf_counter()
            runs[mode][seed] = synthesize_all(tts, sentences, seed, mode, drafters.get(mode), tree, max_frames)
            if progress:
                print(f"seed {seed} {mode}: {tokens_per_step(runs[mode][seed]):.3f} tokens/step, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    synthesis_seconds = time.perf_counter() - start
    spec_mode = TABLE3_DRAFTER if TABLE3_DRAFTER in drafters else next(iter(drafters), None)
    wers, scored = {}, first_per_lang(sentences, wer_per_lang)
    if vocoder is not None and asr is not None and spec_mode is not None:
        scored_sentences = [sentences[i] for i in scored]
        for mode in ("ar", spec_mode):
            heard = {seed: transcripts([runs[mode][seed][i] for i in scored], scored_sentences, vocoder, asr)
                     for seed in seeds}
            wers[mode] = {seed: error_rates(heard[seed], scored_sentences) for seed in seeds}
            if mode == "ar":
                wers["chance"] = {seed: error_rates(heard[seed], scored_sentences, shift=1) for seed in seeds}
            if progress:
                print(f"WER {mode}: {wers[mode]}", flush=True)
    vocab_sizes = [tts.config.num_codes] * tts.predictor.config.num_code_groups
    backbone = parameter_count(tts)
    report = {
        "tree": {"nodes": tree.size, "depth": tree.max_depth, "meta": tree.meta},
        "seeds": seeds, "sampler": "deployed (temperature 0.9, top-k 50, top-p 1.0) for talker and predictor",
        "sentences": {lang: sum(s["lang"] == lang for s in sentences)
                      for lang in dict.fromkeys(s["lang"] for s in sentences)},
        "backbone_parameters": backbone,
        "table2": [table2_row(name, drafters[name], runs[name], backbone) for name in drafters]
                  + [{"drafter": name, "missing": command} for name, command in (missing or {}).items()],
        "table3": table3(runs, sentences, seeds, spec_mode, wers, [sentences[i] for i in scored]),
        "distribution": {mode: distribution_check(sum(runs["ar"].values(), []), sum(runs[mode].values(), []),
                                                  vocab_sizes) for mode in drafters},
        "seconds": {"synthesis": round(synthesis_seconds, 1), "total": round(time.perf_counter() - start, 1)},
    }
    return report


def table2_row(name: str, drafter, runs: dict[int, list[Run]], backbone: int) -> dict:
    added = parameter_count(drafter)
    return {"drafter": name, "added_parameters": added, "added_percent": 100 * added / backbone,
            "tokens_per_step": spread([tokens_per_step(r) for r in runs.values()]),
            "calls_per_frame": spread([sum(x.calls for x in r) / max(sum(x.frames for x in r), 1)
                                       for r in runs.values()]),
            "frames": spread([sum(x.frames for x in r) for r in runs.values()])}


def table3(runs: dict, sentences: list[dict], seeds: list[int], spec_mode: str | None, wers: dict,
           scored: list[dict]) -> dict:
    from rvqspec.core.config import FRAME_RATE

    rows = []
    for lang in dict.fromkeys(s["lang"] for s in sentences):
        pick = [i for i, s in enumerate(sentences) if s["lang"] == lang]

        def stats(mode: str) -> dict:
            of_lang = {seed: [runs[mode][seed][i] for i in pick] for seed in seeds}
            rates = wers.get(mode)
            return {"tokens_per_step": spread([tokens_per_step(r) for r in of_lang.values()]),
                    "wer": spread([rates[seed][lang] for seed in seeds]) if rates else None,
                    "audio_minutes": spread([sum(x.frames for x in r) / FRAME_RATE / 60 for r in of_lang.values()])}

        chance = wers.get("chance")
        rows.append({"lang": lang, "sentences": len(pick), "wer_sentences": sum(s["lang"] == lang for s in scored),
                     "ar": stats("ar"),
                     "chance_wer": spread([chance[seed][lang] for seed in seeds]) if chance else None,
                     "spec": stats(spec_mode) if spec_mode else None})
    return {"drafter": spec_mode, "metric": "WER", "rows": rows,
            "asr": "Whisper tiny.en (en), Whisper base (others), faster-whisper int8, greedy"}


# ---------------------------------------------------------------- Markdown


def fmt(stat: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """'mean ± std (min-max)' of a spread, or 'not measured'."""
    if stat is None:
        return "not measured"
    mean, std, lo, hi = (stat[k] * scale for k in ("mean", "std", "min", "max"))
    if len(stat["per_seed"]) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def table2_markdown(report: dict) -> str:
    seeds = len(report["seeds"])
    lines = [f"Tree of {report['tree']['nodes']} nodes (depth {report['tree']['depth']}), the same for every "
             f"drafter; {sum(report['sentences'].values())} test sentences, {seeds} seed(s): mean ± std (min-max) "
             "over seeds.", "",
             "| drafter | tokens/step (ours) | calls/frame (ours) | added parameters (ours) | paper tokens/step | "
             "paper added parameters |", "|---|---|---|---|---|---|"]
    for row in report["table2"]:
        paper = PAPER_TABLE2[row["drafter"]]
        if "missing" in row:
            lines.append(f"| {row['drafter']} | not yet measured: run `{row['missing']}` | | | "
                         f"{paper['tokens_per_step']:.2f} | {paper['added_parameters']} |")
            continue
        lines.append(f"| {row['drafter']} | {fmt(row['tokens_per_step'])} | {fmt(row['calls_per_frame'])} | "
                     f"{row['added_parameters']:,} (+{row['added_percent']:.3g}%) | {paper['tokens_per_step']:.2f} | "
                     f"{paper['added_parameters']} |")
    lines += ["", f"Added parameters are relative to the stand-in's {report['backbone_parameters']:,} "
              "(talker + code predictor); the paper's to Qwen3-TTS 0.6B."]
    medusa = report.get("medusa")
    if medusa:
        lines.append(f"Medusa heads: `{medusa['file']}`, trained for {medusa['training']} (the paper's are fully "
                     "trained), Medusa-style init (ResBlock at identity, vocabulary heads copied from the frozen "
                     "ones).")
    return "\n".join(lines)


def table3_markdown(report: dict) -> str:
    t3 = report["table3"]
    lines = [f"Speculative = {t3['drafter']} drafter, same tree as Table 2. WER in percent ({t3['asr']}), "
             "mean ± std (min-max) over seeds. Chance: the AR transcripts scored against another test sentence of the "
             "language (speech unrelated to the text); WER compares AR with speculative only where it is clearly "
             "below chance. Paper: Qwen3-TTS 0.6B on Fleurs.", "",
             "| lang | sentences (WER) | audio min (AR) | AR tokens/step | AR WER % | spec tokens/step | spec WER % | "
             "chance WER % | paper spec tokens/step | paper AR WER % | paper spec WER % |", "|---" * 11 + "|"]
    for row in t3["rows"]:
        paper = PAPER_TABLE3.get(row["lang"])
        paper_cells = " | ".join(f"{x}" for x in paper) if paper else "- | - | -"
        spec = row["spec"] or {"tokens_per_step": None, "wer": None}
        lines.append(f"| {row['lang']} | {row['sentences']} ({row['wer_sentences']}) | "
                     f"{fmt(row['ar']['audio_minutes'], digits=1)} | "
                     f"{fmt(row['ar']['tokens_per_step'])} | {fmt(row['ar']['wer'], 100, 1)} | "
                     f"{fmt(spec['tokens_per_step'])} | {fmt(spec['wer'], 100, 1)} | "
                     f"{fmt(row.get('chance_wer'), 100, 1)} | {paper_cells} |")
    if all(row["ar"]["wer"] is None for row in t3["rows"]):
        lines += ["", "WER not measured: install the Whisper extra (`pip install -e '.[standin]'`) and rerun "
                  "without --no-asr."]
    return "\n".join(lines)


def distribution_markdown(report: dict) -> str:
    lines = []
    for mode, check in report["distribution"].items():
        lines += [f"AR vs {mode}: {check['utterances']} utterance pairs, {check['frames']['ar']} / "
                  f"{check['frames']['spec']} frames. **Verdict: {check['verdict']}.**", "",
                  "| codebook | bins | chi2 | dof | p (chi2, iid frames) | p (permutation) | p (Holm) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| c{r['codebook']} | {r['bins']} | {r['chi2']:.1f} | {r['dof']} | {r['p_chi2']:.3g} | "
                  f"{r['p_permutation']:.3g} | {r['p_holm']:.3g} |" for r in check["codebooks"]]
        lines.append("")
    return "\n".join(lines).rstrip()


def report_markdown(report: dict) -> str:
    return "\n".join([
        "# rvqspec eval: stand-in Qwen3-TTS", "",
        f"Model `{report.get('model', '?')}`; {report['sampler']}; seeds {report['seeds']}; "
        f"test sentences per language {report['sentences']}. Synthesis took {report['seconds']['synthesis']:.0f} s, "
        f"everything {report['seconds']['total']:.0f} s. Produced by `{report.get('command', 'rvqspec eval')}`.", "",
        "## Table 2: drafters", "", table2_markdown(report), "",
        "## Table 3: per language, AR vs speculative", "", table3_markdown(report), "",
        "## Distribution check: AR vs speculative codes, per codebook", "",
        "Chi-square test of the 2 x K table of code counts (codes seen fewer than "
        f"{MIN_BIN_COUNT} times merged into one bin). Frames of one utterance are dependent, so the verdict "
        "uses the permutation p-value (AR/speculative labels swapped per utterance pair) with Holm's correction.", "",
        distribution_markdown(report), ""])


# ---------------------------------------------------------------- CLI
