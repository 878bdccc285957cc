"""The segment split's boundary chain on the GPU (``kda.segments``, spec section 8): from each
sequence's entering state ``S0[n]``, ``S_{j+1} = P_j S_j + R_j`` over its segments, keeping the
state entering every segment and the final one.

One program per (sequence, value head, V slice) walks its sequence's segments with the slice
``S [K, BV]`` in float32 registers, one ``P_j`` ``[K, K]`` product a segment in IEEE float32
(``input_precision="ieee"``: not TF32, whatever torch's matmul setting). In torch the same chain
is one launch or more a segment; there 128 segments cost 6-10 ms on the H200 as float64
products (run 59), and its log-depth scan (``segments.chain_boundaries``) moves the whole
``[P | R]`` in float64 every step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.intmath import cdiv, next_power_of_2

CHAIN_BV = 32  # V columns of a program
CHAIN_WARPS = 8


@triton.jit
def _boundary_chain(P, R, S0, starts, finals, first_seg, seg_count, HV, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    n, hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(first_seg + n).to(tl.int64)
    count = tl.load(seg_count + n)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    kv = rk[:, None] * V + rv[None, :]
    kv_mask = (rk[:, None] < K) & (rv[None, :] < V)
    kk = rk[:, None] * K + rk[None, :]
    kk_mask = (rk[:, None] < K) & (rk[None, :] < K)
    head = (n * HV + hv).to(tl.int64)
    S = tl.load(S0 + head * K * V + kv, mask=kv_mask, other=0.0)
    for j in range(count):
        seg = (first + j) * HV + hv
        tl.store(starts + seg * K * V + kv, S, mask=kv_mask)
        Pj = tl.load(P + seg * K * K + kk, mask=kk_mask, other=0.0)
        Rj = tl.load(R + seg * K * V + kv, mask=kv_mask, other=0.0)
        S = tl.dot(Pj, S, input_precision="ieee") + Rj
    tl.store(finals + head * K * V + kv, S, mask=kv_mask)


def chain_boundaries(P, R, S0, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``segments.chain_boundaries`` in float32 on the tensors' device (P ``[segs, HV, K, K]``,
    R ``[segs, HV, K, V]``, S0 ``[N, HV, K, V]``): (the state entering every segment, each
    sequence's final state), float32."""
    N, (segs, HV, K, V) = len(counts), R.shape
    P, R = P.float().contiguous(), R.float().contiguous()
    S0 = S0.float().contiguous()
    starts = torch.empty(segs, HV, K, V, dtype=torch.float32, device=R.device)
    finals = torch.empty(N, HV, K, V, dtype=torch.float32, device=R.device)
    firsts = [0]
    for c in counts[:-1]:
        firsts.append(firsts[-1] + c)
    table = torch.tensor([firsts, counts], dtype=torch.int32).to(R.device)  # one host-to-device copy
    if N and HV:
        BK, BV = max(16, next_power_of_2(K)), min(CHAIN_BV, max(16, next_power_of_2(V)))
        _boundary_chain[(N, HV, cdiv(V, BV))](P, R, S0, starts, finals, table[0], table[1], HV, K, V, BK, BV,
                                              num_warps=CHAIN_WARPS)  # fmt: skip
    return starts, finals
