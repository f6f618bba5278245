"""What quantized weights cost in quality: per codebook, the distance of each scheme's distribution from the bfloat16
model's, on the same codes (teacher forcing), and the stand-in's tokens/step per scheme.

    python benchmarks/quantization_quality.py [--out benchmarks/results]   # -> quantization-quality.{json,md}

A quantized model is a different model: speculation is exact relative to it (tests/test_quantize.py); this measures
how far it is from the float one. Per codebook c1..c15 and frame, from the bfloat16 model's distribution p and the
scheme's q:
- KL(p || q) at temperature 0.9 over the whole vocabulary (the deployed top-k 50 would make it infinite wherever the
  two top-50 sets differ, so the deployed distributions are compared by total variation instead);
- TV: total variation distance of the deployed distributions (temperature 0.9, top-k 50);
- top-1 agreement: the argmax codes agree.
float32 is listed too: the distance bfloat16's own rounding puts between it and the float32 model.

Models: the shipped stand-in (trained weights) on codes it synthesizes for sentences written here (none is in its
training corpus of Debian fortunes), and the real 0.6B architecture (random layers, heads peaked as in
`rvqspec bench --weights`) on codes it samples. Tokens/step: the stand-in's frames decoded speculatively with its
shipped offsets and N=16 tree, per scheme. `--smoke`: one sentence, the 0.6B architecture at tiny widths
(`smoke_config`), 2 frames, a temporary folder.
"""

import argparse
import copy
import time
from pathlib import Path

import torch

from rvqspec import Sampler, Tree, decode_frame, quantize
from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
from rvqspec.bench.systems import smoke_config
from rvqspec.bench.timing import RESULTS, SMOKE_HELP, finish_machine, machine, machine_text, report_folder
from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.config import ARCHITECTURES
from rvqspec.core.decode import tokens_per_step
from rvqspec.core.drafters import Offsets
from rvqspec.core.tree import default_tree
from rvqspec.standin.settings import MODEL_DIR, OFFSETS_FILE, TREES_DIR
from rvqspec.standin.synthesis import synthesize_codes
from rvqspec.standin.talker import load_standin

SCHEMES = ("float32", "w8a16", "w8a8")  # each against bfloat16
DEPLOYED = Sampler()  # upstream's subtalker defaults: temperature 0.9, top-k 50
SENTENCES = [("en", "A quiet river runs under the old stone bridge."),
             ("en", "Please close the window before the storm arrives."),
             ("de", "Der Zug nach Berlin fährt heute eine Stunde später."),
             ("de", "Meine Schwester kocht am liebsten mit frischen Kräutern."),
             ("es", "El mercado abre temprano todos los sábados."),
             ("es", "Mañana vamos a caminar por la montaña."),
             ("ru", "Вечером мы читали книги у камина."),
             ("ru", "Завтра будет тёплый и солнечный день.")]


