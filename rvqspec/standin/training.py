"""Training of the stand-in, teacher forced, in two phases.

1. Joint (`train_joint`): talker and predictor together, as upstream's fine-tuning does. The talker runs
   over [lang, bytes, bos, frames...] (batches of utterances of similar length) with CE of its c0 head
   at the positions that emit c0(0..T-1) and eos; its hidden state at those positions conditions the
   predictor on the frame, teacher forced over the 16 codes like upstream `forward_sub_talker_finetune`
   (CE on c1..c15), and the predictor's loss reaches the talker through that state. A predictor pass
   costs 16 positions per frame against about two for the talker (bytes + frame), so each step feeds
   only a random `predictor_fraction` of the batch's frames to the predictor: the talker, which must
   learn the text-to-speech alignment, gets more updates in the same CPU time.
2. The talker is frozen (rounded to the shipped dtype); its teacher-forced hidden state per frame is
   written to a code corpus (`rvqspec.tuning.corpus`), the data the drafters are trained on too.
3. Predictor (`train_predictor`): more epochs on those (hidden, codes) frames alone, in shuffled frame
   batches. The code tables stay frozen: they are the talker's input too.

Both phases use AdamW with warm-up and cosine decay over a fixed number of steps (a run is
reproducible; `minutes` only caps the wall time) and keep the epoch with the best validation loss: on
3.4 hours of speech the joint phase starts to overfit after about five epochs. Steps run under bf16
autocast where the CPU supports bf16 natively (`fast_autocast`).
"""

import contextlib
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.sampling import Sampler
from rvqspec.standin.talker import StandinTTS
from rvqspec.tuning.corpus import Corpus


@dataclass
class Utterance:
    id: str
    lang: str
    text: str
    codes: Tensor  # [T, 16] int64


@dataclass
class Batch:
    inputs: Tensor  # [B, S, H] talker input embeddings (right-padded)
    positions: Tensor  # [B, S] RoPE ids (text-aligned for the frames, see StandinTTS.frame_positions)
    c0_targets: Tensor  # [B, S] c0/eos target per position, -100 where none
    frame_rows: Tensor  # [N] batch row of each frame
    frame_positions: Tensor  # [N] talker position whose hidden state emits the frame's c0
    frame_codes: Tensor  # [N, 16]


def make_batch(tts: StandinTTS, utts: list[Utterance], frame_dropout: float = 0.0) -> Batch:
    """Embed utterances into one right-padded talker batch (causal attention never sees the padding).

    `frame_dropout` drops elements of the frames' input embeddings (training only): like Tacotron's prenet
    dropout, it keeps a teacher-forced talker from leaning on the previous frames instead of the text."""
    eos = tts.config.codec_eos_token_id
    prefixes = tts.prefix_embeds([u.text for u in utts], [u.lang for u in utts])
    frames = F.dropout(tts.frame_embed(torch.cat([u.codes for u in utts])), frame_dropout, training=frame_dropout > 0)
    frames = frames.split([len(u.codes) for u in utts])
    sequences, rope, targets, rows, positions = [], [], [], [], []
    for row, (utt, prefix, frame_inputs) in enumerate(zip(utts, prefixes, frames)):
        sequences.append(torch.cat([prefix, frame_inputs]))
        rope.append(torch.cat([tts.prefix_positions(len(prefix)),
                               tts.frame_positions(torch.arange(len(utt.codes)), utt.lang)]))
        first = len(prefix) - 1  # the bos position emits c0(0)
        target = torch.full((len(sequences[-1]),), -100, dtype=torch.long)
        target[first:first + len(utt.codes)] = utt.codes[:, 0]
        target[first + len(utt.codes)] = eos
        targets.append(target)
        rows.append(torch.full((len(utt.codes),), row))
        positions.append(torch.arange(first, first + len(utt.codes)))
    length = max(len(s) for s in sequences)
    inputs = torch.stack([F.pad(s, (0, 0, 0, length - len(s))) for s in sequences])
    c0_targets = torch.stack([F.pad(t, (0, length - len(t)), value=-100) for t in targets])
    rope = torch.stack([F.pad(r, (0, length - len(r))) for r in rope])
    return Batch(inputs, rope, c0_targets, torch.cat(rows), torch.cat(positions), torch.cat([u.codes for u in utts]))


def talker_hidden(tts: StandinTTS, batch: Batch) -> Tensor:
    return tts.talker(batch.inputs, batch.positions)


