"""Weight updates to measure a sync with: synthetic bit-pattern changes and real AdamW steps on bf16 casts.

* :func:`perturb_bits`: a fraction of a bf16 tensor's bit patterns moved by +-1 (90 %), +-2 (7 %), +-3 (3 %) ULP,
  the mix optimizer steps produce on bf16 weights;
* :func:`adamw_bf16_step`: the bf16 casts of a plain stack of bias-free linear layers (fp32 masters, weights
  N(0, 0.02^2)) before and after one AdamW step with synthetic gradients (a fixed per-tensor direction plus
  fresh noise), after ``warmup`` steps: what a GRPO trainer sends its rollout workers after an optimizer step.
"""

from __future__ import annotations

import torch


def perturb_bits(base: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """A copy of the bf16 / fp16 tensor ``base`` with a ``density`` fraction of bit patterns moved by +-1 (90 %),
    +-2 (7 %) or +-3 (3 %) (random positions; ``generator`` on ``base``'s device)."""
    if base.element_size() != 2:
        raise TypeError(f"perturb_bits takes 16-bit tensors, got {base.dtype}")
    b = base.reshape(-1).view(torch.int16)
    n = b.numel()
    ch = torch.rand(n, generator=generator, device=base.device) < density
    r = torch.rand(n, generator=generator, device=base.device)
    mag = 1 + (r > 0.90).to(torch.int32) + (r > 0.97).to(torch.int32)
    sign = torch.where(torch.rand(n, generator=generator, device=base.device) < 0.5, -1, 1)
    v = (b.to(torch.int32) + torch.where(ch, mag * sign, 0)) & 0xFFFF
    return (v - ((v >> 15) << 16)).to(torch.int16).view(base.dtype).view(base.shape)


def linear_stack(width: int, layers: int, device: torch.device | str, seed: int = 0) -> torch.nn.Module:
    """``layers`` bias-free ``Linear(width, width)`` in fp32, weights N(0, 0.02^2) from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, device=device) for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


class SyntheticGrads:
    """g_t = 0.5 * direction + noise_t (both N(0, 1e-3^2)); the direction is fixed per tensor."""

    def __init__(self, model: torch.nn.Module, seed: int = 1) -> None:
        self.params = list(model.parameters())
        dev = self.params[0].device
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        self.dirs = [torch.randn(p.shape, generator=self.gen, device=dev) * 1e-3 for p in self.params]

    def fill(self) -> None:
        for p, d in zip(self.params, self.dirs):
            p.grad = 0.5 * d + torch.randn(p.shape, generator=self.gen, device=p.device) * 1e-3


def adamw_bf16_step(width: int, layers: int, lr: float, device: torch.device | str, *, warmup: int = 2,
                    seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(before, after)``: bf16 casts of :func:`linear_stack`'s weights around one AdamW step (weight decay
    0.01) taken after ``warmup`` steps, as ``{name: tensor}``. Memory: the fp32 model, its two AdamW states and
    two bf16 copies."""
    model = linear_stack(width, layers, device, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    grads = SyntheticGrads(model, seed + 1)
    for _ in range(warmup):
        grads.fill()
        opt.step()
    before = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    grads.fill()
    opt.step()
    after = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    del opt, grads, model
    return before, after
