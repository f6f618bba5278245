"""Code corpus: per frame, the talker's hidden state and the frame's RVQ codes, grouped in utterances.

What the drafters are trained on and the trees calibrated on. The stand-in model and the qwen-tts
integration both write it with `CorpusWriter`; `Corpus` reads it back.

Layout of a corpus directory:

    index.json               {"format": "rvqspec-corpus/1", "groups": G, "hidden_size": H,
                              "hidden_dtype": "float16", "frames": total, "meta": {...},
                              "shards": [{"file": "shard-<run>-00000.safetensors", "frames": n}, ...],
                              "utterances": [{"id": str, "lang": str, "frames": T, "shard": s,
                                              "start": row}, ...]}
    shard-<run>-00000.safetensors  codes [n, G] int16 (int32 if a code exceeds 32767): c0..c_{G-1} per frame
                             hidden  [n, H] float16 | bfloat16 | float32: the talker's final hidden
                                     state that conditions the code predictor for that frame
                             offsets [U+1] int64: row where each of the shard's U utterances starts

Utterances are never split across shards; utterance u holds rows start..start+frames-1 of its shard.
Shards are written atomically once full (`shard_frames`), index.json last: a directory without
index.json is an unfinished corpus. `meta` is free-form (who wrote it, from which model). Shard names carry the
writing run's tag, so that a corpus written over an old one (`overwrite`) leaves the old one whole until its
index.json replaces the old index (one atomic rename); only then are the old shards deleted. A run that fails or is
interrupted deletes its own shards and nothing else.

Reading checks what a damaged or foreign folder could hold before any work (`check_index`, `check_shard`): the
index's fields and ranges, shard names that stay inside the folder, integer codes >= 0, finite hidden states.

Splits are by utterance: an utterance is in "validation" when the hash of its id falls below
`validation_fraction`, else in "train"; so the split is fixed by the ids alone (any machine, any
order of writing). Training reads frames in global batches: each epoch the shard order and the frame
order inside each shard are shuffled from (seed, epoch) only, so a run can be resumed at any step; a
rank of R processes takes its 1/R slice of every global batch and loads only the shards it needs.
"""

import hashlib
import json
import math
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from rvqspec.core.checkpoint import save_json, save_tensors
from rvqspec.core.errors import RvqspecError
from rvqspec.core.files import read_json

FORMAT = "rvqspec-corpus/1"
SHARD_NAME = re.compile(r"shard-(?:[0-9a-f]{8}-)?\d{5}\.safetensors")  # older corpora: shard-00000.safetensors
MAX_GROUPS, MAX_HIDDEN = 256, 1 << 16  # far above any depth decoder (CSM: 32 codebooks, width 2048)
SPLITS = ("train", "validation")
HIDDEN_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def check_codes(codes: Tensor, model) -> None:
    """Refuse codes outside the model's vocabularies (c0: the talker's table; c1..: the predictor's code tables)."""
    c = model.config
    if int(codes[:, 0].max()) >= c.talker_vocab_size or int(codes[:, 1:].max()) >= c.vocab_size:
        raise RvqspecError(f"corpus codes exceed the model's vocabularies (c0 < {c.talker_vocab_size}, c1.. < "
                           f"{c.vocab_size}): the corpus was written for another model")


def split_of(utterance_id: str, validation_fraction: float) -> str:
    """'validation' or 'train', from a stable hash of the id (not Python's salted hash())."""
    bucket = int(hashlib.sha1(utterance_id.encode()).hexdigest()[:8], 16) / 2**32
    return "validation" if bucket < validation_fraction else "train"