def predictor_loss(predictor: MultiCodeDecoder, hidden: Tensor, codes: Tensor) -> Tensor:
    logits = predictor.teacher_forced_logits(hidden, codes)
    return F.cross_entropy(logits.flatten(0, 1).float(), codes[:, 1:].flatten())


def length_batches(utts: list[Utterance], max_positions: int, rng: random.Random) -> list[list[Utterance]]:
    """Shuffled batches of similar length whose padded size stays under `max_positions` talker positions."""
    size = {id(u): len(u.codes) + len(u.text.encode()) + 3 for u in utts}
    order = sorted(utts, key=lambda u: size[id(u)] + rng.random())
    batches, current, longest = [], [], 0
    for utt in order:
        if current and max(longest, size[id(utt)]) * (len(current) + 1) > max_positions:
            batches.append(current)
            current, longest = [], 0
        current.append(utt)
        longest = max(longest, size[id(utt)])
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params: list[Tensor], lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on gains (1-D)."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def fast_autocast() -> contextlib.AbstractContextManager:
    """bf16 autocast with plain (math) attention on CPUs that multiply bf16 natively (AMX/AVX512-BF16): about
    2x faster training steps than float32 here; master weights and the optimizer stay float32."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    stack.enter_context(sdpa_kernel(SDPBackend.MATH))  # CPU flash attention's bf16 backward is slow
    return stack


def optimize(params: list[Tensor], batches, loss_fn, steps: int, lr: float, warmup: int, minutes: float | None,
             evaluate, log, log_every: int) -> dict:
    """The shared loop: `batches(epoch)` yields batches, `loss_fn(batch)` a loss; after each epoch `evaluate()`
    gives named validation losses, and the parameters of the epoch with the lowest sum are kept (early stopping)."""
    optimizer = make_optimizer(params, lr)
    start, step, epoch, history = time.perf_counter(), 0, 0, []
    best, best_params, best_epoch = math.inf, [], 0
    deadline = start + 60 * minutes if minutes else math.inf
    while step < steps and time.perf_counter() < deadline:
        epoch_start = step
        for batch in batches(epoch):
            if step >= steps or time.perf_counter() >= deadline:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup)
            with fast_autocast():
                loss = loss_fn(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if step % log_every == 0:
                log(f"step {step}/{steps} epoch {epoch} loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)")
        if step == epoch_start:
            raise RvqspecError("the training data holds less than one batch: use a smaller batch or more data")
        epoch += 1
        with torch.no_grad():
            validation = {name: round(value, 4) for name, value in evaluate().items()}
        history.append({"epoch": epoch, "step": step, "validation_loss": validation})
        log(f"epoch {epoch}: {history[-1]}")
        if sum(validation.values()) < best:
            best, best_params, best_epoch = sum(validation.values()), [p.detach().clone() for p in params], epoch
    with torch.no_grad():
        for p, kept in zip(params, best_params):
            p.copy_(kept)
    return {"steps": step, "epochs": epoch, "best_epoch": best_epoch, "seconds": round(time.perf_counter() - start, 1),
            "history": history}


def joint_loss(tts: StandinTTS, batch: Batch, predictor_fraction: float,
               generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(talker CE, predictor CE on a random `predictor_fraction` of the batch's frames)."""
    hidden = talker_hidden(tts, batch)
    logits = tts.talker.codec_head(hidden)
    c0_loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.c0_targets.flatten())
    frames = len(batch.frame_codes)
    chosen = torch.randperm(frames, generator=generator)[:max(1, round(predictor_fraction * frames))]
    frame_hidden = hidden[batch.frame_rows[chosen], batch.frame_positions[chosen]]
    return c0_loss, predictor_loss(tts.predictor, frame_hidden, batch.frame_codes[chosen])


