"""A design probe for the segment split (kda.segments), on the CPU: the split in two chunk passes
instead of three, and what it costs in accuracy. ``python benchmarks/split_two_pass_accuracy.py
[T [SPAN]]``.

The split today runs three passes over all tokens: R (every segment from a zero state), P (from
the identity's columns with v = 0), and the output (every segment from its true entering
state). The output pass can go: with v = 0 and the identity as initial state, a pass's outputs
are ``o_P,t = scale Phi_t^T q_t`` (Phi_t the segment's transition up to token t), so the true
output is ``o_t = o_local,t + o_P,t S_start``, o_local from the R pass. But the kernels write o
in the inputs' dtype: o_local and o_P each rounded to bf16 before the sum. This prints the
relative RMS against float64 of the uncut call, the three-pass split and the two-pass one
(torch backend, bf16 inputs, K = V = 128, the lower-bound gate lowered by 6 for a long memory)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import kda  # noqa: E402
from helpers import make_case  # noqa: E402
from kda import segments  # noqa: E402
from kda.reference import relative_rms  # noqa: E402
from kda.transitions import kv_layout  # noqa: E402

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
SPAN = int(sys.argv[2]) if len(sys.argv) > 2 else 512
HV, K, V = 2, 128, 128

case = make_case(B=1, T=T, H=HV, HV=HV, K=K, V=V, dtype=torch.bfloat16, gate="lower_bound", seed=5)
case.g = case.g - 6.0
kw = case.kwargs()
kw.pop("safe_gate", None)
c64 = case.to(torch.float64, "cpu")
kw64 = c64.kwargs()
kw64.pop("safe_gate", None)
o64, s64 = kda.chunk_kda(*c64.tensors(), **kw64, backend="torch")
o_uncut, s_uncut = kda.chunk_kda(*case.tensors(), **kw, backend="torch")
os.environ["KDA_SEGMENT_TOKENS"] = str(SPAN)
o_split, s_split = kda.chunk_kda(*case.tensors(), **kw, backend="torch")
del os.environ["KDA_SEGMENT_TOKENS"]

segs = T // SPAN
q, k, v, g, beta = [x.reshape(1, T, *x.shape[2:]) for x in case.tensors()]
offsets = torch.arange(0, T + 1, SPAN)
run_kw = {n: x for n, x in kw.items() if n not in ("initial_state", "output_final_state")}
run_kw |= dict(cu_seqlens=offsets, cu_seqlens_cpu=offsets, output_final_state=True, backend="torch")
as_kv, from_kv = kv_layout(bool(kw.get("state_v_first", False)))
o_local, R = kda.chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(segs, HV, K, V), **run_kw)
eye = torch.eye(K).expand(segs, HV, K, K).contiguous()
o_P, P = kda.chunk_kda(q, k, torch.zeros_like(v), g, beta, initial_state=from_kv(eye), **run_kw)
S0 = as_kv(case.initial_state).double()
starts, finals = segments.chain_boundaries(as_kv(P), as_kv(R), S0, [segs])
o_P = o_P.reshape(segs, SPAN, HV, K).permute(0, 2, 1, 3).double()  # [segs, HV, SPAN, K]
correction = torch.matmul(o_P, starts).permute(0, 2, 1, 3).reshape(1, T, HV, V)
o_two = (o_local.double() + correction).to(torch.bfloat16)
for name, o, s in (("uncut", o_uncut, s_uncut), ("three-pass split", o_split, s_split),
                   ("two-pass split", o_two, from_kv(finals))):  # fmt: skip
    print(f"{name}: o {relative_rms(o, o64):.2e}, state {relative_rms(s, s64):.2e}")
