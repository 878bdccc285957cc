"""The ``torch`` backend: the reference of :mod:`kda.reference` behind the public API.

Runs on any device and dtype, supports every call the API accepts and is differentiable
by torch autograd. It computes in float32 (float64 for float64 inputs); it is slow, and is
meant as the fallback and the yardstick.
"""

from __future__ import annotations

import torch

from kda import reference, validation
from kda.validation import Problem


def activated_inputs(p: Problem, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta in ``dtype`` with the API's optional pre-processing applied."""
    q, k, g, beta = reference.activate_inputs(
        p.q.to(dtype),
        p.k.to(dtype),
        p.g.to(dtype),
        p.beta.to(dtype),
        use_qk_l2norm=p.use_qk_l2norm,
        use_gate=p.use_gate,
        use_beta_sigmoid=p.use_beta_sigmoid,
        allow_neg_eigval=p.allow_neg_eigval,
        A_log=None if p.A_log is None else p.A_log.to(dtype),
        dt_bias=None if p.dt_bias is None else p.dt_bias.to(dtype).view(p.HV, p.K),
        lower_bound=p.lower_bound,
    )
    return q, k, p.v.to(dtype), g, beta


def run_reference(p: Problem, dtype: torch.dtype, recurrent: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the reference in ``dtype``; o and the state come back in ``dtype``, fla's layout."""
    h0 = p.initial_state
    if h0 is not None:
        h0 = h0.to(dtype)
        if p.state_v_first:
            h0 = h0.transpose(-1, -2)
    form = reference.naive_recurrent_kda if recurrent else reference.chunk16_kda
    o, ht = form(
        *activated_inputs(p, dtype),
        scale=p.scale,
        initial_state=h0,
        output_final_state=p.output_final_state,
        cu_seqlens=p.cu_seqlens_cpu if p.cu_seqlens_cpu is not None else p.cu_seqlens,
    )
    if ht is not None and p.state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht


class TorchBackend:
    name = "torch"
    training = "forward and backward"

    def availability(self) -> str | None:
        return None

    def rejects(self, problem: Problem) -> str | None:
        return None

    def auto_rejects(self, problem: Problem) -> str | None:
        return None

    def run(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
        if p.cu_seqlens is not None and p.cu_seqlens_values is None and torch.compiler.is_compiling():
            # Offsets left unread for kda::chunk_fwd (auto, traced by torch.compile), which this
            # backend does not go through: its token loop reads them on the host anyway, so they
            # are checked here (a graph break; under fullgraph, dynamo's error, as before 2026-12-07).
            validation._check_cu_seqlens(p.cu_seqlens, p.cu_seqlens_cpu, p.B, p.T, p.q.device)
        if p.pool is not None:  # the pool is updated in place (a transposed view writes through)
            pool = p.pool.transpose(-1, -2) if p.state_v_first else p.pool
            o = reference.pooled_recurrent_kda(
                *activated_inputs(p, p.state_dtype), p.scale, pool, p.state_indices, p.accepted,
                p.cu_seqlens_cpu if p.cu_seqlens_cpu is not None else p.cu_seqlens,
            )  # fmt: skip
            return o.to(p.q.dtype), p.pool
        o, ht = run_reference(p, p.state_dtype, recurrent=p.op == "fused_recurrent_kda")
        if p.B * p.T == 0:
            o, ht = _attached_to_empty_inputs(p, o, ht)
        return o.to(p.q.dtype), (None if ht is None else ht.to(p.final_state_dtype))


def _attached_to_empty_inputs(p: Problem, o: torch.Tensor, ht: torch.Tensor | None) -> tuple:
    """No tokens (T = 0, or B = 0): the reference forms o (and a final state without an initial
    one) by no arithmetic on the inputs, so autograd saw no link and a backward raised, where the
    Triton backend's ran with zero gradients (reviews of 2026-12-07: the token inputs, then the
    gate's parameters, the initial state and B = 0). The sum of an empty slice of each input that
    requires grad is exactly 0 whatever the input holds (inf and NaN included): adding it links
    the input without changing a value."""
    linked = [
        x
        for x in (p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.initial_state)
        if x is not None and x.requires_grad
    ]
    if not linked or not torch.is_grad_enabled():
        return o, ht
    zero = sum(x.flatten()[:0].sum() for x in linked)
    return o + zero.to(o.dtype), None if ht is None else ht + zero.to(ht.dtype)


BACKEND = TorchBackend()
