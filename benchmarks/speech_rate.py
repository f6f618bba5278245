"""The stand-in's speech rate per text token, against its default frame budget (docs/limits.md), and where one long
utterance stops ending by itself.

Rate: every sentence of SENTENCES (its four languages; digits and symbols included) is spoken greedy and with
`--seeds` sampled seeds (the stand-in's default sampling) by the Engine; a text token is a UTF-8 byte (plus the
language token). Reported per language: frames per text token (median, max) and the smallest margin, budget / frames,
over every utterance (a margin under 1 would be a cut). Long texts: the sentences of a language joined into texts of
growing length, spoken with the same seeds: how many end with EOS (not their budget), and frames per byte.

    .venv/bin/python benchmarks/speech_rate.py --seeds 3   # ~20 minutes on 2 shared cores; results/speech-rate.*
    .venv/bin/python benchmarks/speech_rate.py --smoke     # one English sentence, greedy: seconds, a temporary folder
"""

import argparse
import statistics
import sys
from pathlib import Path

import rvqspec
from rvqspec.bench.timing import (RESULTS, SMOKE_HELP, finish_machine, machine, machine_text, report_folder,
                                  write_reports)

SENTENCES = {
    "en": ["The quick brown fox jumps over the lazy dog.", "It costs 3.50 dollars, or 12 percent more.",
           "Call me at 555 0134 after 9 pm.", "Well, I never thought it would come to this!",
           "Do you really want to go there today?", "In 1984, about 2,500 people lived here.", "Yes.",
           "The meeting is on the 21st of June at 10:30."],
    "de": ["Der schnelle braune Fuchs springt über den faulen Hund.", "Es kostet 3,50 Euro, also 12 Prozent mehr.",
           "Ruf mich um 9 Uhr an.", "Das hätte ich nie gedacht!", "Willst du heute wirklich dorthin gehen?",
           "Im Jahr 1984 lebten hier etwa 2500 Menschen.", "Ja.", "Die Straße ist 250 Meter lang."],
    "es": ["El veloz zorro marrón salta sobre el perro perezoso.", "Cuesta 3,50 euros, un 12 por ciento más.",
           "Llámame a las 9 de la noche.", "¡Nunca pensé que llegaría a esto!", "¿De verdad quieres ir hoy?",
           "En 1984 vivían aquí unas 2500 personas.", "Sí.", "La reunión es el 21 de junio a las 10:30."],
    "ru": ["Быстрая коричневая лиса прыгает через ленивую собаку.", "Это стоит 3,50 евро, на 12 процентов больше.",
           "Позвони мне в 9 вечера.", "Я никогда не думал, что до этого дойдёт!", "Ты правда хочешь пойти туда сегодня?",
           "В 1984 году здесь жили около 2500 человек.", "Да.", "Встреча 21 июня в 10:30."],
}
LONG_BYTES = (100, 200, 400, 600)  # the long texts' lengths (UTF-8 bytes, at least)


def speak(engine, texts: list[str], lang: str, seeds: int) -> list[tuple[int, int, str]]:
    """(frames decoded, the budget, the end reason) of each text, greedy and with seeds 1..`seeds`, in one batch (a
    seeded request's codes are the same alone and batched)."""
    requests = []
    for text in texts:
        for seed in [None, *range(1, seeds + 1)]:
            greedy = dict(do_sample=False, subtalker_dosample=False) if seed is None else {}
            requests.append(engine.submit("speech", seed=seed or 0, text=text, language=lang, **greedy))
    return [(len(r.wait()), r.prompt.max_new_tokens - 1, r.end_reason, r.prompt.rules.sampler.do_sample)
            for r in requests]


