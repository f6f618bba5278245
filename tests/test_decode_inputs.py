"""Bad input to `decode_frame` / `decode_frames`: refused with RvqspecError naming the problem, the edges of valid
input accepted, a broken row spoiling nothing."""

import pytest
import torch

from rvqspec import RvqspecError, Sampler, decode_frame


@pytest.mark.parametrize("hidden", [torch.zeros(32), torch.zeros(1, 25), torch.zeros(2, 24), torch.zeros(1, 1, 24),
                                    [0.0] * 24])
def test_talker_hidden_of_the_wrong_size(model, hidden):
    with pytest.raises(RvqspecError, match=r"talker_hidden must be \[24\] or \[1, 24\] \(the talker's hidden size\)"):
        decode_frame(model, hidden, 0, Sampler())


@pytest.mark.parametrize("c0", [20, -1, 1.5, torch.tensor([1, 2]), torch.tensor(3.0)])
def test_c0_out_of_range(model, c0):
    with pytest.raises(RvqspecError, match=r"c0 must be one integer code in \[0, 20\)"):
        decode_frame(model, torch.zeros(24), c0, Sampler())


def test_valid_edge_inputs_decode(model):
    """The checks above must not reject the edges of valid input."""
    for hidden, c0 in [(torch.zeros(24), 0), (torch.zeros(1, 24), 19), (torch.zeros(24), torch.tensor(5))]:
        assert decode_frame(model, hidden, c0, Sampler(do_sample=False)).codes.shape == (3,)


def test_sampler_of_the_wrong_type(model):
    with pytest.raises(RvqspecError, match="sampler must be an rvqspec.Sampler, got str"):
        decode_frame(model, torch.zeros(24), 0, "greedy")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_a_broken_talker_state_is_refused_by_row_and_spoils_nothing(value):
    from rvqspec.core.decode import decode_frames

    from helpers.tiny import random_frames, tiny_model

    model = tiny_model()
    frames = random_frames(model, 2)
    hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    before = decode_frames(model, hidden, c0, Sampler(do_sample=False)).codes
    broken = hidden.clone()
    broken[1, 3] = value
    with pytest.raises(RvqspecError, match="talker_hidden row 1 is not finite or out of range"):
        decode_frames(model, broken, c0, Sampler())
    assert torch.equal(decode_frames(model, hidden, c0, Sampler(do_sample=False)).codes, before)


@pytest.mark.parametrize("kwargs, message", [
    (dict(generator=7), "generator must be a torch.Generator"),
    (dict(generator="numpy"), "generator must be a torch.Generator"),
    (dict(drafter="reused", tree=None), "drafter must be an rvqspec drafter"),
    (dict(tree=[[0]]), "tree must be an rvqspec.Tree"),
])
def test_arguments_of_the_wrong_type_are_named(model, kwargs, message):
    """They used to raise raw Python errors from deep inside a round."""
    from rvqspec import ReusedHeads

    kwargs = {"drafter": ReusedHeads(), **kwargs} if "tree" in kwargs and "drafter" not in kwargs else kwargs
    with pytest.raises(RvqspecError, match=message):
        decode_frame(model, torch.zeros(24), 0, Sampler(), **kwargs)


def test_uint8_codes_decode_and_bool_states_are_refused(model):

    codes = decode_frame(model, torch.zeros(24), torch.tensor(3, dtype=torch.uint8), Sampler(do_sample=False)).codes
    assert torch.equal(codes, decode_frame(model, torch.zeros(24), 3, Sampler(do_sample=False)).codes)
    with pytest.raises(RvqspecError, match="talker_hidden must be a float tensor"):
        decode_frame(model, torch.zeros(24, dtype=torch.bool), 0, Sampler())
