"""The public functions, with fla 0.6.0's parameters, order, defaults and return values."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from kda import dispatch, segments, validation
from kda.intmath import cdiv


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    final_state_dtype: torch.dtype | None = None,
    initial_state_indices: torch.Tensor | None = None,
    cp_group=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Kimi Delta Attention forward, chunked (prefill and training shapes).

    Args:
        q: queries ``[B, T, H, K]``, float16 / bfloat16 / float32 (float64: torch backend).
        k: keys ``[B, T, H, K]``, q's dtype.
        v: values ``[B, T, HV, V]``, q's dtype; ``HV % H == 0`` (GVA: value head j reads
            q/k head ``j // (HV // H)``).
        g: log-decay ``[B, T, HV, K]`` (<= 0), or the raw gate input with
            ``use_gate_in_kernel``; q's dtype or float32.
        beta: write strengths ``[B, T, HV]``, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``state_v_first``; float32,
            or bfloat16 (a kda extension: fla takes float32 only); float64 with float64 inputs.
        output_final_state: also return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6 under the square root).
        use_gate_in_kernel: ``g`` is raw; the gate is ``lower_bound * sigmoid(exp(A_log) *
            (g + dt_bias))`` when ``lower_bound`` is set, else ``-exp(A_log) * softplus(g +
            dt_bias)``. ``A_log [HV]`` and ``dt_bias [HV * K]`` go in ``kwargs``.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: ``beta = 2 * sigmoid(beta)`` (needs the previous flag).
        safe_gate: promise that the gate stays in ``[lower_bound, 0)`` with
            ``lower_bound >= -5``; lets kernels take their fast path.
        lower_bound: the lower bound of the safe gate.
        disable_recompute: accepted for compatibility; the forward result does not depend on it.
        return_intermediate_states: not supported (raises ValueError).
        state_v_first: states in VK layout ``[N, HV, V, K]`` (the kernels' native layout).
        cu_seqlens: int64 or int32 ``[N + 1]`` offsets of N packed sequences (then ``B == 1``).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens``: the offsets are checked from it, with no
            device-to-host sync (without it they are copied once, unless
            ``KDA_CHECK_CU_SEQLENS=0``; README, "Varlen"). The kernels read ``cu_seqlens``.
        backend: ``"auto"`` (CUDA, then Triton, then torch, the first that supports the
            call), ``"cuda"``, ``"triton"`` or ``"torch"``. An explicit backend that cannot
            run the call raises :class:`kda.BackendUnavailableError` saying why.
        final_state_dtype: kda only: ``torch.bfloat16`` returns the final state in bfloat16
            (the state is carried in float32 either way); None: float32, as fla.
        initial_state_indices: kda only, prefill into a state pool (spec section 7):
            ``initial_state`` is the pool ``[P, HV, K, V]`` (or ``[P, HV, V, K]``), and
            sequence n starts from ``pool[idx[n]]`` (int32 or int64 ``[N]``) and its final
            state is written back there; an index outside ``[0, P)`` starts from zeros and
            writes nothing. Returns ``(o, pool)``; no backward.
        cp_group: kda only, context parallelism (``kda.context_parallel``): a
            torch.distributed group whose every rank passes its contiguous slice of the
            tokens of the same B sequences (the same T_local on each), or, with
            ``cu_seqlens`` describing the whole packed batch (the same on every rank), its
            slice of the packed tokens (any length, in rank order); every rank gets its
            tokens' outputs and every sequence's final state. Differentiable across ranks.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state in
        ``final_state_dtype`` (float32 by default; float64 for float64 inputs) in the layout
        of ``initial_state`` (``[N, HV, K, V]`` or ``[N, HV, V, K]``), or None.
    """
    if "transpose_state_layout" in kwargs:  # fla's old name: every route below reads state_v_first
        state_v_first = validation.fold_state_layout(state_v_first, kwargs, stacklevel=3)
        kwargs = {name: x for name, x in kwargs.items() if name != "transpose_state_layout"}
    if cp_group is not None or kwargs.get("cp_context") is not None:
        from kda.context_parallel import chunk_kda_context_parallel, from_fla_cp_context

        kw = _call_kwargs(locals(), kwargs)
        if kw.get("cp_context") is not None:  # fla's description: kda's cp_group and global cu_seqlens
            if cp_group is not None:
                raise ValueError("`cp_group` and fla's `cp_context` are exclusive: pass one")
            cp_group = from_fla_cp_context(kw)
        # (raised on every rank, after the ranks' first collective: raised here, on this rank
        # alone, it left the others waiting in theirs)
        refusal = None
        if initial_state_indices is not None:
            refusal = ValueError("context parallelism and `initial_state_indices` cannot be combined")
        return chunk_kda_context_parallel(chunk_kda, cp_group, q, k, v, g, beta, kw, refusal)
    if initial_state_indices is not None:
        return _prefill_into_pool(
            q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
            return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, backend, final_state_dtype,
            initial_state_indices, kwargs,
        )  # fmt: skip
    problem = validation.check_problem(
        "chunk_kda", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
        kwargs.get("A_log"), kwargs.get("dt_bias"), return_intermediate_states, state_v_first, cu_seqlens,
        cu_seqlens_cpu, final_state_dtype, kwargs, defer_offsets=backend != "torch",
    )  # fmt: skip
    span = segments.segment_tokens()
    # (the split needs the lengths on the host: a call that left them unchecked is not split)
    if span != 0 and not problem.requires_grad and not torch.compiler.is_compiling() and not problem.lengths_unchecked:
        why, longest = segments.SETTING, problem.longest
        lengths = _lengths(problem) if span or longest >= segments.long_tokens() else None
        if span is None:  # (the length first: a call too short to split pays no more host time)
            span, why = _auto_segments(problem, backend, lengths) if lengths is not None else (0, "")
        # No call is split under a CUDA-graph capture, on any route: the split copies its segment
        # table to the device, which a capture refuses (until a review of 2026-12-04 only the
        # automatic route asked, so a forced KDA_SEGMENT_TOKENS failed the capture).
        if span and longest > span and not dispatch.capturing(q):
            kw = _call_kwargs(locals(), kwargs)
            kw.pop("cu_seqlens"), kw.pop("cu_seqlens_cpu")  # the split makes its own
            for name in validation.IGNORED_KWARGS:  # (use_graph's check is of the caller's offsets)
                kw.pop(name, None)
            p = problem  # (its tensors: a padded buffer's are cut to the covered rows)
            out = segments.chunk_kda_segmented(
                chunk_kda, p.q, p.k, p.v, p.g, p.beta, kw, lengths, span, why, chunk_kda_runs
            )
            return padded(problem, out)
    return run(problem, backend)


