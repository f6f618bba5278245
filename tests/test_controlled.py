"""Acceptance-controlled predictors: the peak follows the previous code, acceptance reaches a target, exactness holds."""

import pytest
import torch

from rvqspec.bench.controlled import calibrate_strength, controlled_predictor, tokens_per_step
from rvqspec.core.decode import decode_frame
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

from helpers.tiny import tiny_config

GREEDY = Sampler(do_sample=False)


def predictor(talker_hidden: int | None = None, dtype=torch.float64):
    return controlled_predictor(tiny_config(vocab=64, hidden=32, talker_hidden=talker_hidden), dtype=dtype)


@pytest.mark.parametrize("talker_hidden", [None, 48], ids=["same-width", "projection"])
def test_a_strong_peak_repeats_the_previous_code(talker_hidden):
    p = predictor(talker_hidden)
    p.set_strength(20.0)
    for h, c0 in p.frames(4):
        codes = decode_frame(p.model, h, c0, GREEDY).codes
        assert codes.tolist() == [c0 % 64] * 15


def test_no_peak_gives_no_acceptance_and_a_strong_one_the_ceiling():
    p, tree = predictor(), default_tree(8)
    frames = p.frames(8)
    p.set_strength(0.0)
    assert tokens_per_step(p, tree, frames, Sampler()) < 1.2
    p.set_strength(20.0)
    assert tokens_per_step(p, tree, frames, Sampler()) == pytest.approx(3.0)  # 15 codes in 5 calls


def test_calibrated_strength_reaches_the_target_on_other_frames():
    p, tree, sampler = predictor(), default_tree(16), Sampler()
    calibrated = calibrate_strength(p, tree, 2.25, sampler, p.frames(24, seed=1))
    calls, measured = calibrated.frame_calls, calibrated.measured
    assert len(calls) == 24 and measured == pytest.approx(24 * 15 / sum(calls))
    assert measured == pytest.approx(2.25, abs=0.1)
    assert p.strength == calibrated.strength
    assert (calibrated.metric, calibrated.target) == ("tokens_per_step", 2.25)
    assert tokens_per_step(p, tree, p.frames(40, seed=2), sampler, seed=5) == pytest.approx(2.25, abs=0.25)


def test_greedy_codes_still_equal_autoregressive():
    p, tree = predictor(), default_tree(16)
    p.set_strength(2.0)  # some drafts accepted, some rejected
    drafter, accepted, rejected = ReusedHeads(p.model), 0, 0
    for h, c0 in p.frames(12):
        result = decode_frame(p.model, h, c0, GREEDY, drafter=drafter, tree=tree)
        assert torch.equal(result.codes, decode_frame(p.model, h, c0, GREEDY).codes)
        accepted += sum(r.accepted for r in result.rounds)
        rejected += sum(r.accepted < tree.max_depth for r in result.rounds)
    assert accepted > 0 and rejected > 0


def test_bad_targets_and_strengths_are_refused():
    p = predictor()
    with pytest.raises(RvqspecError, match="out of reach"):
        calibrate_strength(p, default_tree(8), 3.5, Sampler(), p.frames(2))
    with pytest.raises(RvqspecError, match="strength must be >= 0"):
        p.set_strength(-1.0)
