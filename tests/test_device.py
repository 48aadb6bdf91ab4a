"""Device assumptions in dpmech found while preparing the GPU check (issue 37, benchmarks/gpu_check.py).

No GPU is needed: each test puts the model, or a generator, on a device other than the CPU's
default as far as a CPU-only machine allows (the ``meta`` device, a generator that reports a CUDA
device), and checks what the code does with it. The two tests of a device assumption failed on
the main of 2026-11-27; the other two guard what the fixes must keep (the same draws; a real move
still re-seeds).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dpmech.robustness import smoothing
from dpmech.robustness.noise_layer import NoiseLayer


class _Recorder(nn.Module):
    """A base classifier with its parameter on ``device`` that records where its inputs arrive and
    votes for class 1 (its logits need no data: a ``meta`` input has a shape only)."""

    def __init__(self, device: str):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, device=device))
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device)
        logits = torch.zeros(x.shape[0], 3)
        logits[:, 1] = 1.0
        return logits


def test_smoothing_runs_the_base_classifier_on_its_own_device_with_noise_from_the_generators():
    # a CPU generator with a model elsewhere (a CUDA model in practice): the noise is drawn on the CPU
    # and the model gets its inputs on its own device (main sent them to the generator's device, so a
    # CUDA model with a CPU generator stopped on a device mismatch)
    base = _Recorder("meta")
    counts = smoothing.sample_noise(base, torch.zeros(3, 1, 4, 4), 10, 0.5, generator=torch.Generator().manual_seed(0),
                                    batch_size=8)
    assert base.seen and all(d.type == "meta" for d in base.seen)
    assert counts.tolist() == [[0, 10, 0]] * 3


def test_smoothing_draws_do_not_depend_on_where_the_model_runs():
    # the same generator state gives the same noise whether it is added on the generator's device or
    # moved first: the counts of a real model equal those of the noise drawn by hand
    torch.manual_seed(0)
    lin = nn.Linear(6, 4).double()
    x = torch.rand(2, 6, dtype=torch.float64) * 2 - 1
    counts = smoothing.sample_noise(lin, x, 50, 0.7, generator=torch.Generator().manual_seed(3), batch_size=100)
    z = torch.randn((2, 50, 6), generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.7 + x[:, None]
    top = lin(z.view(100, 6)).argmax(1).view(2, 50)
    expected = torch.zeros(2, 4, dtype=torch.int64).scatter_add_(1, top, torch.ones_like(top))
    assert counts.tolist() == expected.tolist()


class _CudaLikeGenerator:
    """Stands for a generator that torch created on "cuda": it reports the indexed device."""

    device = torch.device("cuda", 0)


def test_noise_layer_keeps_its_streams_when_cuda_is_named_without_an_index(monkeypatch):
    # The forward pass draws with h.device ("cuda:0"); a trainer built with device "cuda" asks for the
    # checkpoint's RNG state with torch.device("cuda"). Main compared the two as different devices and
    # re-seeded the streams, so every checkpoint restarted the layer's noise from its seed.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    layer = NoiseLayer(1.0, "l2", seed=5)
    streams = [_CudaLikeGenerator()]
    layer._gens = streams
    assert layer.generators(torch.device("cuda")) is streams
    assert layer.generators("cuda:0") is streams


def test_noise_layer_still_reseeds_on_a_real_move():
    # the negative control of the test above: a move to another device type re-creates the streams
    layer = NoiseLayer(1.0, "l2", seed=5)
    layer._gens = [_CudaLikeGenerator()]
    gens = layer.generators("cpu")
    assert all(g.device.type == "cpu" for g in gens) and len(gens) > 1
