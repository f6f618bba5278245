"""`rvqspec standin ...`: build the stand-in Qwen3-TTS from nothing, and report its quality.

`rvqspec standin build` runs these stages in order (each skipped when its output exists, unless named
in --force; --from/--to pick a range). Work files go to --work (default data/standin, never shipped);
what ships goes to rvqspec/standin/assets (<= 20 MB):

 stage         output                                  what
 corpus        work/corpus/manifest.jsonl + wavs       offline speech, 4 languages (rvqspec.standin.speech)
 codec         assets/codec.safetensors                mel-RVQ codec, 16 x 512 k-means (rvqspec.standin.codec),
               work/codec_report.json                  and its English Whisper WER (original/vocoded/codec)
 encode        work/codes/                             every utterance's codes [T, 16]
 joint         work/joint/                             phase 1: talker + predictor (train.train_joint)
 code-corpus   work/code-corpus/{train,validation,test}  frozen talker's states + codes (rvqspec.tuning.corpus)
 predictor     assets/model/                           phase 3: predictor alone on the code corpus; float16
 offsets       assets/offsets.safetensors              `rvqspec train-offsets` on the train code corpus
 calibrate     assets/trees/                           `rvqspec calibrate`, budgets 4,8,16,32,64
 quality       assets/report.json                      held-out confidence per codebook; Whisper WER/CER

Timings of each stage are written to work/build.json and, with the figures, to assets/report.json.
Measured on the 2-core development machine (shared with other jobs, one torch thread):
see `assets/report.json` ("timings_seconds") for the figures of the shipped build, summed up in docs/standin.md.
"""

import json
import shutil
import time
from dataclasses import asdict, replace

import torch

from rvqspec.core.checkpoint import save_json, save_tensors
from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler
from rvqspec.standin.settings import ASSET_LIMIT_BYTES, BUDGETS, SHIPPED_DTYPE, SPLITS, Settings, load_utterances
from rvqspec.standin.talker import load_standin, new_standin, predictor_config_for, save_standin

# ---------------------------------------------------------------- stages


def stage_corpus(s: Settings) -> dict:
    from rvqspec.standin.speech import build_corpus, read_manifest, summary

    build_corpus(s.manifest.parent, s.hours)
    rows = read_manifest(s.manifest)
    print(summary(rows))
    return {"hours": round(sum(r["duration"] for r in rows) / 3600, 3), "sentences": len(rows)}


def stage_codec(s: Settings) -> dict:
    """Fit the codec, then measure what it loses: Whisper WER of the English test sentences, original vs
    vocoded mel vs codec round trip (English only: Whisper base cannot transcribe espeak-ng's de/es/ru even
    from the original audio)."""
    from rvqspec.standin.codec import train_codec
    from rvqspec.standin.quality import codec_report

    train_codec(s.manifest, s.codec_file)
    report = codec_report(s.manifest, s.codec_file, ("en",))
    save_json(s.codec_report_file, report)
    return {"bytes": s.codec_file.stat().st_size, "wer": {lang: r["wer"] for lang, r in report["langs"].items()}}


def stage_encode(s: Settings) -> dict:
    """Codes of every utterance: codes.safetensors (int16 [N, 16] + offsets) and utterances.json."""
    from rvqspec.standin.audio import read_wav
    from rvqspec.standin.codec import MelRVQCodec
    from rvqspec.standin.speech import read_manifest

    codec = MelRVQCodec.load(s.codec_file)
    rows = read_manifest(s.manifest)
    codes = [codec.encode(read_wav(s.manifest.parent / r["wav"])) for r in rows]
    lengths = torch.tensor([0] + [len(c) for c in codes])
    save_tensors(s.codes_dir / "codes.safetensors", {"codes": torch.cat(codes).to(torch.int16),
                                                     "offsets": lengths.cumsum(0)})
    save_json(s.codes_dir / "utterances.json", [{k: r[k] for k in ("id", "lang", "split", "text")} for r in rows])
    return {"utterances": len(rows), "frames": int(lengths.sum())}


def bytes_per_frame(utts, languages: tuple[str, ...]) -> list[float]:
    """Mean UTF-8 bytes of text per 80 ms frame of speech, per language (the talker's RoPE step)."""
    rates = []
    for lang in languages:
        chosen = [u for u in utts if u.lang == lang]
        if not chosen:
            raise RvqspecError(f"no {lang} utterance in the train split: rebuild the corpus with all languages")
        rates.append(round(sum(len(u.text.encode()) for u in chosen) / sum(len(u.codes) for u in chosen), 4))
    return rates


