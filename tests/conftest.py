"""Shared test settings: a hypothesis profile sized for a 2-core machine, and the ``device`` fixture."""

import os

import pytest
from helpers import DEVICES
from hypothesis import HealthCheck, settings

# No deadline (CPU timings vary when other jobs share the machine); modest example counts so
# the whole suite stays well under the project's 10-minute budget. HYPOTHESIS_PROFILE=thorough
# runs many more examples when there is time to spare.
settings.register_profile("headwise", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "headwise"))


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    """Each device a test about numbers runs on: "cpu" always, "cuda" when torch sees a GPU.

    Session-scoped so that hypothesis tests may use it; on a machine without a GPU it adds no
    test (one parameter, "cpu").
    """
    return request.param
