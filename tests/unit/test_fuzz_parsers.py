"""Every parser of outside input, fuzzed briefly in the suite (300 cases each); the long run with the same
targets is `python -m bench fuzz_parsers` (100,000 cases each). Any input gives a value or the project's own
error, never another exception."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from bench._fuzz_targets import TARGETS


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_parser_is_total(target):
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(target.strategy)
    def prop(value):
        target.check(value)

    prop()