def chunk_kda_runs(q, k, g, beta, runs: list, kw: dict):
    """``chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)`` for each
    ``(v, h0)`` of ``runs``, as an iterable of ``(o, final state)``: calls that differ in v and
    the initial state only (the segment split's transition runs, ``transitions.affine_transitions``);
    v None stands for zeros of the first given v's shape. Where the backend chosen for every one is
    the same and can share work between them (``run_shared``: the CUDA path runs K1, which neither
    enters, once for all, and reads no v that is zeros; None where it cannot), it does; else each
    call runs alone with its zeros made, one at a time as the results are taken."""
    kw = dict(kw)
    requested = kw.pop("backend", "auto")
    first = next(i for i, (v, _) in enumerate(runs) if v is not None)

    state = dict(output_final_state=True)
    base = checked_problem(chunk_kda, q, k, runs[first][0], g, beta, **kw, initial_state=runs[first][1], **state)
    # The other runs take the first's checked inputs (validation copies non-contiguous tensors and
    # converts A_log and dt_bias to float32): then they share them, not equal copies of them; and
    # a zero v's problem carries the first's checked v, which only its shape and dtype are read of.
    shared = kw | {name: getattr(base, name) for name in ("A_log", "dt_bias", "cu_seqlens") if name in kw}

    def rest(v, h0):
        v = base.v if v is None else v
        return checked_problem(chunk_kda, base.q, base.k, v, base.g, base.beta, **shared, initial_state=h0, **state)

    problems = [base if i == first else rest(v, h0) for i, (v, h0) in enumerate(runs)]
    v_zero = [v is None for v, _ in runs]
    chosen = [dispatch.select(p, requested) for p in problems]
    run_shared = getattr(chosen[0], "run_shared", None)
    if run_shared is not None and all(backend is chosen[0] for backend in chosen):
        shared_results = run_shared(problems, v_zero)
        if shared_results is not None:  # (None: these calls take routes that share nothing)
            return shared_results
    return (
        backend.run(dataclasses.replace(p, v=torch.zeros_like(p.v)) if zero else p)
        for backend, p, zero in zip(chosen, problems, v_zero)
    )