def stage_joint(s: Settings) -> dict:
    from rvqspec.standin.training import train_joint

    train_utts = load_utterances(s, "train")
    config = replace(s.talker, bytes_per_frame=tuple(bytes_per_frame(train_utts, s.talker.languages)))
    torch.manual_seed(s.seed)
    tts = new_standin(config, predictor_config_for(config, **s.predictor_sizes))
    report = train_joint(tts, train_utts, load_utterances(s, "validation"), s.joint_steps, s.predictor_fraction,
                         minutes=s.joint_minutes, seed=s.seed)
    save_standin(tts, s.joint_dir, SHIPPED_DTYPE, extra={"phase": "joint"})
    save_json(s.joint_dir / "train.json", report)
    return report


def stage_code_corpus(s: Settings) -> dict:
    """The frozen (shipped-dtype) talker's teacher-forced state per frame, for every split."""
    from rvqspec.standin.training import teacher_forced_hidden
    from rvqspec.tuning.corpus import CorpusWriter

    tts = load_standin(s.joint_dir)
    frames = {}
    for split in SPLITS:
        utts = load_utterances(s, split)
        meta = {"writer": "rvqspec standin build", "split": split, "talker": str(s.joint_dir)}
        with CorpusWriter(s.code_corpus(split), tts.config.hidden_size, hidden_dtype=torch.float32, meta=meta,
                          overwrite=True) as writer:
            for utt in utts:
                writer.add(utt.id, utt.lang, utt.codes, teacher_forced_hidden(tts, utt))
        frames[split] = sum(len(u.codes) for u in utts)
    return {"frames": frames}


def stage_predictor(s: Settings) -> dict:
    from rvqspec.standin.training import train_predictor
    from rvqspec.tuning.corpus import Corpus

    tts = load_standin(s.joint_dir)
    report = train_predictor(tts.predictor, Corpus(s.code_corpus("train"), 0.0),
                             Corpus(s.code_corpus("validation"), 0.0), s.predictor_steps,
                             batch_frames=s.predictor_batch_frames, minutes=s.predictor_minutes, seed=s.seed)
    joint_report = json.loads((s.joint_dir / "train.json").read_text())
    save_standin(tts, s.model_dir, SHIPPED_DTYPE, extra={"codec": "codec.safetensors", "frame_rate": 12.5,
                                                       "sample_rate": 16000, "training": {
                                                           "joint": joint_report, "predictor": report}})
    return report


def stage_offsets(s: Settings) -> dict:
    from rvqspec.tuning.train import TrainSettings, train

    out = s.work / "offsets"
    metrics = train(s.model_dir, s.code_corpus("train"), out, TrainSettings(seed=s.seed), epochs=s.offsets_epochs,
                    force=True, progress=False)
    shutil.copyfile(out / metrics["best"]["file"], s.offsets_file)
    return {"best": metrics["best"], "baseline": metrics["baseline"], "epochs": metrics["epochs"]}


def stage_calibrate(s: Settings) -> dict:
    from rvqspec.tuning.calibrate import CalibrationSettings, calibrate

    report = calibrate(s.model_dir, str(s.offsets_file), s.code_corpus("train"), BUDGETS, s.trees_dir,
                       CalibrationSettings(seed=s.seed))
    return {"trees": report["trees"]}


def stage_quality(s: Settings) -> dict:
    from rvqspec.standin.training import predictor_confidence
    from rvqspec.tuning.corpus import Corpus

    tts = load_standin(s.model_dir)
    figures = {split: predictor_confidence(tts, Corpus(s.code_corpus(split), 0.0), Sampler())
               for split in ("validation", "test")}
    figures["wer"] = intelligibility(s, tts)
    return figures


def intelligibility(s: Settings, tts) -> dict:
    """Whisper WER/CER per language of test sentences synthesized by the stand-in (AR, deployed samplers),
    beside the WER of the original recordings of the same sentences (the recogniser's own floor) and the
    chance level: the same transcripts scored against the next test sentence of the language (what speech
    unrelated to the text scores). WER is a signal only where it sits clearly below chance.
    Synthesis and transcription are `rvqspec eval`'s (which also compares AR with speculative)."""
    from rvqspec.standin.audio import read_wav
    from rvqspec.standin.quality import WhisperASR, cer, codec_vocoder, error_rates, transcripts
    from rvqspec.standin.synthesis import synthesize_all, test_sentences

    sentences = test_sentences(s.manifest, list(tts.config.languages), s.quality_limit)
    runs = synthesize_all(tts, sentences, s.seed, "ar", None, None)
    vocoder, asr = codec_vocoder(s.codec_file), WhisperASR()
    heard = transcripts(runs, sentences, vocoder, asr)
    original = [asr(read_wav(s.manifest.parent / x["wav"]), x["lang"]) for x in sentences]
    rates = {"wer": error_rates(heard, sentences), "cer": error_rates(heard, sentences, metric=cer),
             "chance_wer": error_rates(heard, sentences, shift=1),
             "chance_cer": error_rates(heard, sentences, shift=1, metric=cer),
             "original_wer": error_rates(original, sentences)}
    figures = {}
    for lang in tts.config.languages:
        chosen = [i for i, x in enumerate(sentences) if x["lang"] == lang]
        figures[lang] = {"sentences": len(chosen), **{name: round(of[lang], 4) for name, of in rates.items()},
                         "examples": [{"text": sentences[i]["text"], "heard": heard[i]} for i in chosen[:3]]}
        print(f"{lang}: WER {figures[lang]['wer']:.3f} CER {figures[lang]['cer']:.3f} (chance: WER "
              f"{figures[lang]['chance_wer']:.3f} CER {figures[lang]['chance_cer']:.3f}; original recordings: WER "
              f"{figures[lang]['original_wer']:.3f})")
    return figures


