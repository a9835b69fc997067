import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _packed_kernels_serve_every_row_count(monkeypatch):
    """Packed CPU kernels compute every call they can, as ``rows="all"`` asks: which kernel computes a call then
    does not hang on a timing of tiny layers on a busy machine. The measured plans have their own tests
    (``test_cpu_kernels.py``, which replace this timing with one they control)."""
    from hf_specdec import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_PLANS", {})
    monkeypatch.setattr(cpu_kernels, "_packed_is_faster", lambda *args: True)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The project's local Hub server, with huggingface_hub pointed at it (a module may define its own ``hub``)."""
    from local_hub import LocalHub, point_client_at

    with LocalHub() as server:
        point_client_at(server, monkeypatch, tmp_path)
        monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))  # remote code would land here, never run
        yield server
        assert server.unknown == [], f"the client called endpoints the local hub does not implement: {server.unknown}"
