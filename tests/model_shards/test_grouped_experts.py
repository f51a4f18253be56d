"""The experts' grouped matmul (and its two fallbacks) against a route-by-route reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_shards import moe as experts_mod
from model_shards.moe import LocalExperts, grouped_mm_supported


def make_experts(num: int = 4, hidden: int = 16, inter: int = 12, dtype=torch.float32) -> LocalExperts:
    torch.manual_seed(0)
    e = LocalExperts(range(num), hidden, inter)
    with torch.no_grad():
        e.gate_up_proj.normal_(0, 0.3)
        e.down_proj.normal_(0, 0.3)
    return e.to(dtype)


def reference(e: LocalExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each route through its own expert, one row at a time."""
    owner = [j for j, c in enumerate(counts) for _ in range(c)]
    rows = []
    for r, j in enumerate(owner):
        gate, up = (e.gate_up_proj[j].double() @ x[r].double()).chunk(2)
        rows.append(e.down_proj[j].double() @ (F.silu(gate) * up))
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[-1]).double()


COUNTS = [[3, 0, 5, 1], [0, 0, 0, 7], [1, 1, 1, 1], [40, 2, 0, 30]]


@pytest.mark.parametrize("counts", COUNTS)
def test_every_path_matches_the_route_by_route_reference(counts):
    e = make_experts()
    x = torch.randn(sum(counts), 16)
    want = reference(e, x, counts)
    gate_up, down = e.gate_up_proj.transpose(1, 2), e.down_proj.transpose(1, 2)
    with torch.no_grad():
        got = {"forward": e(x, counts), "per_expert": e._per_expert(x, counts),
               "padded": e._padded(x, counts, gate_up, down)}
    for name, y in got.items():
        assert y.shape == want.shape, name
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5, msg=name)


def test_grouped_mm_is_what_runs_for_decode_sized_cpu_batches(monkeypatch):
    e = make_experts()
    x = torch.randn(6, 16)
    assert grouped_mm_supported(x, e.gate_up_proj.transpose(1, 2)) == hasattr(torch, "_grouped_mm")
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        e(x, [2, 0, 3, 1])
    assert len(calls) == 2  # gate/up, then down
    calls.clear()
    monkeypatch.setattr(experts_mod, "GROUPED_MAX_ROUTES_CPU", 4)  # prefill-sized: the per-expert loop
    with torch.no_grad():
        e(x, [2, 0, 3, 1])
    assert calls == []


def test_unaligned_shapes_fall_back_to_the_loop():
    """torch's grouped mm needs 16-byte row strides: 5 floats is not, and the loop takes over."""
    e = make_experts(hidden=5, inter=3)
    x = torch.randn(4, 5)
    assert not grouped_mm_supported(x, e.gate_up_proj.transpose(1, 2))
    with torch.no_grad():
        torch.testing.assert_close(e(x, [1, 1, 2, 0]).double(), reference(e, x, [1, 1, 2, 0]), rtol=1e-5, atol=1e-5)


def test_bf16_runs_grouped_and_stays_close():
    e = make_experts(inter=16, dtype=torch.bfloat16)
    x = torch.randn(9, 16).bfloat16()
    assert grouped_mm_supported(x, e.down_proj.transpose(1, 2)) == hasattr(torch, "_grouped_mm")
    with torch.no_grad():
        y = e(x, [4, 2, 0, 3])
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), reference(e, x, [4, 2, 0, 3]), rtol=2e-2, atol=2e-2)


def test_no_routes():
    e = make_experts()
    with torch.no_grad():
        assert e(torch.zeros(0, 16), [0, 0, 0, 0]).shape == (0, 16)


@pytest.mark.parametrize("capability, hip, fused", [
    ((8, 0), None, False), ((8, 9), None, False), ((9, 0), None, True), ((10, 0), None, True),
    ((12, 0), None, False), ((9, 4), "6.3", False),
])
def test_the_cuda_gate_admits_exactly_torchs_fused_kernel(monkeypatch, capability, hip, fused):
    """torch runs its fused bf16 grouped GEMM on CUDA builds for compute capability 9.x and 10.x
    (H100/H200, B200); elsewhere `_grouped_mm` loops over groups after reading the offsets on the
    host (A100, L40S, RTX 50xx at 12.0, and ROCm, which reports gfx942 as 9.4)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert experts_mod.cuda_grouped_kernel(torch.device("cuda")) is fused