STAGES = {"corpus": stage_corpus, "codec": stage_codec, "encode": stage_encode, "joint": stage_joint,
          "code-corpus": stage_code_corpus, "predictor": stage_predictor, "offsets": stage_offsets,
          "calibrate": stage_calibrate, "quality": stage_quality}


def stage_done(s: Settings, stage: str) -> bool:
    outputs = {"corpus": s.manifest, "codec": s.codec_file, "encode": s.codes_dir / "utterances.json",
               "joint": s.joint_dir / "train.json", "code-corpus": s.code_corpus("test") / "index.json",
               "predictor": s.model_dir / "model.safetensors", "offsets": s.offsets_file,
               "calibrate": s.trees_dir / "report.json", "quality": s.report_file}
    return outputs[stage].exists()


def asset_bytes(s: Settings) -> int:
    """Bytes of the shipped files (model, codec, offsets, trees), this report aside."""
    return sum(f.stat().st_size for f in s.assets.rglob("*") if f.is_file() and f != s.report_file)


def build(s: Settings, first: str = "corpus", last: str = "quality", force: tuple[str, ...] = ()) -> dict:
    names = list(STAGES)
    for name in (first, last, *force):
        if name not in STAGES:
            raise RvqspecError(f"unknown stage {name!r}: stages are {', '.join(names)}")
    if names.index(first) > names.index(last):
        raise RvqspecError(f"--from {first} comes after --to {last}: no stage to run (stages in order: "
                           f"{', '.join(names)})")
    torch.set_num_threads(1)  # the machine is shared; every figure below is for one thread
    log_path = s.work / "build.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else {"stages": {}}
    ran = False  # once a stage runs, every later one does: their inputs changed
    for name in names[names.index(first):names.index(last) + 1]:
        if stage_done(s, name) and name not in force and name != last and not ran:
            print(f"== {name}: done already (pass --force {name} to redo)")
            continue
        ran = True
        print(f"== {name}")
        start = time.perf_counter()
        result = STAGES[name](s)
        log["stages"][name] = {"seconds": round(time.perf_counter() - start, 1), "result": result}
        save_json(log_path, log)
        print(f"== {name}: {log['stages'][name]['seconds']:.0f} s")
    write_report(s, log)
    return log


def write_report(s: Settings, log: dict) -> None:
    """assets/report.json: what the demo and docs/standin.md quote (timings, sizes, confidence, WER)."""
    from rvqspec.standin.speech import read_manifest

    stages = log["stages"]
    rows = read_manifest(s.manifest) if s.manifest.is_file() else []
    corpus = {lang: {split: {"sentences": len(of_split), "hours": round(sum(r["duration"] for r in of_split) / 3600, 3)}
                     for split in SPLITS for of_split in [[r for r in rows if r["lang"] == lang and r["split"] == split]]}
              for lang in sorted({r["lang"] for r in rows})}
    codec = json.loads(s.codec_report_file.read_text()) if s.codec_report_file.is_file() else None
    report = {"settings": {k: str(v) for k, v in asdict(s).items()},
              "timings_seconds": {name: stage["seconds"] for name, stage in stages.items()},
              "corpus": corpus, "codec": codec, "quality": stages.get("quality", {}).get("result"),
              "offsets": stages.get("offsets", {}).get("result")}
    if s.model_dir.is_dir():
        report["asset_bytes"] = asset_bytes(s)
        save_json(s.report_file, report)
        if report["asset_bytes"] > ASSET_LIMIT_BYTES:
            print(f"warning: {s.assets} holds {report['asset_bytes'] / 1e6:.1f} MB, over the 20 MB budget")


# ---------------------------------------------------------------- CLI