class CorpusWriter:
    """Write a corpus: `with CorpusWriter(path, hidden_size) as w: w.add(id, lang, codes, hidden)`."""

    def __init__(self, path: str | Path, hidden_size: int, groups: int = 16, shard_frames: int = 16384,
                 hidden_dtype: torch.dtype = torch.float16, meta: dict | None = None, overwrite: bool = False):
        self.path = Path(path)
        if (self.path / "index.json").exists() and not overwrite:
            raise RvqspecError(f"{self.path} already holds a corpus: pick another folder or pass --overwrite "
                               "(overwrite=True from Python)")
        self.run = secrets.token_hex(4)  # this run's shard names: an old corpus here stays whole until close()
        if hidden_dtype not in HIDDEN_DTYPES.values():
            raise RvqspecError(f"hidden_dtype must be one of torch.{', torch.'.join(HIDDEN_DTYPES)}, got {hidden_dtype}")
        self.hidden_size, self.groups, self.shard_frames = hidden_size, groups, shard_frames
        self.hidden_dtype, self.meta = hidden_dtype, dict(meta or {})
        self.utterances: list[dict] = []
        self.shards: list[dict] = []
        self.pending: list[tuple[Tensor, Tensor]] = []
        self.pending_frames = 0
        self.ids: set[str] = set()
        self.closed = False

    def add(self, utterance_id: str, lang: str, codes: Tensor, hidden: Tensor) -> None:
        """Append one utterance: codes [T, G] (c0..c_{G-1} of each frame), hidden [T, H] (talker states)."""
        if self.closed:
            raise RvqspecError("this CorpusWriter is closed: open a new one to write more")
        if utterance_id in self.ids:
            raise RvqspecError(f"utterance id {utterance_id!r} was added twice: ids must be unique")
        codes, hidden = torch.as_tensor(codes), torch.as_tensor(hidden)
        frames = codes.shape[0] if codes.dim() == 2 else 0
        if codes.dim() != 2 or codes.shape[1] != self.groups or frames == 0 or codes.is_floating_point():
            raise RvqspecError(f"codes of {utterance_id!r} must be an integer tensor [frames >= 1, {self.groups}], "
                               f"got {codes.dtype} {tuple(codes.shape)}")
        if hidden.shape != (frames, self.hidden_size):
            raise RvqspecError(f"hidden of {utterance_id!r} must be [{frames}, {self.hidden_size}] (one talker state "
                               f"per frame), got {tuple(hidden.shape)}")
        if int(codes.min()) < 0 or int(codes.max()) > torch.iinfo(torch.int32).max:
            raise RvqspecError(f"codes of {utterance_id!r} must be in [0, 2**31): got {int(codes.min())}..{int(codes.max())}")
        stored = hidden.detach().to("cpu", self.hidden_dtype)
        if not torch.isfinite(stored).all():
            raise RvqspecError(f"hidden of {utterance_id!r} is not finite as {self.hidden_dtype} (overflow?): "
                               "write the corpus with hidden_dtype=torch.bfloat16 or torch.float32")
        self.ids.add(utterance_id)
        self.utterances.append({"id": utterance_id, "lang": lang, "frames": frames, "shard": len(self.shards),
                                "start": self.pending_frames})
        self.pending.append((codes.detach().cpu(), stored))
        self.pending_frames += frames
        if self.pending_frames >= self.shard_frames:
            self.flush()

    def flush(self) -> None:
        """Write the pending utterances as one shard."""
        if not self.pending:
            return
        codes = torch.cat([c for c, _ in self.pending])
        lengths = torch.tensor([0] + [len(c) for c, _ in self.pending])
        name = f"shard-{self.run}-{len(self.shards):05d}.safetensors"
        save_tensors(self.path / name, {
            "codes": codes.to(torch.int16 if int(codes.max()) <= torch.iinfo(torch.int16).max else torch.int32),
            "hidden": torch.cat([h for _, h in self.pending]), "offsets": lengths.cumsum(0)})
        self.shards.append({"file": name, "frames": len(codes)})
        self.pending, self.pending_frames = [], 0

    def close(self) -> None:
        if self.closed:
            return
        self.flush()
        if not self.utterances:
            self.discard()
            raise RvqspecError(f"no utterance was added to {self.path}: an empty corpus is not written")
        old = old_shards(self.path)
        save_json(self.path / "index.json", {
            "format": FORMAT, "groups": self.groups, "hidden_size": self.hidden_size,
            "hidden_dtype": str(self.hidden_dtype).removeprefix("torch."),
            "frames": sum(u["frames"] for u in self.utterances), "meta": self.meta,
            "shards": self.shards, "utterances": self.utterances})
        self.closed = True
        for name in old - {s["file"] for s in self.shards}:  # the old corpus's, now unreferenced
            (self.path / name).unlink(missing_ok=True)

    def discard(self) -> None:
        """Delete this run's shards (an error or Ctrl-C before close): an old corpus here stays as it was."""
        self.closed = True
        for shard in self.shards:
            (self.path / shard["file"]).unlink(missing_ok=True)

    def __enter__(self) -> "CorpusWriter":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


def old_shards(path: Path) -> set[str]:
    """The shard files an existing index.json in `path` names (readable or not: nothing if it is damaged)."""
    try:
        return {s["file"] for s in json.loads((path / "index.json").read_text())["shards"]
                if SHARD_NAME.fullmatch(str(s["file"]))}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


