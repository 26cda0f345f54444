"""Shared fixtures: every kernel test runs both kernel styles through the Pallas interpreter."""

import pytest


@pytest.fixture(params=("tpu", "triton"))
def style(request):
    """Kernel style, run in interpret mode on this (CPU) machine."""
    return request.param
