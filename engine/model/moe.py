"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral), as transformers computes it.

A router (`gate`, a linear to one logit per expert) scores each token; softmax in float32, the top
k experts, their probabilities renormalised to sum to one where the model does (Mixtral always,
Qwen3-MoE with `norm_topk_prob`). Each chosen expert, an MLP of its own, runs on the token, and the
outputs are summed weighted by those probabilities.

Tokens are grouped by expert: the k choices of every token are sorted by expert (one argsort), and
each expert that has tokens runs its gate/up and down projections once over all of them, as one
GEMM each (at batch 1 only the k chosen experts' weights are read; an expert no token chose costs
nothing). Its weighted outputs are added into the result in the order of the experts, as
transformers adds them, so that a token's sum is made in the same order. The router stays a plain
float linear (torch's, as transformers runs it): its logits decide which experts run, and a rounding
of a kernel of our own could tip a near-tie of two experts the other way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ppserve.engine.model.gguf_quant import GGUFExperts
from ppserve.engine.model.kernel_choice import KernelChooser
from ppserve.engine.model.model_config import MoeConfig


class MoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, expert: Callable[[], nn.Module]) -> None:
        """`expert()` makes one expert: an MLP whose forward maps [n, hidden] to [n, hidden]."""
        super().__init__()
        self.cfg = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList([expert() for _ in range(moe.num_experts)])
        # Per expert, the tokens routed to it since the start (the stage reports them, /metrics shows
        # the imbalance): on the CPU whatever the model's device, not on the meta device it is built on.
        self.tokens = torch.zeros(moe.num_experts, dtype=torch.int64, device="cpu")
        self.grouped: GGUFExperts | None = None  # the experts in one call (see `fast`)

    def fuse(self, dtype: torch.dtype, device: torch.device, int8: bool, chooser: KernelChooser | None) -> None:
        for expert in self.experts:
            expert.fuse(dtype, device, int8, chooser)  # type: ignore[operator]

    @property
    def fast(self) -> bool:
        return self.grouped is not None

    @fast.setter
    def fast(self, fast: bool) -> None:
        """With the CPU kernels (StageModel.fuse says): the experts in one call where they are all
        GGUF tensors; else the loop over them."""
        gate_ups, downs = [e.gate_up for e in self.experts], [e.down for e in self.experts]
        dtype = self.gate.weight.dtype
        self.grouped = GGUFExperts.build(gate_ups, downs, dtype) if fast else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [n, k] (int64) and their weights [n, k]: in x's dtype (Qwen3-MoE) or
        float32 (Mixtral), as transformers' routers return them."""
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype) if self.cfg.weights_in_hidden_dtype else weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] -> [n, hidden]."""
        experts, weights = self.route(x)
        if self.grouped is not None:  # the loop below, in C++, the grouping too
            out = torch.zeros_like(x)
            self.grouped(x, experts, weights.float(), self.tokens, out)
            return out
        k = self.cfg.top_k
        choices = experts.flatten()  # token t's j-th choice at t * k + j
        order = torch.argsort(choices, stable=True)  # the choices grouped by expert, experts ascending
        counts = torch.bincount(choices, minlength=self.cfg.num_experts)
        self.tokens += counts.cpu()
        out = torch.zeros_like(x)
        flat_weights = weights.flatten()
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            picks = order[start : start + n]
            start += n
            tokens = picks // k
            y = self.experts[e](x[tokens]) * flat_weights[picks, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out
