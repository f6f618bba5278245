"""Drafters: file round trips, refusing another model's drafter, batched vs single-position logits."""

import pytest
import torch

from rvqspec.core.decode import decode_frame
from rvqspec.core.drafters import Drafter, MedusaHeads, Offsets, PositionOffsets, ReusedHeads, make_drafter
from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree

from helpers.tiny import random_frames, random_medusa, random_offsets, randomize, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, vocab=24, hidden=32, talker_hidden=20)


def teacher_forced_hidden(model, frames: int = 3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    c = model.config
    codes = torch.randint(c.vocab_size, (frames, c.num_code_groups), generator=generator)
    talker = torch.randn(frames, c.talker_hidden_size, generator=generator, dtype=model.dtype)
    return model.teacher_forced_hidden(talker, codes)


@pytest.mark.parametrize("make", [lambda m: ReusedHeads(m, 4), lambda m: random_offsets(m, 4),
                                  lambda m: randomize(PositionOffsets.for_model(m, 4), seed=2),
                                  lambda m: random_medusa(m, 4)], ids=["reused", "offsets", "position-offsets", "medusa"])
def test_teacher_forced_logits_match_single_position_logits(model, make):
    drafter = make(model)
    hidden = teacher_forced_hidden(model)
    last = model.config.num_residual_codes
    for j in range(1, drafter.depth + 1):
        batched = drafter.teacher_forced_logits(model, hidden, j)
        assert batched.shape == (hidden.shape[0], last - j, model.config.vocab_size)
        for b in range(hidden.shape[0]):
            for i in range(1, last + 1 - j):
                single = drafter.logits(model, hidden[b, i][None], [i])[0, j - 1]
                torch.testing.assert_close(batched[b, i - 1], single, rtol=1e-12, atol=1e-12)


def test_logits_rows_past_the_last_code_are_zero(model):
    drafter = random_offsets(model, 3)
    h = teacher_forced_hidden(model)[0, 14]
    rows = drafter.logits(model, h[None], [14], 3)[0]
    assert rows.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(rows[0], model.head_logits(h + drafter.offsets[0], 15))
    assert not rows[1:].any()


def test_offsets_use_the_head_of_the_drafted_codebook(model):
    drafter = random_offsets(model, 3)
    h = teacher_forced_hidden(model)[1, 5]
    for j in range(1, 4):
        expected = model.heads[5 + j - 1] @ (h + drafter.offsets[j - 1])
        torch.testing.assert_close(drafter.logits(model, h[None], [5])[0, j - 1], expected)


def test_untrained_medusa_drafts_like_reused_heads(model):
    medusa, reused = MedusaHeads.for_model(model, 3), ReusedHeads(model, 3)
    hidden = teacher_forced_hidden(model)[0]
    for i in range(1, model.config.num_code_groups):
        torch.testing.assert_close(medusa.logits(model, hidden[i][None], [i]), reused.logits(model, hidden[i][None], [i]))
    assert not torch.equal(random_medusa(model).logits(model, hidden[3][None], [3]),
                           reused.logits(model, hidden[3][None], [3]))


def test_position_offsets_add_the_offset_of_their_position_and_distance(model):
    drafter = randomize(PositionOffsets.for_model(model, 3), seed=4)
    assert drafter.offsets.shape == (model.config.num_residual_codes, 3, model.config.hidden_size)
    hidden = teacher_forced_hidden(model)[1]
    for i in (1, 5, 14):
        for j in range(1, 4 if i < 14 else 2):
            expected = model.heads[i + j - 1] @ (hidden[i] + drafter.offsets[i - 1, j - 1])
            torch.testing.assert_close(drafter.logits(model, hidden[i][None], [i])[0, j - 1], expected)
    rows = drafter.logits(model, torch.stack([hidden[2], hidden[7]]), [2, 7])  # a batch: each row its position
    torch.testing.assert_close(rows[1, 0], model.heads[7] @ (hidden[7] + drafter.offsets[6, 0]))


def test_position_offsets_decode_the_ar_codes_when_greedy(model):
    drafter, tree = randomize(PositionOffsets.for_model(model, 3), seed=5), Tree.from_paths([[0], [0, 0], [1]])
    hidden, c0 = torch.randn(model.config.talker_hidden_size, dtype=model.dtype), 3
    ar = decode_frame(model, hidden, c0, Sampler(do_sample=False))
    assert torch.equal(decode_frame(model, hidden, c0, Sampler(do_sample=False), drafter=drafter, tree=tree).codes,
                       ar.codes)


@pytest.mark.parametrize("kind", [Offsets, PositionOffsets, MedusaHeads])
def test_save_load_round_trip(model, tmp_path, kind):
    drafter = randomize(kind.for_model(model, 2), seed=3)
    drafter.save(tmp_path / "d.safetensors", {"note": "test"})
    for loader in (kind, Drafter):
        loaded = loader.load(tmp_path / "d.safetensors", model)
        assert type(loaded) is kind and loaded.depth == 2
        assert loaded.identity == drafter.identity and loaded.fingerprint == drafter.fingerprint
        for name, value in drafter.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value)


