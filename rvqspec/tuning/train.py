"""`rvqspec train-offsets`: train a drafter (offsets, or Medusa heads) against the frozen code predictor.

docs/design.md, section 4: everything of the predictor is frozen; per batch of frames one teacher-forced pass
over all G positions gives h_i, and for each depth j the drafter's logits for c_{i+j} (all valid i)
are scored with cross entropy; the loss is the sum over j of the mean over positions and frames.
Adam, lr 1e-3, 32 frames per batch by default. Each epoch: validation loss and top-1 draft accuracy
per depth, beside the accuracy of the reused heads (zero offsets, the untrained drafter).

Many processes: `torchrun --nproc-per-node R -m rvqspec.cli.main train-offsets ...` trains with
DistributedDataParallel (nccl on GPUs, gloo on CPU). The global batch stays --batch-size frames, each
rank computing the mean over its equal slice, and DDP averages the gradients: the same update as one
process, whatever R. Files are written by rank 0 (the output folder must be shared by all ranks).

Output folder: `last.pt` (drafter, optimizer, step, RNG state: `--resume` continues from it, with the
same data order), `offsets.safetensors` or `medusa.safetensors` (the best epoch by validation loss, the
file `rvqspec calibrate` and `decode_frame` use), `metrics.json`. All written atomically.
"""

import io
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rvqspec.core.checkpoint import atomic_write, save_json
from rvqspec.core.drafters import DEFAULT_DEPTH, Drafter, ReusedHeads, make_drafter, model_fingerprint
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder, resolve_dtype
from rvqspec.core.sampling import Sampler
from rvqspec.tuning.corpus import Corpus, check_codes

CHECKPOINT_FORMAT = "rvqspec-train/1"


@dataclass(frozen=True)
class TrainSettings:
    """What defines a run: a resumed run must have the same."""

    drafter: str = "offsets"
    depth: int = DEFAULT_DEPTH
    batch_size: int = 32
    lr: float = 1e-3
    seed: int = 0
    validation_fraction: float = 0.05
    objective: str = "codes"  # or "acceptance" (`DraftLoss`)


OBJECTIVES = ("codes", "acceptance")