def rates(engine, seeds: int, languages: dict) -> dict:
    report = {}
    for lang, sentences in languages.items():
        spoken = speak(engine, sentences, lang, seeds)
        rows = [(sentences[i // (seeds + 1)], *row) for i, row in enumerate(spoken)]
        ended = [row for row in rows if row[3] == "eos"]
        per_token = [frames / (len(text.encode()) + 1) for text, frames, *_ in ended] or [float("nan")]
        report[lang] = {"utterances": len(rows), "frames_per_token_median": statistics.median(per_token),
                        "frames_per_token_max": max(per_token),
                        "smallest_margin": min((budget / frames for _, frames, budget, *_ in ended),
                                               default=float("nan")),
                        "ends": {reason: sum(r[3] == reason for r in rows) for reason in ("eos", "length")},
                        "runaways": [{"text": text, "sampled": sampled, "frames": frames}
                                     for text, frames, budget, reason, sampled in rows if reason == "length"]}
    return report


def long_texts(engine, seeds: int, languages: dict, sizes: tuple[int, ...]) -> dict:
    report = {}
    for lang, sentences in languages.items():
        for size in sizes:
            text = ""
            while len(text.encode()) < size:
                text += sentences[len(text) % len(sentences)] + " "
            try:
                rows = speak(engine, [text.strip()], lang, seeds)
            except rvqspec.RvqspecError as e:
                report[f"{lang}-{size}"] = {"refused": str(e)}
                continue
            report[f"{lang}-{size}"] = {"bytes": len(text.strip().encode()),
                                        "ended_eos": sum(r[2] == "eos" for r in rows),
                                        "utterances": len(rows),
                                        "frames_per_byte": statistics.median(r[0] / len(text.encode()) for r in rows)}
    return report


def markdown(result: dict) -> str:
    lines = ["# The stand-in's speech rate and its frame budget", "", machine_text(result["machine"]), "",
             "Utterances that ended by EOS: frames per text token (a UTF-8 byte, + the language token), and the "
             "smallest budget / frames; those that never ended (runaways, at their budget) counted apart.", "",
             "| language | utterances | frames/token median | max | smallest budget/frames | eos | length |",
             "|---|---|---|---|---|---|---|"]
    for lang, r in result["rate"].items():
        lines.append(f"| {lang} | {r['utterances']} | {r['frames_per_token_median']:.2f} | "
                     f"{r['frames_per_token_max']:.2f} | {r['smallest_margin']:.2f} | {r['ends']['eos']} | "
                     f"{r['ends']['length']} |")
    runaways = [(lang, run) for lang, r in result["rate"].items() for run in r["runaways"]]
    lines += ["", "Runaways: " + ("; ".join(f"{lang} {run['text']!r} ({'sampled' if run['sampled'] else 'greedy'}, "
                                            f"{run['frames']} frames)" for lang, run in runaways) or "none")]
    lines += ["", "Long texts (one utterance): ended by EOS / spoken, median frames per byte", "",
              "| text | bytes | ended by EOS | frames/byte |", "|---|---|---|---|"]
    for name, r in result["long"].items():
        if "refused" in r:
            lines.append(f"| {name} | | refused: {r['refused']} | |")
        else:
            lines.append(f"| {name} | {r['bytes']} | {r['ended_eos']}/{r['utterances']} | {r['frames_per_byte']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="sampled seeds per sentence, beside greedy (default 3)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    languages = {"en": SENTENCES["en"][:1]} if args.smoke else SENTENCES
    seeds, sizes = (0, (60,)) if args.smoke else (args.seeds, LONG_BYTES)
    command = " ".join(["benchmarks/speech_rate.py", *(sys.argv[1:] if argv is None else argv)])
    with rvqspec.Engine("standin", seed=0, max_batch=8, max_queue=64, realtime=False) as engine:
        result = {"machine": machine(), "command": command, "seeds": seeds,
                  "rate": rates(engine, seeds, languages), "long": long_texts(engine, seeds, languages, sizes)}
    result["machine"] = finish_machine(result["machine"])
    write_reports(result, report_folder(args.out, args.smoke), "speech-rate", markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