def run(problem: validation.Problem, backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``problem`` on ``backend`` (dispatch.select); a padded buffer's output zero-filled past
    the end of ``cu_seqlens`` (its tensors hold the covered rows only: validation)."""
    return padded(problem, dispatch.select(problem, backend).run(problem))


def padded(problem: validation.Problem, out: tuple) -> tuple:
    """``out`` with its output given ``problem.padding`` zero rows at the end (differentiable)."""
    if not problem.padding:
        return out
    return (torch.nn.functional.pad(out[0], (0, 0, 0, 0, 0, problem.padding)), *out[1:])


def _lengths(problem) -> list[int]:
    values = problem.cu_seqlens_values
    return [problem.T] * problem.B if values is None else [b - a for a, b in zip(values, values[1:])]


def _auto_segments(problem, backend: str, lengths: list[int]) -> tuple[int, str]:
    """The automatic split (``segments.auto_span``) of a call the CUDA path would run, the
    only path it was measured on (never under a CUDA-graph capture: dispatch.capturing); (0, "")
    for any other."""
    if backend not in ("auto", "cuda") or not problem.q.is_cuda:
        return 0, ""
    if dispatch.refusal(dispatch.get_backend("cuda"), problem) is not None:
        return 0, ""
    from kda.cuda.forward import sm_count

    sms = sm_count(problem.q.device.index)
    why = f"automatic: {segments.long_chains(lengths, problem.HV)} long (sequence, head) chains on {sms} SMs"
    return segments.auto_span(lengths, problem.HV, sms), f"{why}; {segments.SETTING}=0 turns it off"


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    final_state_dtype: torch.dtype | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Kimi Delta Attention forward, token by token (decode shapes).

    Same tensors, flags, state layouts and results as :func:`chunk_kda` (``A_log`` and
    ``dt_bias`` are positional here, as in fla), so a prefill's final state feeds decode
    directly. The ``torch`` backend runs the token-by-token reference. The others run their
    decode kernels (the state read once and written once) for pool calls and for calls without
    grad of at most ``kda.dispatch.RECURRENT_DECODE_TOKENS`` tokens a sequence, and their chunked
    kernels, which compute the same function, otherwise (README, "Decode without a pool").

    State pools (serving, spec section 7): with ``inplace_final_state=True``,
    ``initial_state`` is a pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``;
    float32 or bfloat16) updated in place, and the call returns ``(o, pool)``. ``ssm_state_indices``
    ``[N]`` (int32 or int64): sequence n starts from and ends in ``pool[idx[n]]``; ``[N, S]``
    (speculative decoding, S at least the longest sequence): it starts from ``pool[idx[n,
    num_accepted_tokens[n] - 1]]`` (``idx[n, 0]`` without ``num_accepted_tokens``) and the
    state after its t-th token is written to ``pool[idx[n, t]]``. Without indices sequence n
    is slot n. An index outside ``[0, P)`` (negative: padding) is no slot: the sequence
    starts from zeros and nothing is written. Slots not named are never touched. The index
    values are read on the device only; the decode kernels run pools in one launch
    (``kda.triton.decode``, ``kda.cuda.decode``), torch in its token loop. Varlen: pass ``cu_seqlens_cpu`` (kda
    only, as in :func:`chunk_kda`) as well, or ``cu_seqlens`` is copied to the host once per
    call to be checked (a sync; none under a CUDA-graph capture or ``KDA_CHECK_CU_SEQLENS=0``).
    """
    if inplace_final_state or ssm_state_indices is not None or num_accepted_tokens is not None:
        problem = pooled_problem(
            q, k, v, g, beta, A_log, dt_bias, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, final_state_dtype,
            inplace_final_state, ssm_state_indices, num_accepted_tokens, kwargs, cu_seqlens_cpu,
        )  # fmt: skip
        return run(problem, backend)
    problem = validation.check_problem(
        "fused_recurrent_kda", q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, False,
        lower_bound, A_log, dt_bias, False, state_v_first, cu_seqlens, cu_seqlens_cpu, final_state_dtype, kwargs,
        defer_offsets=backend != "torch",
    )  # fmt: skip
    return run(problem, backend)


def pooled_problem(
    q, k, v, g, beta, A_log, dt_bias, scale, pool, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, final_state_dtype,
    inplace_final_state, ssm_state_indices, num_accepted_tokens, kwargs, cu_seqlens_cpu=None,
) -> validation.Problem:  # fmt: skip
    """The checked call of a fused_recurrent_kda through a state pool (``pool``: its
    ``initial_state``); raises as that call would."""
    if not inplace_final_state:
        raise ValueError("`ssm_state_indices` / `num_accepted_tokens` need `inplace_final_state=True` "
                         "(the pool in `initial_state` is updated in place)")  # fmt: skip
    if pool is None:
        raise ValueError("`inplace_final_state=True` needs the state pool in `initial_state`")
    problem = validation.check_problem(
        "fused_recurrent_kda", q, k, v, g, beta, scale, None, False,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, False,
        lower_bound, A_log, dt_bias, False, state_v_first, cu_seqlens, cu_seqlens_cpu, final_state_dtype, kwargs,
    )  # fmt: skip
    # a pool that requires grad trains only with grad mode on (as check_problem asks of the inputs;
    # under no_grad it was refused until a review of 2026-12-05)
    problem.requires_grad = problem.requires_grad or (torch.is_grad_enabled() and getattr(pool, "requires_grad", False))
    return validation.check_pool(problem, pool, ssm_state_indices, num_accepted_tokens, final_state_dtype)


# chunk_kda's parameters after the five tensors that a call it makes again passes on
CALL_PARAMETERS = (
    "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
    "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound", "disable_recompute",
    "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "backend", "final_state_dtype",
)  # fmt: skip


def _call_kwargs(arguments: dict, kwargs: dict) -> dict:
    """chunk_kda's own arguments (from its ``locals()``) and extra keywords, as keywords."""
    return {**{name: arguments[name] for name in CALL_PARAMETERS}, **kwargs}


def _prefill_into_pool(
    q, k, v, g, beta, scale, pool, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
    allow_neg_eigval, safe_gate, lower_bound, disable_recompute, return_intermediate_states, state_v_first,
    cu_seqlens, cu_seqlens_cpu, backend, final_state_dtype, indices, kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """chunk_kda with ``initial_state_indices``: gather the slots' states (zeros for no slot),
    run the call, write the final states back in the pool's dtype; no host synchronisation on a
    GPU. The call's other arguments go to it as given, so that it accepts and refuses what the
    call without indices does (return_intermediate_states was dropped, and final_state_dtype
    ignored, until a review of 2026-12-04)."""
    inputs = (k, v, g, beta, kwargs.get("A_log"), kwargs.get("dt_bias"))
    N, indices = validation.pool_prefill_sequences(
        q, pool, indices, cu_seqlens, inputs, final_state_dtype, state_v_first
    )
    P = pool.shape[0]
    if P == 0:  # no slot to read (index_select of an empty pool fails): every sequence from zeros
        h0 = pool.new_zeros(N, *pool.shape[1:])
    else:
        ok = (indices >= 0) & (indices < P)
        h0 = pool.index_select(0, indices.clamp(0, P - 1).long())
        h0 = torch.where(ok.view(N, 1, 1, 1), h0, torch.zeros((), dtype=pool.dtype, device=pool.device))
    o, ht = chunk_kda(
        q, k, v, g, beta, scale, h0, True, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, safe_gate, lower_bound, disable_recompute, return_intermediate_states, state_v_first,
        cu_seqlens, cu_seqlens_cpu, backend=backend, **kwargs,
    )  # fmt: skip
    _scatter_states(pool, indices, ht)
    return o, pool


def _scatter_states(pool: torch.Tensor, indices: torch.Tensor, states: torch.Tensor) -> None:
    """Write ``states [N, ...]`` to ``pool[indices]`` in place, skipping indices outside
    ``[0, P)``, without a host synchronisation: a masked Triton copy on a GPU
    (``kda.triton.decode.scatter_states_kernel``); on the CPU, where a sync costs nothing,
    torch's boolean indexing."""
    P = pool.shape[0]
    if not pool.is_cuda:
        ok = (indices >= 0) & (indices < P)
        pool[indices[ok].long()] = states[ok].to(pool.dtype)
        return

    from kda.triton.decode import SCATTER_BLOCK, scatter_states_kernel

    slot = pool[0].numel()
    if indices.shape[0] and slot:
        with dispatch.on_device_of(pool):
            scatter_states_kernel[(indices.shape[0], cdiv(slot, SCATTER_BLOCK))](
                states.contiguous(), pool, indices, P, SLOT=slot, BLOCK=SCATTER_BLOCK
            )


def checked_problem(fn, *args, **kwargs) -> validation.Problem:
    """The checked :class:`~kda.validation.Problem` that ``fn(*args, **kwargs)`` would run
    (``fn``: :func:`chunk_kda` or :func:`fused_recurrent_kda`), with fn's own defaults.
    Lets tests and benchmarks call a backend's stages directly on a validated call."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    extra = arguments.pop("kwargs")
    arguments.pop("backend")
    check = validation.check_chunk_kda if fn is chunk_kda else validation.check_fused_recurrent_kda
    return check(arguments, extra)
