"""AdamW over float32 master weights of a drafter whose parameters are bf16 (`--master-weights`).

Under bf16 autocast with float32 parameters (the default) every step pays for casts that move
no information: autocast casts each weight to bf16 for the forward, and autograd casts each bf16
weight gradient back to float32 for the optimizer, 12 bytes a parameter a step beside AdamW's 28.
With master weights the drafter's parameters are bf16 (the forward reads them as they are, the
backward writes bf16 gradients) and this optimizer keeps the float32 copy the update is exact on:
one compiled kernel a weight reads its bf16 gradient, float32 master and moments, and writes the
master, the moments and the bf16 weight. On an H100 the Qwen3-8B-shaped drafter's update fell
from 20.0 to 11.3 ms (bench/master_weights.py) and its whole step at config A from 149.8 to
140.0 ms (docs/PERF.md); the cost is 2 bytes a parameter more memory.

What stays as it was:
  - the update is torch's AdamW (decoupled decay, bias-corrected moments) to rounding, and reads
    `grad_scale` / `found_inf` as torch's fused AdamW does, so `core.step.fused_clip_and_step`
    clips and skips inside it with no host sync, captured or not;
  - the optimizer's `param_groups` hold the float32 masters, so its state dict is AdamW's (a
    checkpoint of either resumes in the other) and torch's loading keeps the moments float32;
  - checkpoints and exports hold the masters (`trained_weights`), not the bf16 copies.

The update compiles on its first call, which the trainer makes in the warm-up with the step
skipped (`Step.skip_update`): nothing compiles after it (train/compile_gate.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

PARAMETER_DTYPE = torch.bfloat16


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW whose `param_groups` are float32 masters of the bf16 `params` it writes after each
    update; the gradients are read from the bf16 params."""

    def __init__(self, params: list[torch.nn.Parameter], masters: list[torch.Tensor], *, lr: float,
                 betas: tuple[float, float], weight_decay: float, eps: float = 1e-8, compiled: bool = True):
        if len(params) != len(masters) or any(p.shape != m.shape or m.dtype != torch.float32
                                              for p, m in zip(params, masters)):
            raise ValueError("master weights: one float32 master of each parameter's shape is needed")
        # `fused` tells Step that clip and skip run inside the update (grad_scale / found_inf).
        super().__init__(masters, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, fused=True))
        self.params = list(params)
        self._param_of = {id(m): p for m, p in zip(masters, params)}
        device = masters[0].device
        self._one, self._zero = torch.ones((), device=device), torch.zeros((), device=device)
        self._lrs = [torch.zeros((), device=device) for _ in self.param_groups]
        self._update: Callable[..., None] = (torch.compile(adamw_update, fullgraph=True, dynamic=False) if compiled
                                             else adamw_update)

    @classmethod
    def taking_over(cls, drafter: torch.nn.Module, *, compiled: bool, **hyper: Any) -> "MasterWeightAdamW":
        """The optimizer of `drafter`, whose float32 parameters become bf16 (in place, same names)
        after their float32 values became the masters."""
        params = list(drafter.parameters())
        masters = [p.detach().to(torch.float32, copy=True) for p in params]
        with torch.no_grad():
            for param in params:
                param.data = param.data.to(PARAMETER_DTYPE)
        return cls(params, masters, compiled=compiled, **hyper)

    def param_of(self, master: torch.Tensor) -> torch.nn.Parameter:
        """The bf16 parameter `master` is the float32 master of."""
        return self._param_of[id(master)]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share_step_counts()

    def _share_step_counts(self) -> None:
        """One step count per group (every weight's is the same), shared by its weights' states."""
        for group in self.param_groups:
            first = self.state[group["params"][0]].get("step")
            if first is None:
                continue
            count = first.to(device=group["params"][0].device, dtype=torch.float32)
            for master in group["params"]:
                self.state[master]["step"] = count

    def _group_state(self, group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        masters = group["params"]
        if not self.state[masters[0]]:
            count = torch.zeros((), device=masters[0].device)
            for master in masters:
                self.state[master].update(step=count, exp_avg=torch.zeros_like(master),
                                          exp_avg_sq=torch.zeros_like(master))
        states = [self.state[m] for m in masters]
        return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], states[0]["step"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        scale = getattr(self, "grad_scale", None)
        skip = getattr(self, "found_inf", None)
        for group, lr_tensor in zip(self.param_groups, self._lrs):
            masters = group["params"]
            params = [self.param_of(m) for m in masters]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            exp_avgs, exp_avg_sqs, count = self._group_state(group)
            lr = group["lr"]
            if not isinstance(lr, torch.Tensor):  # a float changes every step: a tensor keeps one compiled update
                lr_tensor.fill_(lr)
                lr = lr_tensor
            beta1, beta2 = group["betas"]
            self._update(params, masters, grads, exp_avgs, exp_avg_sqs, count, lr,
                         self._one if scale is None else scale, self._zero if skip is None else skip,
                         beta1, beta2, group["eps"], group["weight_decay"])


def adamw_update(
    params: list[torch.Tensor], masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], count: torch.Tensor, lr: torch.Tensor, scale: torch.Tensor, skip: torch.Tensor,
    beta1: float, beta2: float, eps: float, weight_decay: float,
) -> None:
    """One AdamW step on every master (torch's formula) with gradients divided by `scale`, each
    bf16 parameter rewritten from its master; where `skip` is 1 nothing changes, and the
    step count only counts steps taken (as torch's fused AdamW with `found_inf`)."""
    keep = 1.0 - skip
    count.add_(keep)
    step = torch.clamp(count, min=1.0)
    bias1 = 1.0 - torch.pow(beta1, step)
    bias2_root = torch.sqrt(1.0 - torch.pow(beta2, step))
    for param, master, grad, exp_avg, exp_avg_sq in zip(params, masters, grads, exp_avgs, exp_avg_sqs):
        g = torch.nan_to_num(grad.float() / scale) * keep  # a skipped step must not carry a non-finite value in
        new_avg = exp_avg * (beta1 + (1 - beta1) * skip) + (1 - beta1) * g
        new_sq = exp_avg_sq * (beta2 + (1 - beta2) * skip) + (1 - beta2) * g * g
        denom = torch.sqrt(new_sq) / bias2_root + eps
        new_master = master * (1.0 - lr * weight_decay * keep) - keep * lr / bias1 * new_avg / denom
        exp_avg.copy_(new_avg)
        exp_avg_sq.copy_(new_sq)
        master.copy_(new_master)
        param.copy_(new_master)


def trained_weights(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """The drafter's state dict as training holds it: with master weights, each bf16 parameter's
    float32 master in its place (what checkpoints and exports keep)."""
    weights = drafter.state_dict()
    if isinstance(optimizer, MasterWeightAdamW):
        names = {id(param): name for name, param in drafter.named_parameters()}
        for master in updated_tensors(optimizer):
            weights[names[id(optimizer.param_of(master))]] = master.detach()
    return weights


def updated_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """What an update writes that a skipped one must leave alone: the optimizer's own tensors
    (torch's AdamW: the parameters; master weights: the masters)."""
    return [t for group in optimizer.param_groups for t in group["params"]]