class DraftLoss(nn.Module):
    """Per depth j: the summed loss and top-1 hits of the drafts for c_{i+j}, every valid i.

    objective "codes": cross entropy of the corpus's codes (the paper's). "acceptance": -log sum_v q(v) p(v), q the
    draft's distribution and p the verifier's (the frozen model's own heads under the deployed sampler, given the
    true prefix): the log-probability that a draft drawn from q is what the verifier draws, the quantity that
    sample-then-match accepts; it needs no label, only the model. The frozen model is held outside the module
    tree, so DDP sees only the drafter's parameters.

    Its hidden states are computed with grad enabled (its parameters are frozen: no graph is built), so that they
    take the plain path: under no_grad a CPU forward takes the inference fast path, whose bits depend on what the
    process could build (the fused kernels) and measured, and a run resumed in another process (after a kill) would
    then train on other bits than the uninterrupted one."""

    def __init__(self, model: MultiCodeDecoder, drafter: Drafter, objective: str = "codes",
                 sampler: Sampler = Sampler()):
        super().__init__()
        if objective not in OBJECTIVES:
            raise RvqspecError(f"unknown training objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
        self.drafter, self.objective, self.sampler = drafter, objective, sampler
        self.frozen = [model]

    def forward(self, hidden: Tensor, codes: Tensor) -> tuple[Tensor, Tensor]:
        model = self.frozen[0]
        with torch.enable_grad():  # the plain path, also under evaluate's no_grad (the docstring)
            h = model.teacher_forced_hidden(hidden, codes).detach()
        with torch.no_grad():
            log_p = self.verifier_log_probs(model, h) if self.objective == "acceptance" else None
        losses, hits = [], []
        for j in range(1, self.drafter.depth + 1):
            logits = self.drafter.teacher_forced_logits(model, h, j)
            target = codes[:, 1 + j:]  # c_{i+j} for i = 1..G-1-j
            if log_p is None:
                losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"))
            else:  # the verifier's p for c_{i+j}, from h_{i+j-1}: codebooks 1+j..last
                losses.append(-(logits.log_softmax(-1) + log_p[:, j:]).logsumexp(-1).sum())
            hits.append((logits.argmax(-1) == target).sum())
        return torch.stack(losses), torch.stack(hits)

    def verifier_log_probs(self, model: MultiCodeDecoder, h: Tensor) -> Tensor:
        """log p~ [B, last, V] of codebooks 1..last (codebook c from h_c, as AR decodes it), under the deployed
        sampler."""
        last = model.config.num_residual_codes
        logits = torch.einsum("bph,pvh->bpv", h[:, 1:last + 1], model.heads[:last])
        return self.sampler.probs(logits.float()).log().to(logits.dtype)


def positions_per_frame(model: MultiCodeDecoder, depth: int) -> Tensor:
    """How many drafts each frame has at depth j = 1..depth: G-1-j."""
    return model.config.num_residual_codes - torch.arange(1, depth + 1, dtype=torch.float64)


def all_reduce_sum(tensor: Tensor, world_size: int) -> Tensor:
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor


@torch.no_grad()
def evaluate(loss_fn: DraftLoss, corpus: Corpus, batch_size: int, rank: int = 0, world_size: int = 1) -> dict:
    """Validation loss (sum over depths of the mean CE) and top-1 accuracy per depth, all ranks together."""
    model, depth = loss_fn.frozen[0], loss_fn.drafter.depth
    totals = torch.zeros(2 * depth + 1, dtype=torch.float64, device=model.device)  # CE sums, hits, frames
    for codes, hidden in corpus.batches("validation", batch_size, rank=rank, world_size=world_size):
        check_codes(codes, model)
        losses, hits = loss_fn(hidden.to(model.device), codes.to(model.device))
        totals += torch.cat([losses.double(), hits.double(), torch.tensor([len(codes)], device=model.device)])
    totals = all_reduce_sum(totals, world_size).cpu()
    positions = totals[-1] * positions_per_frame(model, depth)
    return {"loss": float((totals[:depth] / positions).sum()), "accuracy": (totals[depth:-1] / positions).tolist(),
            "frames": int(totals[-1])}


def init_distributed(device: str | None) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; one process when WORLD_SIZE is unset."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if world_size == 1:
        return 0, 1, torch.device(device or ("cuda" if use_cuda else "cpu"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world_size, torch.device("cuda", local)
    return rank, world_size, torch.device("cpu")


def drafter_file(out: Path, kind: str) -> Path:
    return out / f"{kind}.safetensors"


def load_checkpoint(out: Path, settings: TrainSettings, identity: dict, resume: bool, force: bool) -> dict | None:
    """The state to resume from, or None to start fresh; refuses to clobber an earlier run."""
    last = out / "last.pt"
    if not resume:
        if last.exists() and not force:
            raise RvqspecError(f"{out} already holds a training run: pass --resume to continue it, --force to start "
                               "over, or another --out")
        ours = [p.name for p in (out / "metrics.json", drafter_file(out, settings.drafter)) if p.exists()]
        if ours and not force:
            raise RvqspecError(f"{out} already holds {', '.join(ours)} (no run to resume): pass another --out, or "
                               "--force to overwrite them")
        return None
    if not last.is_file():
        raise RvqspecError(f"nothing to resume: {last} does not exist (drop --resume to start a new run)")
    try:
        state = torch.load(last, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign: torch raises several types
        raise RvqspecError(f"{last} cannot be read ({type(e).__name__}): it is damaged; start over with --force") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise RvqspecError(f"{last} is not an rvqspec training checkpoint")
    if state["settings"] != asdict(settings) or state["identity"] != identity:
        raise RvqspecError(f"{last} was trained with {state['settings']} on {state['identity']}, not "
                           f"{asdict(settings)} on {identity}: resume with the same settings, model and corpus")
    return state


def save_checkpoint(out: Path, state: dict) -> None:
    """last.pt, serialized in memory first: a full disk is then an OSError naming the file (torch.save writing to a
    file reports it as a RuntimeError about stream positions)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(out / "last.pt", lambda tmp: Path(tmp).write_bytes(buffer.getbuffer()))


class NoBar:
    """Stands in for a tqdm bar that is off, or whose package (the `train` extra) is not installed."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **kwargs) -> None:
        pass


def progress_bar(iterable, show: bool, **kwargs):
    """A tqdm bar over `iterable` when `show` and tqdm is installed, else the iterable as it is."""
    if show:
        try:
            from tqdm import tqdm
        except ImportError:
            return NoBar(iterable)
        return tqdm(iterable, **kwargs)
    return NoBar(iterable)


@dataclass(frozen=True)
class Job:
    """What `train` is asked to do, besides the settings that define the run."""

    model_path: str | Path
    corpus_path: str | Path
    out: Path
    epochs: int
    max_steps: int | None
    resume: bool
    force: bool
    dtype: str
    progress: bool


@dataclass
class Ranks:
    rank: int
    world_size: int
    device: torch.device


@dataclass
class Session:
    """A run in progress: the frozen model, the corpus, the drafter and its optimizer, and the state saved in
    last.pt (step, epoch loss, best validation loss, metrics)."""

    job: Job
    settings: TrainSettings
    ranks: Ranks
    model: MultiCodeDecoder
    corpus: Corpus
    steps_per_epoch: int
    drafter: Drafter
    optimizer: torch.optim.Optimizer
    state: dict

    def checkpoint(self, step: int, epoch_loss_sum: float) -> None:
        self.state.update(step=step, epoch_loss_sum=epoch_loss_sum, drafter=self.drafter.state_dict(),
                          optimizer=self.optimizer.state_dict(), rng=torch.get_rng_state())
        if self.ranks.rank == 0:
            save_checkpoint(self.job.out, self.state)
            save_json(self.job.out / "metrics.json", self.state["metrics"])


def train(model_path: str | Path, corpus_path: str | Path, out: str | Path, settings: TrainSettings = TrainSettings(),
          epochs: int = 1, max_steps: int | None = None, resume: bool = False, force: bool = False,
          dtype: str = "float32", device: str | None = None, progress: bool = True) -> dict:
    """Train a drafter; returns the metrics also written to `out`/metrics.json. See the module docstring."""
    job = Job(model_path, corpus_path, Path(out), epochs, max_steps, resume, force, dtype, progress)
    ranks = Ranks(*init_distributed(device))
    try:
        metrics = run_training(start(job, settings, ranks))
        if ranks.world_size > 1:  # tear gloo down together: a rank that leaves while the other still works can abort
            dist.barrier()  # ("terminate called without an active exception", seen in ~1 of 8 two-process runs)
        return metrics
    finally:
        if ranks.world_size > 1:
            dist.destroy_process_group()


def check_job(job: Job, settings: TrainSettings, world_size: int) -> None:
    if resolve_dtype(job.dtype) not in (torch.float32, torch.float64):
        raise RvqspecError(f"training needs --dtype float32 (or float64): Adam steps on {job.dtype} drafter weights "
                           "would be lost to rounding")
    if settings.drafter == "reused":
        raise RvqspecError("the reused heads have no parameters to train: use --drafter offsets or medusa")
    if settings.batch_size < 1 or settings.batch_size % world_size:
        raise RvqspecError(f"--batch-size {settings.batch_size} is the global batch: it must be a positive multiple "
                           f"of the number of processes ({world_size})")


def open_corpus(job: Job, settings: TrainSettings, model: MultiCodeDecoder) -> tuple[Corpus, int]:
    """The corpus, checked against the model, and its train batches per epoch."""
    corpus = Corpus(job.corpus_path, settings.validation_fraction)
    corpus.check_model(model)
    steps_per_epoch = corpus.num_batches("train", settings.batch_size, drop_last=True)
    if steps_per_epoch == 0:
        raise RvqspecError(f"the train split of {corpus.path} has {corpus.num_frames('train')} frames, fewer than "
                           f"one batch of {settings.batch_size}: use a larger corpus or a smaller --batch-size")
    if corpus.num_frames("validation") == 0:
        raise RvqspecError(f"the validation split of {corpus.path} is empty: raise --validation-fraction")
    return corpus, steps_per_epoch


def start(job: Job, settings: TrainSettings, ranks: Ranks) -> Session:
    """A new run (with the reused heads' validation figures as its baseline), or the one in `job.out` resumed."""
    check_job(job, settings, ranks.world_size)
    model = MultiCodeDecoder.from_pretrained(job.model_path, job.dtype, ranks.device)
    corpus, steps_per_epoch = open_corpus(job, settings, model)
    torch.manual_seed(settings.seed)
    drafter = make_drafter(settings.drafter, model, settings.depth)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=settings.lr)
    identity = {"model": model_fingerprint(model), "train_frames": corpus.num_frames("train")}
    state = load_checkpoint(job.out, settings, identity, job.resume, job.force)
    if state is None:
        baseline = evaluate(DraftLoss(model, ReusedHeads(model, settings.depth), settings.objective), corpus,
                            settings.batch_size, ranks.rank, ranks.world_size)
        state = {"format": CHECKPOINT_FORMAT, "settings": asdict(settings), "identity": identity,
                 "step": 0, "epoch_loss_sum": 0.0, "best_val_loss": float("inf"),
                 "metrics": {"model": str(job.model_path), "corpus": str(job.corpus_path), "settings": asdict(settings),
                             "steps_per_epoch": steps_per_epoch, "baseline": {"drafter": "reused", **baseline},
                             "epochs": []}}
    else:
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
    state["metrics"]["world_size"] = ranks.world_size
    if ranks.world_size > 1:
        dist.barrier()  # every rank has checked the output folder before rank 0 writes to it
    return Session(job, settings, ranks, model, corpus, steps_per_epoch, drafter, optimizer, state)


def run_training(session: Session) -> dict:
    """Epochs from where the session stands, to `job.epochs` or `job.max_steps`; the metrics."""
    job, ranks, steps_per_epoch = session.job, session.ranks, session.steps_per_epoch
    loss_fn = DraftLoss(session.model, session.drafter, session.settings.objective)
    step_fn = DistributedDataParallel(loss_fn, device_ids=[ranks.device.index] if ranks.device.type == "cuda"
                                      else None) if ranks.world_size > 1 else loss_fn
    step = session.state["step"]
    for epoch in range(step // steps_per_epoch, job.epochs):
        if job.max_steps is not None and step >= job.max_steps:
            break
        step, finished = train_epoch(session, step_fn, epoch, step)
        if not finished:  # stopped at job.max_steps inside the epoch (checkpointed there)
            break
        end_epoch(session, loss_fn, epoch, step)
    if ranks.rank == 0:  # also when nothing was left to do: a finished run resumed rewrites a lost or damaged file
        save_json(job.out / "metrics.json", session.state["metrics"])
    return session.state["metrics"]


def train_epoch(session: Session, step_fn, epoch: int, step: int) -> tuple[int, bool]:
    """The rest of `epoch` from `step` (or up to `job.max_steps`, checkpointed there): (step, epoch finished)."""
    job, ranks, settings, model = session.job, session.ranks, session.settings, session.model
    world_size, steps_per_epoch = ranks.world_size, session.steps_per_epoch
    done = step - epoch * steps_per_epoch
    positions = positions_per_frame(model, settings.depth).to(ranks.device, model.dtype)
    # Sums of this rank's batch losses; summed over ranks / world_size when saved (each rank starts from the same
    # saved value, hence the correction).
    loss_sum = torch.zeros((), dtype=torch.float64, device=ranks.device)
    saved_sum = session.state["epoch_loss_sum"] if done else 0.0
    batches = session.corpus.batches("train", settings.batch_size, settings.seed, epoch, ranks.rank, world_size,
                                     skip=done, drop_last=True)
    bar = progress_bar(batches, job.progress and ranks.rank == 0, total=steps_per_epoch, initial=done,
                       desc=f"epoch {epoch + 1}/{job.epochs}", file=sys.stderr)
    for codes, hidden in bar:
        check_codes(codes, model)
        losses, _ = step_fn(hidden.to(ranks.device), codes.to(ranks.device))
        loss = (losses / (len(codes) * positions)).sum()
        session.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        session.optimizer.step()
        step += 1
        loss_sum += loss.detach()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if job.max_steps is not None and step >= job.max_steps and step % steps_per_epoch:
            session.checkpoint(step, saved_sum + float(all_reduce_sum(loss_sum, world_size)) / world_size)
            return step, False
    session.state["epoch_loss_sum"] = saved_sum + float(all_reduce_sum(loss_sum, world_size)) / world_size
    return step, True


def end_epoch(session: Session, loss_fn: DraftLoss, epoch: int, step: int) -> None:
    """Validation, the epoch's record, the drafter file when it is the best so far, the checkpoint."""
    job, ranks, settings, state = session.job, session.ranks, session.settings, session.state
    metrics, steps_per_epoch = state["metrics"], session.steps_per_epoch
    validation = evaluate(loss_fn, session.corpus, settings.batch_size, ranks.rank, ranks.world_size)
    record = {"epoch": epoch + 1, "step": step, "train_loss": state["epoch_loss_sum"] / steps_per_epoch,
              "val_loss": validation["loss"], "val_accuracy": validation["accuracy"]}
    metrics["epochs"].append(record)
    if validation["loss"] < state["best_val_loss"]:
        state["best_val_loss"] = validation["loss"]
        metrics["best"] = {"epoch": epoch + 1, "val_loss": validation["loss"],
                           "file": drafter_file(job.out, settings.drafter).name}
        if ranks.rank == 0:
            session.drafter.save(drafter_file(job.out, settings.drafter),
                                 {"epoch": str(epoch + 1), "val_loss": f"{validation['loss']:.6f}"})
    session.checkpoint(step, 0.0)
    if job.progress and ranks.rank == 0:
        accuracy = " ".join(f"{a:.3f}" for a in validation["accuracy"])
        baseline = " ".join(f"{a:.3f}" for a in metrics["baseline"]["accuracy"])
        print(f"epoch {epoch + 1}: train loss {record['train_loss']:.4f}, val loss {validation['loss']:.4f}, "
              f"top-1 per depth {accuracy} (reused heads {baseline})", file=sys.stderr)