def train_joint(tts: StandinTTS, train_utts: list[Utterance], val_utts: list[Utterance], steps: int,
                predictor_fraction: float = 0.25, frame_dropout: float = 0.2, lr: float = 2e-3,
                max_positions: int = 2000, warmup: int = 100, minutes: float | None = None, seed: int = 0, log=print,
                log_every: int = 50) -> dict:
    """Phase 1, in place: talker, predictor and the shared code tables; the loss is talker CE + predictor CE."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    tts.train().requires_grad_(True)

    def evaluate() -> dict:
        tts.eval()
        total = torch.zeros(2)
        for b in length_batches(val_utts, 4 * max_positions, random.Random(0)):
            total += torch.stack(joint_loss(tts, make_batch(tts, b), 1.0, generator)).float() * len(b)
        tts.train()
        return {"talker": float(total[0]) / len(val_utts), "predictor": float(total[1]) / len(val_utts)}

    report = optimize(list(tts.parameters()), lambda epoch: length_batches(train_utts, max_positions, rng),
                      lambda utts: sum(joint_loss(tts, make_batch(tts, utts, frame_dropout), predictor_fraction,
                                                  generator)),
                      steps, lr, warmup, minutes, evaluate, log, log_every)
    tts.eval().requires_grad_(False)
    return report


def train_predictor(predictor: MultiCodeDecoder, train_corpus: Corpus, val_corpus: Corpus, steps: int,
                    lr: float = 2e-3, batch_frames: int = 256, warmup: int = 100, minutes: float | None = None,
                    seed: int = 0, log=print, log_every: int = 50) -> dict:
    """Phase 3, in place: everything of the predictor but the code tables (shared with the talker).

    The corpora must be read with validation_fraction=0 (every utterance in their "train" split)."""
    torch.manual_seed(seed)
    predictor.train().requires_grad_(True)
    predictor.code_embed.weight.requires_grad_(False)
    params = [p for p in predictor.parameters() if p.requires_grad]
    dtype = predictor.dtype

    def evaluate() -> dict:
        predictor.eval()
        total = sum(float(predictor_loss(predictor, h.to(dtype), c)) * len(c)
                    for c, h in val_corpus.batches("train", 4 * batch_frames))
        predictor.train()
        return {"predictor": total / val_corpus.num_frames("train")}

    report = optimize(params, lambda epoch: train_corpus.batches("train", batch_frames, seed, epoch, drop_last=True),
                      lambda batch: predictor_loss(predictor, batch[1].to(dtype), batch[0]), steps, lr, warmup,
                      minutes, evaluate, log, log_every)
    predictor.eval().requires_grad_(False)
    return report


@torch.no_grad()
def teacher_forced_hidden(tts: StandinTTS, utt: Utterance) -> Tensor:
    """The talker's hidden state conditioning each frame of `utt` [T, H] (teacher forced)."""
    batch = make_batch(tts, [utt])
    return talker_hidden(tts, batch)[batch.frame_rows, batch.frame_positions]


def target_confidence(probs: Tensor) -> tuple[Tensor, Tensor]:
    """Top-1 probability and entropy (nats) of target distributions p~ [..., V]."""
    return probs.max(-1).values, -(probs * probs.clamp_min(1e-30).log()).sum(-1)


@torch.no_grad()
def frame_confidence(predictor: MultiCodeDecoder, hidden: Tensor, codes: Tensor,
                     sampler: Sampler) -> tuple[Tensor, Tensor]:
    """Top-1 probability and entropy of the sampler's p~ for c1..c15 of each frame [N, 15] (teacher forced)."""
    return target_confidence(sampler.probs(predictor.teacher_forced_logits(hidden.to(predictor.dtype), codes)))


@torch.no_grad()
def predictor_confidence(tts: StandinTTS, corpus: Corpus, sampler: Sampler, batch_frames: int = 1024) -> dict:
    """Per codebook c1..c15, over every frame of `corpus` (read with validation_fraction=0): mean top-1
    probability and entropy (nats) of the sampler's target distribution p~; the same for the talker's c0."""
    stats = {"top1": [], "entropy": [], "c0_top1": [], "c0_entropy": []}
    for codes, hidden in corpus.batches("train", batch_frames):
        hidden = hidden.to(tts.predictor.dtype)
        top1, entropy = frame_confidence(tts.predictor, hidden, codes, sampler)
        c0_top1, c0_entropy = target_confidence(sampler.probs(tts.talker.codec_head(hidden)))
        for name, value in zip(stats, (top1, entropy, c0_top1, c0_entropy)):
            stats[name].append(value)
    top1, entropy, c0_top1, c0_entropy = (torch.cat(stats[name]).mean(0) for name in stats)
    return {"frames": corpus.num_frames("train"), "sampler": sampler.__dict__,
            "top1": [round(float(x), 4) for x in top1], "entropy": [round(float(x), 3) for x in entropy],
            "mean_top1": round(float(top1.mean()), 4), "mean_entropy": round(float(entropy.mean()), 3),
            "c0_top1": round(float(c0_top1), 4), "c0_entropy": round(float(c0_entropy), 3)}