class Corpus:
    """Read a corpus written by `CorpusWriter`: frame batches for training, utterances, frame samples."""

    def __init__(self, path: str | Path, validation_fraction: float = 0.05):
        self.path = Path(path)
        index_path = self.path / "index.json"
        if not index_path.is_file():
            hint = "it has shards but no index.json: the writer did not finish, write it again" \
                if any(self.path.glob("shard-*.safetensors")) else "pass a folder written by rvqspec.tuning.corpus.CorpusWriter"
            raise RvqspecError(f"{self.path} is not a code corpus ({hint})")
        index = read_json(index_path, "write the corpus again")
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise RvqspecError(f"{index_path} is not an rvqspec corpus index (expected format {FORMAT!r})")
        if not 0 <= validation_fraction < 1:
            raise RvqspecError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
        check_index(index, index_path)
        self.validation_fraction = validation_fraction
        self.groups, self.hidden_size = index["groups"], index["hidden_size"]
        self.meta, self.shards, self.utterances = index.get("meta", {}), index["shards"], index["utterances"]
        self.cache: dict[int, dict[str, Tensor]] = {}

    def check_model(self, model) -> None:
        """Refuse a corpus whose talker states or codebook count do not fit the code predictor `model`."""
        c = model.config
        if self.hidden_size != c.talker_hidden_size or self.groups != c.num_code_groups:
            raise RvqspecError(f"corpus {self.path} has talker hidden size {self.hidden_size} and {self.groups} "
                               f"codebooks, the model expects {c.talker_hidden_size} and {c.num_code_groups}: "
                               "use a corpus written with this model")

    def split(self, name: str) -> list[dict]:
        """Index entries of the utterances in split `name` ('train' or 'validation'), in corpus order."""
        if name not in SPLITS:
            raise RvqspecError(f"unknown split {name!r}: use one of {', '.join(SPLITS)}")
        return [u for u in self.utterances if split_of(u["id"], self.validation_fraction) == name]

    def rows(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of every frame of split `name`, in corpus order."""
        entries = self.split(name)
        shards = np.repeat([u["shard"] for u in entries], [u["frames"] for u in entries]).astype(np.int64)
        rows = np.concatenate([np.arange(u["start"], u["start"] + u["frames"]) for u in entries] or [np.zeros(0)])
        return shards, rows.astype(np.int64)

    def num_frames(self, name: str) -> int:
        return sum(u["frames"] for u in self.split(name))

    def num_batches(self, name: str, batch_size: int, drop_last: bool = False) -> int:
        frames = self.num_frames(name)
        return frames // batch_size if drop_last else math.ceil(frames / batch_size)

    def shuffled_rows(self, name: str, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's frame order: shards in a random order, frames shuffled inside each shard.

        Depends on (seed, epoch) only, so a resumed run replays the same order; shuffling inside shards
        keeps reading streaming (a batch touches at most two shards)."""
        shards, rows = self.rows(name)
        rng = np.random.default_rng([seed, epoch])
        order = [rng.permutation(np.flatnonzero(shards == s)) for s in rng.permutation(len(self.shards))]
        order = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
        return shards[order], rows[order]

    def batches(self, name: str, batch_size: int, seed: int | None = None, epoch: int = 0, rank: int = 0,
                world_size: int = 1, skip: int = 0, drop_last: bool = False) -> Iterator[tuple[Tensor, Tensor]]:
        """(codes [b, G] long, hidden [b, H]) of this rank's slice of each global batch of `batch_size` frames.

        seed None: corpus order (evaluation); else shuffled per (seed, epoch). `skip` global batches are
        skipped without reading them (resume). Ranks get near-equal slices (equal when world_size divides
        batch_size and drop_last); an empty slice is not yielded.
        """
        if batch_size < 1 or not 0 <= rank < world_size:
            raise RvqspecError(f"invalid batching: batch_size={batch_size}, rank={rank}, world_size={world_size}")
        shards, rows = self.rows(name) if seed is None else self.shuffled_rows(name, seed, epoch)
        for b in range(skip, self.num_batches(name, batch_size, drop_last)):
            mine = np.array_split(np.arange(b * batch_size, min((b + 1) * batch_size, len(rows))), world_size)[rank]
            if len(mine):
                yield self.gather(shards[mine], rows[mine])

    def sample(self, name: str, count: int, seed: int) -> tuple[Tensor, Tensor]:
        """(codes, hidden) of `count` frames drawn without replacement from split `name` (all if fewer)."""
        shards, rows = self.rows(name)
        if not len(rows):
            raise RvqspecError(f"the {name} split of {self.path} is empty: add utterances or change the validation fraction")
        chosen = np.sort(np.random.default_rng(seed).permutation(len(rows))[:count])
        return self.gather(shards[chosen], rows[chosen])

    def utterances_of(self, name: str) -> Iterator[tuple[dict, Tensor, Tensor]]:
        """(index entry, codes [T, G] long, hidden [T, H]) of every utterance of split `name`."""
        for entry in self.split(name):
            shard = self.load_shard(entry["shard"])
            rows = slice(entry["start"], entry["start"] + entry["frames"])
            yield entry, shard["codes"][rows].long(), shard["hidden"][rows]

    def gather(self, shards: np.ndarray, rows: np.ndarray) -> tuple[Tensor, Tensor]:
        codes = torch.empty(len(rows), self.groups, dtype=torch.long)
        hidden = None
        for s in dict.fromkeys(shards.tolist()):  # shards in order of first use
            data, where = self.load_shard(s), torch.from_numpy(np.flatnonzero(shards == s))
            picked = torch.from_numpy(rows[shards == s])
            if hidden is None:
                hidden = torch.empty(len(rows), self.hidden_size, dtype=data["hidden"].dtype)
            codes[where] = data["codes"][picked].long()
            hidden[where] = data["hidden"][picked]
        return codes, hidden

    def load_shard(self, index: int) -> dict[str, Tensor]:
        """Shard `index`, keeping the two most recent in memory (a batch spans at most two)."""
        if index not in self.cache:
            info = self.shards[index]
            file = self.path / info["file"]
            if not file.is_file():
                raise RvqspecError(f"corpus shard {file} is missing: the corpus is incomplete, write it again")
            try:
                data = load_file(file)
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise RvqspecError(f"corpus shard {file} cannot be read ({type(e).__name__}): the corpus is damaged, "
                                   "write it again") from None
            check_shard(data, file, info["frames"], self.groups, self.hidden_size)
            if len(self.cache) >= 2:
                self.cache.pop(next(iter(self.cache)))
            self.cache[index] = data
        return self.cache[index]


def field(obj: dict, name: str, kind, where: str, low: int | None = None, high: int | None = None):
    """obj[name], refused unless of `kind` (bools are not ints) and, for ints, within [low, high]."""
    value = obj.get(name) if isinstance(obj, dict) else None
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if ok and kind is int:
        ok = (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        span = f" in [{low}, {high}]" if high is not None else f" >= {low}" if low is not None else ""
        raise RvqspecError(f"{where}: field {name!r} must be {'an integer' if kind is int else kind.__name__}{span}, "
                           f"got {value!r}: the corpus is damaged or not rvqspec's, write it again")
    return value


def check_index(index: dict, path: Path) -> None:
    """Refuse an index.json whose fields are missing, of the wrong type or out of range (named, with the range)."""
    field(index, "groups", int, str(path), 2, MAX_GROUPS)
    field(index, "hidden_size", int, str(path), 1, MAX_HIDDEN)
    shards = field(index, "shards", list, str(path))
    for i, shard in enumerate(shards):
        where = f"{path} shards[{i}]"
        name = field(shard, "file", str, where)
        if not SHARD_NAME.fullmatch(name):
            raise RvqspecError(f"{where}: file {name!r} is not a shard name (shard-NNNNN.safetensors inside the "
                               "corpus folder): the corpus is damaged or not rvqspec's")
        field(shard, "frames", int, where, 1)
    for i, utterance in enumerate(field(index, "utterances", list, str(path))):
        where = f"{path} utterances[{i}]"
        field(utterance, "id", str, where)
        field(utterance, "lang", str, where)
        frames = field(utterance, "frames", int, where, 1)
        shard = field(utterance, "shard", int, where, 0, len(shards) - 1)
        field(utterance, "start", int, where, 0, shards[shard]["frames"] - frames)


def check_shard(data: dict, file: Path, frames: int, groups: int, hidden_size: int) -> None:
    """Refuse a shard whose tensors do not match the index, whose codes are not integers >= 0, or whose hidden
    states are not finite (the first bad row named)."""
    codes, hidden = data.get("codes"), data.get("hidden")
    if codes is None or hidden is None:
        raise RvqspecError(f"{file} lacks its codes or hidden tensor: the corpus is damaged, write it again")
    if codes.shape != (frames, groups) or hidden.shape != (frames, hidden_size):
        raise RvqspecError(f"{file} does not match index.json (codes {tuple(codes.shape)}, hidden "
                           f"{tuple(hidden.shape)}): the corpus is inconsistent, write it again")
    if codes.is_floating_point() or codes.dtype == torch.bool:
        raise RvqspecError(f"{file}: codes are {codes.dtype}, not integers: the corpus is damaged, write it again")
    if int(codes.min()) < 0:
        row = int((codes < 0).any(1).nonzero()[0])
        raise RvqspecError(f"{file} row {row}: codes must be >= 0, got {codes[row].min().item()}: the corpus is "
                           "damaged, write it again")
    if not hidden.is_floating_point() or not torch.isfinite(hidden).all():
        row = int((~torch.isfinite(hidden.float())).any(1).nonzero()[0]) if hidden.is_floating_point() else 0
        raise RvqspecError(f"{file} row {row}: the hidden state is not finite (NaN or inf) or not float: the corpus "
                           "is damaged, write it again")
