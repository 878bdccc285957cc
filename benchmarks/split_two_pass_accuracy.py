"""The segment split's accuracy on the CPU (kda.segments): ``python
benchmarks/split_two_pass_accuracy.py [T [SPAN]]`` prints the relative RMS against float64 of the
uncut call and of the split (torch backend, bf16 inputs, K = V = 128, the lower-bound gate lowered
by 6 for a long memory).

Since f2e1274 (2026-12-03) the split runs two chunk passes, not three: with v = 0 and the
identity as initial state, a pass's outputs are ``o_P,t = scale Phi_t^T q_t`` (Phi_t the
segment's transition up to token t), so the output from the entering state S is ``o_zero,t +
o_P,t S``, o_zero from the R pass; the kernels write o_zero and o_P in the inputs' dtype, each
rounded to bf16 before the sum. The three-pass split matched the uncut call (1.66e-3 at 4096 /
512 and 65536 / 16384, measured before that commit with this probe's earlier form)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import kda  # noqa: E402
from helpers import make_case  # noqa: E402
from kda.reference import relative_rms  # noqa: E402

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
for name, o, s in (("uncut", o_uncut, s_uncut), (f"split at {SPAN}", o_split, s_split)):
    print(f"{name}: o {relative_rms(o, o64):.2e}, state {relative_rms(s, s64):.2e}")
