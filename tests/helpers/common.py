"""What every op's tests share: the tolerances per dtype and the hypothesis profile of a property test module."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# Tolerances per dtype, (rtol, atol): what the arithmetic allows, never widened to make a test pass.
TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5)}


def hypothesis_profile(ci_examples: int) -> settings:
    """A property test module's settings, chosen by $HYPOTHESIS_PROFILE: "ci" (the default) runs ci_examples
    derandomized examples (the same every run, no database); "thorough" 10,000 random ones, failures kept in
    .hypothesis/ and replayed."""
    common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "thorough":
        return settings(max_examples=10_000, **common)
    return settings(max_examples=ci_examples, derandomize=True, database=None, **common)
