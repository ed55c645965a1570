"""bf16 masters with stochastic rounding: deterministic, exact on resume, and it trains small updates."""

import torch

from lightning_lazytrain.optim import HybridAdamW


def test_bf16_master_small_updates_accumulate_and_state_bytes():
    p = torch.ones(65536, dtype=torch.bfloat16)
    opt = HybridAdamW([p], lr=1e-4, weight_decay=0.0, eight_bit_fraction=1.0)
    g = -torch.ones(65536, dtype=torch.bfloat16)
    for _ in range(20):
        opt.step_params([p], 1.0, [g])
    # Each step adds ~1e-4, far below bf16's 2^-7 spacing at 1.0: round-to-nearest would stay at 1.0.
    assert abs(p.float().mean().item() - (1.0 + 20e-4)) < 2e-4
    assert opt.state_bytes() == 2 * 65536 + 8 * (65536 // 4096)  # ~2 B/param of state: 2+2+2 with bf16 p and g


def test_bf16_rounding_is_seeded_and_per_step():
    def run(seed):
        p = torch.ones(10000, dtype=torch.bfloat16)
        opt = HybridAdamW([p], lr=3e-3, eight_bit_fraction=1.0, seed=seed)
        out = []
        for s in range(3):
            opt.step_params([p], 1.0, [torch.full((10000,), 0.5 + s, dtype=torch.bfloat16)])
            out.append(p.clone())
        return out

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