@torch.inference_mode()
def head_logits(model, talker_hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Logits [T, 15, V] of c1..c15 of every frame, teacher forced on `codes` [T, 16], through `model`'s own heads."""
    h = model.teacher_forced_hidden(talker_hidden.to(model.dtype), codes)
    return torch.stack([model.head_logits(h[:, g], g) for g in range(1, codes.shape[1])], dim=1).float()


def distances(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Per codebook: KL at temperature 0.9, TV of the deployed distributions, top-1 agreement (frame means)."""
    p = torch.log_softmax(reference / DEPLOYED.temperature, -1)
    q = torch.log_softmax(other / DEPLOYED.temperature, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean(0)
    tv = 0.5 * (DEPLOYED.probs(reference) - DEPLOYED.probs(other)).abs().sum(-1).mean(0)
    top1 = (reference.argmax(-1) == other.argmax(-1)).float().mean(0)
    return {"kl": kl.tolist(), "tv": tv.tolist(), "top1_agreement": top1.tolist()}


def compare(models: dict, talker_hidden: torch.Tensor, codes: torch.Tensor) -> dict:
    reference = head_logits(models["bfloat16"], talker_hidden, codes)
    return {name: distances(reference, head_logits(model, talker_hidden, codes))
            for name, model in models.items() if name != "bfloat16"}


def schemes_of(model) -> dict:
    """bfloat16 (the reference), float32, and each quantize scheme of the bfloat16 model."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    return {"bfloat16": bf16, "float32": copy.deepcopy(model).to(torch.float32), "w8a16": quantize(bf16, "w8a16"),
            "w8a8": quantize(bf16, "w8a8")}


def standin(log, sentences: list = SENTENCES) -> dict:
    tts = load_standin(MODEL_DIR, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    synths = [synthesize_codes(tts, text, lang, DEPLOYED, generator=generator) for lang, text in sentences]
    codes, hidden = torch.cat([s.codes for s in synths]), torch.cat([s.hidden for s in synths])
    float_model = load_standin(MODEL_DIR, torch.float32).predictor
    models = schemes_of(float_model)
    log(f"stand-in: {len(codes)} frames of {len(sentences)} sentences")
    tree = Tree.load(TREES_DIR / "tree-N16.json")
    result = {"frames": len(codes), "sentences": len(sentences), "tokens_per_step": {}}
    for name, model in models.items():
        drafter = Offsets.load(OFFSETS_FILE, model).to(model.device, model.dtype)
        runs = [decode_frame(model, h, int(c[0]), DEPLOYED, torch.Generator().manual_seed(i), drafter, tree)
                for i, (h, c) in enumerate(zip(hidden, codes))]
        result["tokens_per_step"][name] = tokens_per_step(runs)
    result["distances"] = compare(models, hidden, codes)
    return result


def real_architecture(log, frames: int = 48, smoke: bool = False) -> dict:
    config = smoke_config(ARCHITECTURES["0.6b"]) if smoke else ARCHITECTURES["0.6b"]
    predictor = controlled_predictor(config, dtype="float32")
    calibrated = calibrate_strength(predictor, default_tree(32), PAPER_ACCEPTANCE[32], DEPLOYED,
                                    predictor.frames(8, seed=2), iterations=1 if smoke else 6)
    models = schemes_of(predictor.model)
    inputs = predictor.frames(frames, seed=1)
    generator = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.cat([torch.tensor([c0]), decode_frame(models["bfloat16"], h, c0, DEPLOYED,
                                                                     generator).codes]) for h, c0 in inputs])
    log(f"0.6B: {frames} frames sampled from the bfloat16 model, heads at strength {calibrated.strength:.2f}")
    return {"frames": frames, "strength": calibrated.strength,
            "distances": compare(models, torch.stack([h for h, _ in inputs]), codes)}


def table(title: str, section: dict) -> list[str]:
    lines = [f"### {title}", "", "| weights | measure | " + " | ".join(f"c{g}" for g in range(1, 16)) + " | mean |",
             "|---|---|" + "---|" * 16]
    for name, d in section["distances"].items():
        for key, label in (("kl", "KL (T=0.9)"), ("tv", "TV (deployed)"), ("top1_agreement", "top-1 agreement")):
            values = d[key]
            shown = (lambda v: f"{v:.1e}") if key == "kl" else (lambda v: f"{v:.3f}")
            lines.append(f"| {name} | {label} | " + " | ".join(shown(v) for v in values) +
                         f" | {shown(sum(values) / len(values))} |")
    return lines + [""]


def markdown(report: dict) -> str:
    s, r = report["standin"], report["real"]
    lines = ["# Quantized weights: distance from the bfloat16 model", "",
             f"`python benchmarks/quantization_quality.py`: {machine_text(report['machine'])}. Per codebook, frame "
             "means, each model teacher forced on the same codes; see the script's docstring for the measures.", "",
             *table(f"Stand-in (trained weights), {s['frames']} frames of {s.get('sentences', len(SENTENCES))} unseen sentences", s),
             "Stand-in tokens/step (shipped offsets, tree N=16, deployed sampler, the same frames): " +
             ", ".join(f"{k} {v:.3f}" for k, v in s["tokens_per_step"].items()) + ".", "",
             *table(f"0.6B architecture (random layers, heads peaked to the paper's acceptance), {r['frames']} frames",
                    r)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start, info = time.perf_counter(), machine()
    report = {"standin": standin(print, SENTENCES[:1] if args.smoke else SENTENCES),
              "real": real_architecture(print, *((2, True) if args.smoke else ()))}
    report["machine"], report["seconds"] = finish_machine(info), time.perf_counter() - start
    out = report_folder(args.out, args.smoke)
    save_json(out / "quantization-quality.json", report)
    save_text(out / "quantization-quality.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
