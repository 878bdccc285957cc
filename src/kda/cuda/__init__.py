"""The ``cuda`` backend: the Hopper kernels of ``prepare.cu`` (K1) and ``recurrence.cu``
(K2), built by ``CMakeLists.txt`` with nvcc and loaded through cuda-python
(:mod:`kda.cuda.loader`).

It covers bf16 inputs with K = V = 128, H = HV, the lower-bound gate or a precomputed g,
varlen and batched, float32 or bfloat16 states in either layout (carried in float32), on
sm_90 GPUs. Decode shapes (``dispatch.prefers_decode``) and state pools run the decode kernel
of ``decode.cu`` instead (:mod:`kda.cuda.decode`), which also takes grouped value heads.
Anything else is refused with the reason and ``backend="auto"`` moves on to Triton. A call
that trains runs its forward here (K2 also writing the state checkpoints), and its backward's
reverse chain and state products here too where the gate is the safe lower-bound one
(:mod:`kda.cuda.training`: K1, the chain and the products on K1's workspace); the rest of the
backward's local gradients run on Triton (:mod:`kda.autograd`).

``KDA_CUDA=0`` turns the backend off; ``KDA_CUDA_WARPS`` fixes the recurrence's CTA width
(``forward.recurrence_width``) or kind (``mma``, ``wgmma1``, ``wgmma2``:
``forward.recurrence_kind``); ``KDA_CUDA_BLOCKS`` the time blocks of a long sequence
whose K1 runs beside K2 (``forward.pipeline_blocks``); ``KDA_CUDA_BACKWARD_CHAIN=0`` keeps a training backward's reverse
chain on Triton (its prepare stage and chain) after a forward here; ``KDA_CUDA_STATE_PRODUCTS=0``
keeps its state products on Triton after the CUDA chain. All are read once, at import
(:func:`read_switches`).

On an H200 (``benchmarks/NOTES.md``, 2026-12-02, runs 30-37) the kernels passed the whole suite
(run 34) and compute-sanitizer memcheck and racecheck (run 37); racecheck reports the 4-warp
K2's stage refills as racing with the 31 lanes that leave the release to lane 0 after
``__syncwarp()``, which the memory model orders (recurrence.cu says why that width keeps it).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from kda.dispatch import POOL_TRACED, prefers_decode, through_op, traced
from kda.validation import Problem

ALIGNMENT = 16  # bytes: 16-byte cp.async of q, k, g and bulk copies of v rows
READ_DTYPES = (torch.bfloat16, torch.float32)  # of g and beta
TURNED_OFF = False  # KDA_CUDA=0
WARPS_OVERRIDE: str | None = None  # KDA_CUDA_WARPS, checked where it is used
# The CUDA reverse chain after a CUDA forward (KDA_CUDA_BACKWARD_CHAIN=0: off). On an H200
# (2026-12-02, runs 38-39, 1x8192 H32, bf16) K1 and the chain take 0.16 + 0.45 ms where the
# Triton prepare stage and chain took 0.29 + 0.55: the step 4.59 -> 4.40 ms, every gradient's
# error against fp64 as on Triton's chain to three digits (results/h200-2026-12-02-train-run39-*).
BACKWARD_CHAIN = True
# After the CUDA reverse chain, the state products on CUDA too (KDA_CUDA_STATE_PRODUCTS=0: the
# Triton kernels, on K1's workspace): kda.cuda.training.state_products.
STATE_PRODUCTS = True
# KDA_CUDA_BLOCKS: the time blocks of a long single sequence whose K1 runs beside K2
# (kda.cuda.forward.pipeline_blocks; 1: one K1 then one K2), checked where it is used.
BLOCKS_OVERRIDE: str | None = None
# The segment split's two transition runs in one K2 launch where K2 is the wgmma one
# (kda.cuda.forward.runs_kind; KDA_CUDA_PAIRED_RUNS=0: a launch a run).
PAIRED_RUNS = True
# The wgmma K2 also for the gates K1's far entry point serves (a precomputed g, lb < -5.025),
# through its twin kda_prepare_far_wgmma (KDA_CUDA_FAR_WGMMA=0: the mma.sync K2 for them). On an
# H100 (2026-12-05, run 168) the released model's serving form, `kda bench` case 7, took 0.363 ms
# against 0.392 with the mma.sync K2 (fla 0.6.0: 1.454), and the CUDA tests passed with it.
FAR_WGMMA = True


def read_switches() -> None:
    """Read ``KDA_CUDA``, ``KDA_CUDA_WARPS``, ``KDA_CUDA_BLOCKS``, ``KDA_CUDA_BACKWARD_CHAIN``,
    ``KDA_CUDA_STATE_PRODUCTS``, ``KDA_CUDA_PAIRED_RUNS`` and ``KDA_CUDA_FAR_WGMMA`` from the
    environment: once, at import, as an environment read costs 0.6-0.7 us (an unset name raises
    and catches a KeyError inside ``os.environ``) against a host budget of 40 us a call. Call it
    again after changing any in-process."""
    global TURNED_OFF, WARPS_OVERRIDE, BLOCKS_OVERRIDE, BACKWARD_CHAIN, STATE_PRODUCTS, PAIRED_RUNS, FAR_WGMMA
    TURNED_OFF = os.environ.get("KDA_CUDA") == "0"
    WARPS_OVERRIDE = os.environ.get("KDA_CUDA_WARPS")
    BLOCKS_OVERRIDE = os.environ.get("KDA_CUDA_BLOCKS")
    BACKWARD_CHAIN = os.environ.get("KDA_CUDA_BACKWARD_CHAIN") != "0"
    STATE_PRODUCTS = os.environ.get("KDA_CUDA_STATE_PRODUCTS") != "0"
    PAIRED_RUNS = os.environ.get("KDA_CUDA_PAIRED_RUNS") != "0"
    FAR_WGMMA = os.environ.get("KDA_CUDA_FAR_WGMMA") != "0"


read_switches()


@cache
def _static_availability() -> str | None:
    from kda.cuda import loader

    folder, why = loader.find_kernels()
    if folder is None:
        return f"{why} (pip install . with nvcc and the nvidia-cutlass headers present builds them)"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    why = loader.stale(folder)
    if why is not None:
        return why
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda-bindings is not installed (pip install 'kda-kernels[cuda]')"
    # Any sm_90 GPU will do (rejects tests each call's own): the current device alone turned the
    # backend off for a whole mixed host whose device 0 was not one (a review, 2026-12-07).
    devices = range(torch.cuda.device_count())
    if all(_capability(i) != (9, 0) for i in devices):
        seen = ", ".join(f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, _capability(i)))})" for i in devices)
        return f"the kernels are built for sm_90a (Hopper); no visible GPU is: {seen}"
    try:
        loader.kernels()
    except Exception as error:  # a missing driver library, a bad image: say which, fall back
        return f"loading the CUDA kernels failed: {error}"
    return None


@cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def misaligned(p: Problem) -> str | None:
    """Why ``p``'s q, k, v or g cannot feed the kernels' 16-byte copies, or None. One test for
    the four addresses; the loop only names the misaligned one."""
    if (p.q.data_ptr() | p.k.data_ptr() | p.v.data_ptr() | p.g.data_ptr()) % ALIGNMENT:
        for name in ("q", "k", "v", "g"):
            if getattr(p, name).data_ptr() % ALIGNMENT:
                return f"`{name}` is not {ALIGNMENT}-byte aligned (a view at an odd offset)"
    return None


class CudaBackend:
    name = "cuda"
    training = "forward on cuda with checkpoints, backward on triton"

    def availability(self) -> str | None:
        if TURNED_OFF:
            return "turned off by KDA_CUDA=0"
        return _static_availability()

    def auto_rejects(self, p: Problem) -> str | None:
        if p.pool is not None or prefers_decode(p):
            reason = _decode().decode_rejects(p) or _decode().auto_refusal(p)
            if reason is not None:
                return f"a decode step with {reason}: Triton's decode kernel runs it"
        return None

    def rejects(self, p: Problem) -> str | None:
        """The first feature of ``p`` the kernels do not cover, or None. Features first,
        then where the tensors live (so the reasons read the same on any machine)."""
        q = p.q
        if p.pool is not None:
            if torch.compiler.is_compiling():
                return "state pools under torch.compile (the Triton decode kernel traces)"
            if traced(p):
                return POOL_TRACED
            reason = _decode().decode_rejects(p)
            if reason is not None:
                return f"this state pool: {reason}"
        if q.dtype != torch.bfloat16:
            return f"dtype {q.dtype} (the CUDA kernels take bfloat16; Triton takes the rest)"
        if p.K != 128 or p.V != 128:
            return f"head dims K={p.K}, V={p.V} (the CUDA kernels take K = V = 128)"
        if p.HV != p.H and not _decodes(p):
            return f"grouped value heads HV={p.HV} != H={p.H} (the CUDA decode kernel takes them on short sequences)"
        if p.gate_form == "softplus":
            return "the softplus gate (unbounded; the CUDA kernels take the lower-bound gate or a precomputed g)"
        if p.g.dtype not in READ_DTYPES or p.beta.dtype not in READ_DTYPES:
            name, x = ("g", p.g) if p.g.dtype not in READ_DTYPES else ("beta", p.beta)
            return f"`{name}` in {x.dtype} (the CUDA kernels read bfloat16 or float32)"
        if p.requires_grad and p.pool is not None:  # (validation refuses it first; kept for direct callers)
            return "inputs require grad: the decode kernel has no backward"
        if not q.is_cuda:  # is_cuda and get_device: no torch.device object built per call
            return f"tensors on {q.device} (needs CUDA tensors)"
        if _capability(q.get_device()) != (9, 0):
            return f"tensors on {torch.cuda.get_device_name(q.device)}, not an sm_90 GPU"
        if torch.compiler.is_compiling() or type(q) is not torch.Tensor:
            # dynamo cannot trace data_ptr(), and fake tensors have none: the custom op that runs
            # such calls (dispatch.through_op) tests the addresses on the real tensors
            # (kda.autograd.chunk_fwd) instead.
            return None
        return misaligned(p)

    def run(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Under compile a custom op (dynamo cannot trace the cuda-python launch); with grad the
        # same op, whose forward here saves the checkpoints and whose backward is Triton's (with
        # K1 and the CUDA reverse chain for the safe gate: kda.triton.training.cuda_chain_refusal).
        if p.pool is None and through_op(p):  # (dispatch.through_op says why; a pool runs in place)
            from kda.autograd import chunk_kda_trainable

            return chunk_kda_trainable(p, use_cuda=True)
        if _decodes(p):
            return _decode().decode(p)
        return _chunk_forward()(p)

    def run_shared(
        self, problems: list[Problem], v_zero: list[bool]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """:meth:`run` of calls that differ in v and the initial state only (kda.api.chunk_kda_runs),
        where ``v_zero[i]`` says call i's v is zeros (its problem's v is only a template): K1's
        workspace holds neither v nor the state, so K1 runs once and K2 once a call, reading no
        v that is zeros (kda.cuda.forward.chunk_forward_runs). None for calls that take another
        route (grad, decode, compile) or differ in what K1 reads: the caller runs them one by one."""
        from kda.cuda.forward import chunk_forward_runs, share_prepare

        if (
            torch.compiler.is_compiling()
            or any(p.requires_grad or _decodes(p) for p in problems)
            or not share_prepare(problems)
        ):
            return None
        return chunk_forward_runs(problems, v_zero)


def _decodes(p: Problem) -> bool:
    """Whether ``p`` runs on the decode kernel: a pool, or a decode shape the kernel takes."""
    return p.pool is not None or (prefers_decode(p) and _decode().decode_rejects(p) is None)


@cache
def _decode():
    """kda.cuda.decode, imported once at first use (see _chunk_forward)."""
    import kda.cuda.decode

    return kda.cuda.decode


@cache
def _chunk_forward():
    """kda.cuda.forward, imported at the first run, once: an import statement in run would cost
    a microsecond per call even when cached."""
    from kda.cuda.forward import chunk_forward

    return chunk_forward


BACKEND = CudaBackend()
