"""The vLLM server's check of the weights an engine serves (``vllm_server.weight_check._probe``), on a fake fused layer.

The fake stands in for a vLLM linear module: its ``quant_method.apply(module, x)`` is ``x @ W.T`` of a
weight the test controls (the "packed kernel"); the checkpoint tensors are what the server read.
The real kernels are exercised by ``tests/contract/test_vllm_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from relax_agent.rollout.engines.vllm_server import weight_check


class _Apply:
    def __init__(self, served: torch.Tensor, noise: float = 0.0) -> None:
        self.served, self.noise = served, noise

    def apply(self, module, x):
        """A one-hot row's product is exact in any summation order; a dense row's carries the noise."""
        y = x.float() @ self.served.float().T
        dense = (x != 0).sum(-1, keepdim=True) > 1
        noise = self.noise * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        return torch.where(dense, y * (1 + noise), y).to(x.dtype)


class _Layer(torch.nn.Module):
    def __init__(self, served: torch.Tensor, noise: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=served.dtype), requires_grad=False)
        self.quant_method = _Apply(served, noise)


def _parts(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [("q.weight", (torch.randn(48, 64, generator=g) * 0.02).to(dtype)),
            ("k.weight", (torch.randn(16, 64, generator=g) * 0.02).to(dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_faithful_fused_kernel_passes_with_its_dtypes_rounding(dtype):
    parts = _parts(dtype)
    fused = torch.cat([w for _, w in parts])
    noise = 1e-7 if dtype == torch.float32 else 2e-3  # the kernels' accumulation / output rounding
    for version in range(3):
        assert weight_check._probe(_Layer(fused, noise), parts, version) == []


def test_one_element_in_a_read_back_column_is_named_with_its_tensor_and_position():
    parts = _parts()
    fused = torch.cat([w for _, w in parts]).clone()
    version = 5
    col = (version * weight_check.SERVED_COLUMNS) % (64 - weight_check.SERVED_COLUMNS + 1) + 2
    fused[48 + 3, col] += 1e-6  # row 3 of k: below any tolerance, but read back exactly
    bad = weight_check._probe(_Layer(fused), parts, version)
    assert len(bad) == 1 and bad[0].startswith("k.weight: column") and f"column {col} " in bad[0]
    assert "row 3" in bad[0]


def test_a_stale_tensor_and_a_swapped_fusion_are_found():
    parts = _parts()
    stale = torch.cat([parts[0][1], parts[1][1] + 1e-4])  # k kept from the previous version
    assert [b.split(":")[0] for b in weight_check._probe(_Layer(stale), parts, 0)] == ["k.weight"]
    swapped = torch.cat([parts[1][1], parts[0][1]])  # k's rows first: the wrong fusion order
    assert {b.split(":")[0] for b in weight_check._probe(_Layer(swapped), parts, 0)} == {"q.weight", "k.weight"}


def test_a_change_between_the_read_back_columns_is_caught_by_the_random_probe():
    parts = _parts()
    fused = torch.cat([w for _, w in parts]).clone()
    other = weight_check.SERVED_COLUMNS + 3  # outside version 0's block of read-back columns
    fused[:48, other] *= -1  # one column of q flipped in sign
    bad = weight_check._probe(_Layer(fused), parts, 0)
    assert len(bad) == 1 and bad[0].startswith("q.weight: the engine's output on a random probe")


def test_parts_with_different_input_sizes_are_reported_not_probed():
    parts = [("a.weight", torch.zeros(4, 8)), ("b.weight", torch.zeros(4, 16))]
    assert "do not share an input size" in weight_check._probe(_Layer(torch.zeros(8, 8)), parts, 0)[0]
