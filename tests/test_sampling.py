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


@pytest.mark.parametrize("settings, message", [
    (dict(top_k=math.inf), "top_k must be an integer >= 0"), (dict(top_k=math.nan), "top_k must be an integer >= 0"),
    (dict(top_k="50"), "top_k must be an integer >= 0"), (dict(temperature="0.9"), "temperature must be > 0"),
    (dict(temperature=1e-45), "at least 1e-06"), (dict(top_p="1"), r"top_p must be in \(0, 1\]"),
    (dict(top_k=True), "top_k must be an integer >= 0"),
])
def test_settings_that_raised_python_errors_are_refused_in_one_line(settings, message):
    """They used to raise OverflowError, ValueError or TypeError (or overflow the logits to NaN probabilities)."""
    with pytest.raises(RvqspecError, match=message):
        Sampler(**settings)