def test_offsets_for_another_model_size_are_refused(model, tmp_path):
    Offsets.for_model(model).save(tmp_path / "o.safetensors")
    other = tiny_model(seed=1, vocab=24, hidden=48, talker_hidden=20)
    with pytest.raises(RvqspecError, match="trained for a code predictor"):
        Offsets.load(tmp_path / "o.safetensors", other)
    loaded = Offsets.load(tmp_path / "o.safetensors")  # without a model: no check yet
    h, c0 = random_frames(other, 1)[0]
    with pytest.raises(RvqspecError, match="trained for a code predictor"):
        decode_frame(other, h, c0, Sampler(), drafter=loaded, tree=Tree.chain(3))


def test_a_file_of_another_kind_is_refused(model, tmp_path):
    Offsets.for_model(model).save(tmp_path / "o.safetensors")
    with pytest.raises(RvqspecError, match="not 'medusa'"):
        MedusaHeads.load(tmp_path / "o.safetensors")


def test_bad_drafter_files_are_refused(tmp_path):
    with pytest.raises(RvqspecError, match="does not exist"):
        Offsets.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(RvqspecError, match="not a safetensors drafter"):
        Offsets.load(tmp_path / "junk.safetensors")


def test_make_drafter_and_depth_errors(model):
    assert isinstance(make_drafter("offsets", model, 4), Offsets)
    assert make_drafter("medusa", model).res_weight.shape[:2] == (model.config.num_residual_codes, 3)
    with pytest.raises(RvqspecError, match="unknown drafter"):
        make_drafter("eagle", model)
    with pytest.raises(RvqspecError, match="depth must be >= 1"):
        Offsets(8, depth=0)


def test_draft_depth_beyond_the_frame_is_refused(tmp_path, capsys):
    from rvqspec.core.drafters import make_drafter

    from helpers.tiny import tiny_model

    with pytest.raises(RvqspecError, match="draft depth 20 does not fit a frame of 15"):
        make_drafter("offsets", tiny_model(), depth=20)


@pytest.mark.parametrize("meta, message", [
    ({"depth": "three"}, "metadata depth 'three' is not an integer"),
    ({"depth": "5"}, r"does not fit depth 5"),
    ({"model": "{not json"}, "metadata model '{not json' is not JSON"),
    ({"model": "null"}, "metadata model must give the predictor's sizes"),
    ({"kind": "medusa"}, "it holds tensors \\['offsets'\\], a medusa drafter holds"),
])
def test_a_drafter_file_with_damaged_metadata_is_refused(tmp_path, meta, message):
    """These raised ValueError or KeyError, and `model: null` skipped the size check."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = tiny_model()
    random_offsets(model, 3, seed=1).save(tmp_path / "d.safetensors")
    with safe_open(tmp_path / "d.safetensors", "pt") as f:
        metadata = f.metadata()
    save_file(load_file(tmp_path / "d.safetensors"), tmp_path / "d.safetensors", metadata={**metadata, **meta})
    with pytest.raises(RvqspecError, match=message):
        Drafter.load(tmp_path / "d.safetensors", model)


def test_a_medusa_file_given_as_offsets_is_refused(tmp_path):
    model = tiny_model()
    random_medusa(model, 3, seed=2).save(tmp_path / "m.safetensors")
    with pytest.raises(RvqspecError, match="holds a 'medusa' drafter, not 'offsets'"):
        Offsets.load(tmp_path / "m.safetensors", model)
