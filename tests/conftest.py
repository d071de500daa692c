"""Shared test settings: a hypothesis profile sized for a 2-core machine, the ``device`` fixture, each linear path forced in turn."""

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


@pytest.fixture(params=["torch", "onednn", "panels"])
def linear_path(request):
    """Run the test once per projection path of headwise.linear, forced, whatever the rule picks here."""
    import torch

    from headwise.linear import onednn, panels
    from headwise.linear import rule as hl

    if request.param == "onednn" and onednn.ops_error(torch.float32) is not None:
        pytest.skip(f"oneDNN's private ops do not work here: {onednn.ops_error(torch.float32)}")
    if request.param == "panels" and not panels.available():
        pytest.skip("the panels GEMM runs where torch's kernels are AVX-512 or AVX2 and headwise's library builds")
    with hl.use_path(request.param):
        yield request.param


@pytest.fixture
def machine(monkeypatch):
    """Pretend to be another machine for ``headwise.linear``'s rule: ``machine(vendor, capability, flags, version=...,
    library=...)`` (``library``: whether headwise's C++ library, the panels GEMM's, builds there; by default not). oneDNN's
    private ops work there in every dtype (on a CPU without AVX-512 this one's refuse bfloat16: ``onednn.ops_error``), so
    that the rule's decision is the pretended machine's; a test that runs them checks ``ops_error`` itself."""
    import headwise.linear.rule as hl

    def pretend(vendor="AuthenticAMD", capability="AVX512", flags=(), version="2.13.0+cpu", library=False):
        facts = {"vendor": vendor, "family": "26", "model": "2", "name": "test CPU", "flags": sorted(flags), "capability": capability}
        monkeypatch.setattr(hl, "cpu", lambda: facts)
        monkeypatch.setattr(hl, "_library_built", lambda: library)  # headwise's C++ library (the panels GEMM) built or not
        monkeypatch.setattr(hl.onednn, "ops_error", lambda dtype: None)  # the private ops work there
        monkeypatch.setattr(hl.torch, "__version__", version)
        monkeypatch.delenv(hl.ENV, raising=False)
        hl._auto.cache_clear()

    yield pretend
    hl._auto.cache_clear()


@pytest.fixture(params=["C++ kernel", "compiled loops"])
def decode_way(request, monkeypatch):
    """Run the test once with the C++ decode kernel (``backends.decode_kernel``, built here once) and once as if it
    could not be built, where compiled decode steps and paged batches keep inductor's loops. Yields whether it is on."""
    from headwise.backends import decode_kernel

    if request.param == "C++ kernel" and not decode_kernel.available():
        pytest.skip("the C++ decode kernel could not be built here")
    if request.param == "compiled loops":
        monkeypatch.setattr(decode_kernel, "available", lambda: False)
    yield request.param == "C++ kernel"
