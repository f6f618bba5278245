"""A synthetic code corpus sampled from a random code predictor, which is therefore its true generator.

Each code depends on the talker state and on the codes before it through the predictor itself (see
`structured_model`), so the corpus has the cross-codebook structure drafters exploit. Talker states
follow a slow random walk per utterance and c0 is a fixed function of the state. Also runnable, to set
up an end-to-end run of the CLI:

    python tests/helpers/synthetic.py --out runs/synthetic [--hidden 64 --vocab 64 --utterances 400]
    # -> runs/synthetic/model (checkpoint folder), runs/synthetic/corpus (code corpus)
"""

import argparse
from pathlib import Path

import torch

from rvqspec.core.config import PredictorConfig
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.sampling import Sampler
from rvqspec.tuning.calibrate import sample_codes
from rvqspec.tuning.corpus import CorpusWriter

from helpers.tiny import tiny_config


def structured_model(config: PredictorConfig | None = None, seed: int = 0, sharpness: float = 4.0,
                     drift: float = 1.0) -> MultiCodeDecoder:
    """A random predictor shaped like a trained one, where neighbouring positions share context.

    Projection and attention weights at unit gain carry the talker state and the earlier codes to every
    position (at upstream's std 0.02 each position would see little but its own input code); code tables
    of std 0.5 share a mean that drifts by `drift` per codebook, so h_i and h_{i+j} differ by a systematic
    shift; heads have logits of spread ~`sharpness`. So reused heads draft better than chance, offsets
    better, Medusa heads best.
    """
    torch.manual_seed(seed)
    model = MultiCodeDecoder(config or tiny_config(talker_hidden=48))
    c = model.config
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and name.split(".")[-2] in ("project", "wqkv", "wo"):
                weight.normal_(std=weight.shape[1] ** -0.5)
        model.code_embed.weight.normal_(std=0.5)
        step = torch.randn(c.talker_hidden_size) * drift / c.talker_hidden_size ** 0.5
        bounds = model.table_offset.tolist() + [model.code_embed.weight.shape[0]]
        for table in range(c.num_code_groups):
            model.code_embed.weight[bounds[table]:bounds[table + 1]] += table * step
        model.heads.normal_(std=sharpness / c.hidden_size ** 0.5)  # the final norm gives h unit RMS
    return model.eval().requires_grad_(False)


def talker_states(frames: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """A slow random walk with unit variance: neighbouring frames are alike, as in speech."""
    states = [torch.randn(size, generator=generator)]
    for _ in range(frames - 1):
        states.append(0.9 * states[-1] + 0.19 ** 0.5 * torch.randn(size, generator=generator))
    return torch.stack(states)


def write_synthetic_corpus(model: MultiCodeDecoder, path: str | Path, utterances: int = 48,
                           frames: tuple[int, int] = (8, 24), seed: int = 0, sampler: Sampler = Sampler(),
                           shard_frames: int = 256, langs: tuple[str, ...] = ("en", "de")) -> Path:
    """Sample utterances of `frames` (min, max) frames from `model` (deployed sampler) into a corpus."""
    c = model.config
    generator = torch.Generator().manual_seed(seed)
    c0_map = torch.randn(c.talker_hidden_size, c.talker_vocab_size, generator=generator)
    with CorpusWriter(path, c.talker_hidden_size, c.num_code_groups, shard_frames, torch.float32,
                      meta={"source": "tests/synthetic.py", "seed": seed}) as writer:
        for u in range(utterances):
            length = int(torch.randint(frames[0], frames[1] + 1, (), generator=generator))
            hidden = talker_states(length, c.talker_hidden_size, generator)
            codes = sample_codes(model, hidden, (hidden @ c0_map).argmax(-1), sampler, generator)
            writer.add(f"utt-{u:05d}", langs[u % len(langs)], codes, hidden)
    return Path(path)


def write_model_and_corpus(folder: str | Path, config: PredictorConfig | None = None, seed: int = 0,
                           **corpus_args) -> tuple[Path, Path]:
    """`folder`/model (checkpoint) and `folder`/corpus sampled from it."""
    folder = Path(folder)
    model = structured_model(config, seed)
    model.save_pretrained(folder / "model")
    return folder / "model", write_synthetic_corpus(model, folder / "corpus", seed=seed, **corpus_args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--utterances", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = tiny_config(vocab=args.vocab, hidden=args.hidden, layers=args.layers, talker_hidden=args.hidden * 3 // 2)
    model_dir, corpus_dir = write_model_and_corpus(args.out, config, args.seed, utterances=args.utterances,
                                                   frames=(10, 40))
    print(f"model: {model_dir}\ncorpus: {corpus_dir}")
