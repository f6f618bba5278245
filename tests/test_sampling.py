"""Sampler settings: bad ones refused with RvqspecError naming the accepted range."""

import math

import pytest

from rvqspec import RvqspecError, Sampler


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=0), "temperature must be > 0"),
    (dict(temperature=-0.5), "temperature must be > 0"),
    (dict(temperature=math.nan), "temperature must be > 0"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(top_k=None), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampler_settings(settings, message):
    with pytest.raises(RvqspecError, match=message):
        Sampler(**settings)


def test_a_non_boolean_do_sample_is_refused():
    """It used to be accepted silently."""
    with pytest.raises(RvqspecError, match="do_sample must be True or False"):
        Sampler(do_sample="no")
