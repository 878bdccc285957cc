"""The CUDA forward: fill the parameter block from a checked Problem, launch K1 then K2."""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

import kda.cuda as switches
from kda import abi
from kda.cuda import loader
from kda.dispatch import log_once, note, on_device, stream_capturing
from kda.tables import build_tables, chunk_slots, chunk_tables
from kda.validation import Problem

# KDA_CUDA_WARPS's values: (16-row V groups a CTA, warps each group's K is split among) of the
# mma.sync K2; "mma": that K2 at the rule's width, never the wgmma one; "wgmma1", "wgmma2": the
# wgmma K2 at one or two CTAs an SM, wherever it can run (recurrence_kind).
RECURRENCE_OVERRIDES = {str(w): (w, 1) for w in abi.RECURRENCE_WIDTHS} | {
    f"{w}k2": (w, 2) for w in abi.RECURRENCE_SPLIT_WIDTHS
}
WGMMA_OVERRIDES = {f"wgmma{ctas}": ctas for ctas in abi.WGMMA_STAGES}
NO_WIDTH_OVERRIDES = ("mma", *WGMMA_OVERRIDES)  # values that leave the mma.sync width to the rule
# The wgmma K2 (recurrence.cu kda_recurrence_wgmma_c1, _c2) where its grid, two CTAs a pair, fills
# at least this share of the SMs. On the H200 (2026-12-04, run 121, one process, medians of three
# passes, benchmarks/NOTES.md), the call against the same call on the mma.sync K2: 1x8192 H64 (128
# CTAs, one an SM) 0.633 against 0.747 ms; two an SM: 1x8192 H96 (192 CTAs) 0.926 against 1.016,
# varlen6 H96 0.926 against 0.963, 1024x8 H96 0.941 against 0.982; run 122: 16x4096 H32 2.372
# against 2.561, 16x2048 H16 0.607 against 0.659. Where the grid leaves SMs idle it loses: 1x32768
# H32 (64 CTAs) 1.79 against 1.61 ms (run 120).
WGMMA_MIN_FILL = 0.9
# A call that time blocks take (blocks_wanted: one long sequence of few heads, K1 of block i + 1
# beside K2 of block i) runs the wgmma K2 whatever its grid fills: it covers 64 V rows a CTA, so it
# leaves half the SMs the mma.sync K2 of the same heads takes to K1, and draws less power. On the
# H200 (2026-12-04, run 123, benchmarks/k2_exclusive_ab.py, one process, two passes): 1x32768 H32
# in eight blocks 1.431 ms against 1.537 on the mma.sync K2 (uncut: 1.795 against 1.629), 1x131072
# H32 5.341 against 6.138; fla 3.800 and 15.039; run 124: 1x32768 H24 1.322 against 1.364, 1x65536
# H20 2.487 against 2.521. Such a call run uncut (under graph capture, or with no recurrence stream
# left) takes the same K2, so that its bits do not depend on whether it ran in blocks.


def recurrence_width(pairs: int, sms: int) -> tuple[int, int]:
    """``(warps, ksplit)`` per recurrence CTA, for ``pairs`` (sequence, head) pairs on ``sms`` SMs:
    ``warps`` 16-row V groups, each held by ``ksplit`` consumer warps (plus one producer warp).
    Measured on the H200: two warps (four CTAs a pair, 168 registers, four CTAs an SM) win while
    the pairs are few (up to 256 on 132 SMs: 1x8192 H96 0.563 ms vs 0.583 for four warps, 1x32768
    H32 1.25 vs 1.71); four warps (two CTAs a pair, 128 registers, three CTAs an SM) win from 512
    pairs on (1024x8 H96 0.440 vs 0.473, varlen6 H96 0.432 vs 0.476), where every SM holds several
    pairs and the shared workspace reads count (benchmarks/NOTES.md, 2026-11-30, commit 0f49568,
    run 3). Two warps with K split (``2k2``: four consumer warps, so each SM sub-partition gets
    one) win while the pairs give no SM more than two CTAs: 1x32768 H32 (32 pairs) K2 1.017 ms vs
    1.120, 1x8192 H64 (64 pairs) 0.406 vs 0.426, but 1x8192 H96 (96 pairs) 0.530 vs 0.453
    (2026-12-04, run 79). ``KDA_CUDA_WARPS`` (1, 2, 4, or 2k2) overrides the choice (read at
    import: ``kda.cuda.read_switches``); its values ``mma``, ``wgmma1`` and ``wgmma2`` leave the
    width to this rule (they choose the K2: :func:`recurrence_kind`)."""
    override = switches.WARPS_OVERRIDE
    if override is None or override in NO_WIDTH_OVERRIDES:
        if 2 * pairs <= sms:
            return (2, 2)
        return (4, 1) if pairs >= 3 * sms else (2, 1)
    if override not in RECURRENCE_OVERRIDES:
        raise ValueError(
            f"KDA_CUDA_WARPS must be one of {', '.join([*RECURRENCE_OVERRIDES, *NO_WIDTH_OVERRIDES])} "
            f"(the recurrence's CTA width or kind), got {override!r}"
        )
    return RECURRENCE_OVERRIDES[override]


def recurrence_kind(p: Problem, sms: int, checkpoints: bool, blocked: bool = False) -> int:
    """CTAs an SM of the wgmma K2 for ``p`` (1 or 2), or 0 for the mma.sync K2
    (:func:`recurrence_width`). The wgmma K2 writes no training checkpoints and reads K1's tiles
    as kda_prepare_wgmma stores them, the twin of the gate kda_prepare serves (no row past the
    exponent limit), so only such calls take it: by ``KDA_CUDA_WARPS`` (``wgmma1``, ``wgmma2``),
    for a call that time blocks take (``blocked``: :func:`blocks_wanted` > 1, run in blocks or
    not), or where its grid of two CTAs a (sequence, head) pair fills :data:`WGMMA_MIN_FILL` of
    the SMs; one CTA an SM up to one wave and two beyond (an explicit mma.sync width, or ``mma``,
    keeps the mma.sync K2). ``p`` is the whole call's problem or a time block of it: the same
    answer for both (a block differs in its length only). The far entry point's gates take it
    too, through that entry point's twin (:func:`_launch`), unless ``KDA_CUDA_FAR_WGMMA=0``."""
    if checkpoints or (prepare_kernel(p) != abi.PREPARE_KERNEL and not switches.FAR_WGMMA):
        return 0
    override = switches.WARPS_OVERRIDE
    if override is not None:
        return WGMMA_OVERRIDES.get(override, 0)
    ctas = wgmma_grid(p.N * p.H)
    if not blocked and ctas < WGMMA_MIN_FILL * sms:
        return 0
    return 1 if ctas <= sms else 2


# K1 beside K2 (pipeline_blocks): a long single sequence whose recurrence grid leaves most of
# every SM idle (K2's chains: one CTA an SM or fewer) is cut into time blocks; K1 of block i + 1
# runs on the current stream while K2 of block i runs on a high-priority stream beside it, and
# each K2 starts from the state the one before it wrote (float32, as K2 carries it). Measured on
# the H200 (2026-12-04, run 87, benchmarks/blocks_ab.py, same process; 4 / 8 / 16 / 32 blocks
# against the uncut call): 1x32768 H32 1.607 ms uncut, 1.627 / 1.562 / 1.645 / 1.875; 1x131072
# H32 6.441, 6.569 / 6.229 / 6.366 / 6.321. Eight blocks won both; more lose to the host's cost a
# block (two launches, a stream wait, the block's tables: 1x8192 H64 in 16 blocks took 1.647 ms
# against 0.709 uncut). In the final form (run 92, three paired rounds): 1x32768 H32 2-3% faster
# each round, 1x131072 H32 from 0.5% slower to 5.4% faster. K2's chains run at about half speed
# while K1 runs beside them (run 90, benchmarks/blocks_trace.py), which is why the gain is a few
# percent and not K1's whole time. Not measured below 32768 tokens, nor with more than one CTA an
# SM of K2 beyond 1x8192 H64 and H96 (where blocks only lost), so not taken there. That was the
# mma.sync K2; since run 123 the blocks take the wgmma K2 (recurrence_kind's ``blocked``), which
# leaves half the SMs to K1, and the blocked call is 12% faster than the uncut mma.sync one
# (1x32768 H32 1.431 against 1.629 ms) and 17% on 1x131072 H32 (5.341 against 6.446).
PIPELINE_BLOCKS = 8  # time blocks under the rule
PIPELINE_MIN_TOKENS = 32768  # no blocks below this length


def one_sequence(p: Problem) -> bool:
    """Whether ``p`` is one sequence filling its inputs (B = 1, and no cu_seqlens or checked ones
    of ``[0, T]``): a time block is then a contiguous slice of every input."""
    return p.B == 1 and (p.cu_seqlens is None or p.cu_seqlens_values == (0, p.T))


def pipeline_blocks(p: Problem, sms: int, capturing: bool, checkpoints: bool) -> int:
    """Time blocks for ``p``'s K1 to run beside its K2 (1: K1 over the whole call, then K2):
    :func:`blocks_wanted`, outside CUDA graph capture (the fork onto a second stream is neither
    needed there nor tested)."""
    return 1 if capturing else blocks_wanted(p, sms, checkpoints)


def blocks_wanted(p: Problem, sms: int, checkpoints: bool) -> int:
    """The time blocks ``p`` takes where it can (:func:`pipeline_blocks`; 1: none). Only for one
    sequence (:func:`one_sequence`) and without training checkpoints. The rule:
    sequences of at least :data:`PIPELINE_MIN_TOKENS` whose recurrence grid has at most one CTA
    an SM (:func:`recurrence_ctas`; at the default widths up to 33 heads on 132 SMs), in
    :data:`PIPELINE_BLOCKS` blocks. ``KDA_CUDA_BLOCKS`` (a count >= 1; 1 turns it off) replaces
    the rule for the calls that qualify (a block count past the chunks gives a block a chunk); a
    value that is not such a count is refused on any call that reaches this choice."""
    override = switches.BLOCKS_OVERRIDE
    if override is not None:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"KDA_CUDA_BLOCKS must be a whole number >= 1 (time blocks; 1: off), got {override!r}")
        wanted = int(override)
    elif recurrence_ctas(p.N * p.H, sms) <= sms and p.T >= PIPELINE_MIN_TOKENS:
        wanted = PIPELINE_BLOCKS
    else:
        wanted = 1
    if wanted <= 1 or checkpoints or not one_sequence(p):
        return 1
    return max(1, min(wanted, -(-p.T // abi.CHUNK)))


def recurrence_ctas(pairs: int, sms: int) -> int:
    """K2's grid for ``pairs`` (sequence, head) pairs at the width :func:`recurrence_width` takes."""
    return chain_grid(recurrence_width(pairs, sms)[0], pairs)


def chain_grid(warps: int, pairs: int) -> int:
    """CTAs of a chain kernel (the recurrence, the reverse chain) of ``warps`` 16-row V groups a
    CTA: one a V slice of every (sequence, head) pair."""
    return loader.HEAD_DIM // (16 * warps) * pairs


def wgmma_grid(pairs: int) -> int:
    """CTAs of one wgmma K2 run: a warpgroup (four 16-row V groups, 64 V rows) a CTA, so two a
    (sequence, head) pair."""
    return chain_grid(4, pairs)


def block_bounds(T: int, blocks: int) -> list[tuple[int, int]]:
    """``[(t0, t1), ...]``: ``T`` tokens in at most ``blocks`` blocks of whole chunks (the last
    takes the rest), so that every chunk of the uncut call is a chunk of one block."""
    span = -(-T // (blocks * abi.CHUNK)) * abi.CHUNK
    return [(t0, min(t0 + span, T)) for t0 in range(0, T, span)]


# The recurrence's stream for each (device, stream) whose calls run K1 beside K2: a stream of
# kda's own (torch's pool hands the same few streams to every caller, whose work would then queue
# behind K2, or whose capture K2's wait would break), at the highest priority, so that K2's CTAs
# take the SM slots K1's free first (K1's are many and short, K2's few and long: a K2 CTA waiting
# behind K1's would hold its chain back), and non-blocking (the legacy default stream, torch's
# default, would otherwise wait for it and K1 with it). Kept for the process; at most
# RECURRENCE_STREAMS of them, after which further streams' calls run uncut.
RECURRENCE_STREAMS = 8
_recurrence_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def stream_pair(device_index: int, stream: int, kernels) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
    """``(the current stream, its recurrence stream)`` of ``device_index`` as torch streams, the
    second made through ``kernels``' driver the first time; None when RECURRENCE_STREAMS are
    kept for other streams already."""
    key = (device_index, stream)
    side = _recurrence_streams.get(key)
    if side is None:
        with _streams_lock:
            side = _recurrence_streams.get(key)
            if side is None:
                if len(_recurrence_streams) >= RECURRENCE_STREAMS:
                    return None
                driver = kernels.driver
                with on_device(device_index):
                    kernels.bind_context(device_index)
                    _, greatest = loader.check(driver.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
                    flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
                    handle = loader.check(
                        driver.cuStreamCreateWithPriority(flags, greatest), "cuStreamCreateWithPriority"
                    )
                side = _recurrence_streams[key] = torch.cuda.ExternalStream(int(handle), device=device_index)
    return torch.cuda.current_stream(device_index), side


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def workspace_bytes(p: Problem, tables=None) -> int:
    """Bytes of K1's workspace for ``p`` (``tables``: its chunk tables, if already at hand; the
    slot count comes from the shapes alone either way)."""
    num_chunks = tables.num_chunks if tables is not None else chunk_slots(p.B, p.T, p.N, p.cu_seqlens is not None)
    return max(num_chunks, 1) * p.H * loader.WORKSPACE_BYTES


# Workspaces up to this size are kept, one per (device, stream), and reused by the next call
# on that stream: an allocation from torch's caching allocator costs 1.5-3.5 us of host time
# on the H200 host (benchmarks/NOTES.md, 2026-11-30, commit 89af978), against a budget of 40 us for a small
# call; bigger problems allocate per call, where that is noise beside the kernels. Reuse is
# safe because the stream orders the calls (K1 and K2 of one call are launched together,
# under the loader's lock), and a workspace outgrown is handed back to the allocator, which
# gives its blocks only to later work on the same stream. A call being captured into a CUDA
# graph always allocates: the graph keeps that workspace and may replay on any stream.
# The key is the raw stream handle: a stream of another library (torch.cuda.ExternalStream)
# destroyed while kda's kernels are queued on it, whose handle then comes back for a new
# stream, would share its workspace with them; call release_workspaces() before destroying
# such a stream. Kept workspaces (4 MB at most a stream) are not freed by empty_cache().
SHARED_WORKSPACE_BYTES = 4 << 20
_workspaces: dict[tuple[int, int], torch.Tensor] = {}


def stream_workspace(q: torch.Tensor, stream: int, nbytes: int) -> torch.Tensor:
    """A workspace of at least ``nbytes`` (at most :data:`SHARED_WORKSPACE_BYTES`) kept for
    ``stream`` on q's device; allocated like ``q`` the first time and when outgrown. Keyed by
    ``q.get_device()``: CPU tensors (the host-side tests) get -1, never a GPU's key."""
    key = (q.get_device(), stream)
    workspace = _workspaces.get(key)
    if workspace is None or workspace.numel() < nbytes:
        workspace = _workspaces[key] = q.new_empty(nbytes, dtype=torch.uint8)
    return workspace


def release_workspaces() -> None:
    """Wait for the kernels queued on each kept workspace's device, then hand the workspaces
    back to torch's allocator (CPU ones, from the host-side tests, need no wait)."""
    for device_index in {index for index, _ in _workspaces if index >= 0}:
        torch.cuda.synchronize(device_index)
    _workspaces.clear()


# loader.FLAGS as constants: ten dict lookups a call fewer.
FLAG_GATE_LOWER_BOUND = loader.FLAGS["gate_lower_bound"]
FLAG_HAS_A_LOG = loader.FLAGS["has_A_log"]
FLAG_HAS_DT_BIAS = loader.FLAGS["has_dt_bias"]
FLAG_L2NORM = loader.FLAGS["l2norm"]
FLAG_BETA_SIGMOID = loader.FLAGS["beta_sigmoid"]
FLAG_HAS_H0 = loader.FLAGS["has_h0"]
FLAG_STORE_HT = loader.FLAGS["store_ht"]
FLAG_STATE_V_FIRST = loader.FLAGS["state_v_first"]
FLAG_STORE_CHECKPOINTS = loader.FLAGS["store_checkpoints"]
FLAG_V_ZERO = loader.FLAGS["v_zero"]
FLAG_G_FLOAT32 = loader.FLAGS["g_float32"]
FLAG_BETA_FLOAT32 = loader.FLAGS["beta_float32"]
FLAG_H0_BFLOAT16 = loader.FLAGS["h0_bfloat16"]
FLAG_HT_BFLOAT16 = loader.FLAGS["ht_bfloat16"]

# The private accessor torch's inductor launches with (get_raw_stream): the raw handle without
# building a torch.cuda.Stream object. Absent from CPU-only builds.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """Torch's current stream on ``device_index`` as a raw handle, asked on every call: a user
    stream or a CUDA graph capture may have made another one current."""
    if _current_raw_stream is not None:
        return _current_raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def chunk_forward(p: Problem, checkpoints: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run K1 and K2 for a problem the backend accepted: ``(o, final state or None)``. With
    ``checkpoints`` (float32 ``[rows, H, V, K]``, kda.triton.training.checkpoint_shape) K2
    also writes the training forward's state checkpoints there."""
    kernels, device_index, stream, capturing = _launch_context(p)
    if p.N * p.H == 0:  # nothing to launch (an empty batch); the driver refuses empty grids
        return _outputs(p)
    sms = sm_count(device_index)
    blocks = pipeline_blocks(p, sms, capturing, checkpoints is not None)
    if blocks > 1:
        streams = stream_pair(device_index, stream, kernels)
        if streams is not None:
            return _run_blocks(p, *_outputs(p), blocks, kernels, device_index, stream, streams)
        log_once(f"chunk_kda: no time blocks on this stream ({RECURRENCE_STREAMS} recurrence streams kept already)")
    o, ht = _outputs(p)
    tables, workspace = _tables_and_workspace(p, kernels, device_index, stream, capturing)
    # uncut: the K2 blocks would have taken where they were wanted (no stream left, or a capture)
    blocked = blocks > 1 or (capturing and blocks_wanted(p, sms, checkpoints is not None) > 1)
    kind = recurrence_kind(p, sms, checkpoints is not None, blocked=blocked)
    _launch(p, o, ht, workspace, tables, kernels, device_index, stream, True, checkpoints, wgmma_ctas=kind)
    return o, ht


def run_blocks(p: Problem, o: torch.Tensor, ht: torch.Tensor | None, blocks: int) -> tuple:
    """K1 beside K2 in ``blocks`` time blocks into given outputs, whatever the rule says (tests:
    poisoned outputs; the call path is :func:`chunk_forward`, through :func:`pipeline_blocks`).
    ``p``: one sequence (:func:`one_sequence`)."""
    if not one_sequence(p):
        raise ValueError(f"run_blocks: one sequence only (B = 1, cu_seqlens None or [0, T]), got B={p.B}, N={p.N}")
    kernels, device_index, stream, _ = _launch_context(p)
    streams = stream_pair(device_index, stream, kernels)
    if streams is None:
        raise RuntimeError(f"run_blocks: {RECURRENCE_STREAMS} recurrence streams are kept for other streams already")
    return _run_blocks(p, o, ht, blocks, kernels, device_index, stream, streams)


def _run_blocks(p: Problem, o, ht, blocks: int, kernels, device_index: int, stream: int, streams) -> tuple:
    """:func:`chunk_forward` of one sequence in time blocks (:func:`pipeline_blocks`), each a
    batched call of B = 1:
    K1 of every block on the current stream, K2 of each on the recurrence stream once its K1 is
    done, reading the state the previous block's K2 wrote. The blocks' chunks are the uncut
    call's and K2 carries the state in float32 from one block to the next as within one, so the
    result is the uncut call's on the same K2 bit for bit (tests/test_cuda.py; every block's K2
    is the one :func:`recurrence_kind` picks for a blocked call, which :func:`chunk_forward` also
    gives such a call run uncut). Every buffer is allocated on the
    current stream, which waits for the recurrence stream before it returns: later work there
    (and the allocator's reuse of these buffers) comes after the last K2."""
    bounds = block_bounds(p.T, blocks)
    # The state between blocks: two buffers, as K2 of block i reads one while it writes the other.
    carries = [p.q.new_empty(p.state_shape, dtype=torch.float32) for _ in range(min(2, len(bounds) - 1))]
    parts, end = [], 0  # (block problem, its o, the state it writes, its workspace's start and end)
    for i, (t0, t1) in enumerate(bounds):
        last = i == len(bounds) - 1
        h0 = p.initial_state if i == 0 else carries[(i - 1) % 2]
        ht_i = ht if last else carries[i % 2]
        part = dataclasses.replace(
            p, q=p.q[:, t0:t1], k=p.k[:, t0:t1], v=p.v[:, t0:t1], g=p.g[:, t0:t1], beta=p.beta[:, t0:t1],
            T=t1 - t0, initial_state=h0, output_final_state=ht_i is not None,
            cu_seqlens=None, cu_seqlens_cpu=None, cu_seqlens_values=None,
        )  # fmt: skip
        start, end = end, end + workspace_bytes(part)
        parts.append((part, o[:, t0:t1], ht_i, start, end))
    workspace = p.q.new_empty(end, dtype=torch.uint8)  # every block's own: K1 runs ahead of K2
    with on_device(device_index):
        launches = [
            (part, o_i, ht_i, workspace[a:b], block_tables(part, kernels, device_index, stream))
            for part, o_i, ht_i, a, b in parts
        ]
    current, side = streams
    kind = recurrence_kind(p, sm_count(device_index), False, blocked=True)  # one K2 kind for every block
    log_once(f"chunk_kda: K1 beside K2 in {len(bounds)} time blocks of <= {bounds[0][1]} tokens")
    note(f"cuda:blocks:{len(bounds)}")
    try:
        # Every K1 first, an event after each, then every K2 after its K1's event: the current
        # stream gets its whole queue at once, so no K1 waits for the host to launch it (a block's
        # two launches and wait take about as long on the host as its K1 on the GPU).
        ready = []
        for part, o_i, ht_i, block, t in launches:
            _launch(
                part, o_i, ht_i, block, t, kernels, device_index, stream, True, run_recurrence=False, wgmma_ctas=kind
            )
            ready.append(current.record_event())  # this K1, and before it the inputs, initial state and tables
        for (part, o_i, ht_i, block, t), event in zip(launches, ready):
            side.wait_event(event)
            _launch(part, o_i, ht_i, block, t, kernels, device_index, side.cuda_stream, False, wgmma_ctas=kind)
    finally:  # also when a launch fails: nothing later on the current stream may overtake what is queued
        current.wait_stream(side)
    return o, ht


# Tables of block lengths, per (device, stream, tokens, heads, K), kept apart from chunk_tables'
# cache of batched layouts (whose room a long call's block lengths would take for the process):
# at most BLOCK_TABLES_KEPT, past which blocks build theirs each call (one launch a length).
BLOCK_TABLES_KEPT = 16
_block_tables: dict[tuple[int, int, int, int, int], object] = {}


def block_tables(part: Problem, kernels, device_index: int, stream: int):
    """The chunk tables of one time block (a batched call of B = 1), built on ``stream``."""
    key = (device_index, stream, part.T, part.H, part.K)
    tables = _block_tables.get(key)
    if tables is None:
        tables = build_tables(part, kernels, stream)
        if len(_block_tables) < BLOCK_TABLES_KEPT:
            _block_tables[key] = tables
    return tables


def chunk_forward_runs(
    problems: list[Problem], v_zero: list[bool] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`chunk_forward` of calls that differ in v and the initial state only (the segment
    split's transition runs: v from zero states, and v = 0 from the identity's columns): K1's
    workspace holds neither (kda_cuda.cuh), so K1 runs once, for the first, and K2 once a call
    on its workspace (two calls on the wgmma K2: one launch for both, :func:`runs_kind`). Saves a
    K1 pass a run after the first (about 45% of a pass on 1x8192 H96: K1 0.468 ms, K2 0.548,
    README). ``v_zero[i]``: call i's v is zeros, which its K2 takes
    without reading v (the ``v_zero`` flag; the problem's v is then only a template of its
    shape). Raises ValueError where the calls differ in what K1 reads."""
    first = problems[0]
    if not share_prepare(problems):
        raise ValueError(
            "chunk_forward_runs: the calls must share q, k, g, beta, A_log, dt_bias, their flags, "
            "scale, lower bound and sequence layout (they may differ in v and initial_state only)"
        )
    kernels, device_index, stream, capturing = _launch_context(first)
    results = [_outputs(p) for p in problems]
    if first.N * first.H == 0:
        return results
    # A workspace of this call's own, never the stream's kept one: the runs' launches are not one
    # critical section of the loader's lock, and another thread's call on the same stream could
    # refill a kept workspace between them.
    tables, workspace = _tables_and_workspace(first, kernels, device_index, stream, capturing, keep=False)
    extra = [FLAG_V_ZERO if v_zero is not None and v_zero[i] else 0 for i in range(len(problems))]
    ctas = runs_kind(problems, sm_count(device_index))
    if ctas:  # K1 (its tiles for the wgmma K2) on the first run's block, then both runs in one launch
        # (K1 reads none of what the blocks differ in: v, the states, o and the v_zero flag)
        blocks = [forward_params(p, o, ht, workspace, tables, extra_bits=bits)
                  for p, (o, ht), bits in zip(problems, results, extra)]  # fmt: skip
        _launch(first, *results[0], workspace, tables, kernels, device_index, stream, True, run_recurrence=False,
                wgmma_ctas=ctas, params=blocks[0])  # fmt: skip
        _launch_runs(first, blocks, kernels, device_index, stream, ctas)
        return results
    for i, (p, (o, ht)) in enumerate(zip(problems, results)):
        _launch(p, o, ht, workspace, tables, kernels, device_index, stream, i == 0, extra_bits=extra[i])
    return results


def runs_kind(problems: list[Problem], sms: int) -> int:
    """CTAs an SM of the two-run wgmma K2 (recurrence.cu ``recurrence_wgmma_runs``) for the runs
    ``problems`` of :func:`chunk_forward_runs`, or 0 for a K2 launch a run. Two runs whose K2 is
    the wgmma one (:func:`recurrence_kind` of the first) go in one launch, their CTAs interleaved
    pair by pair so that the workspace comes from DRAM about once (the segment split's R and P
    runs: 15 GB of K1 workspace at 2M tokens H8, read by each), one CTA an SM where the doubled
    grid fits one wave, else two (``KDA_CUDA_WARPS=wgmma1|wgmma2`` fixes it). ``KDA_CUDA_PAIRED_RUNS=0``
    (read at import) keeps a launch a run."""
    kind = recurrence_kind(problems[0], sms, False)
    if not switches.PAIRED_RUNS or len(problems) != 2 or not kind:
        return 0
    if switches.WARPS_OVERRIDE in WGMMA_OVERRIDES:
        return kind
    return 1 if 2 * wgmma_grid(problems[0].N * problems[0].H) <= sms else 2


def _launch_runs(first, blocks, kernels, device_index, stream, ctas: int) -> None:
    """K2 of two runs on K1's workspace in one launch (:func:`runs_kind`): each run's own Params
    block in ``blocks`` (its v, states, output and flags; ``first``: the first run's problem), the
    grid twice one run's."""
    name, shared_bytes = loader.RECURRENCE_WGMMA_RUNS_KERNELS[ctas]
    with on_device(device_index), kernels.lock:
        kernels.bind_context(device_index)
        kernels.set_params(blocks[0])
        kernels.set_second_params(blocks[1])
        kernels.launch(name, (2 * wgmma_grid(first.N * first.H), 1), abi.WGMMA_THREADS, shared_bytes, stream, "runs")
    note("cuda:recurrence:runs")
    note(f"cuda:recurrence:wgmma{ctas}")
    log_once(f"chunk_kda: two runs' K2 in one launch on wgmma, {ctas} CTA(s) an SM ({name})")


def share_prepare(problems: list[Problem]) -> bool:
    """Whether K1 reads the same of every one of ``problems`` (so one K1 serves them all)."""
    first = _prepare_inputs(problems[0])
    return all(_prepare_inputs(p) == first for p in problems[1:])


def _prepare_inputs(p: Problem) -> tuple:
    """What K1 reads of ``p`` (kda_prepare): tensors by address, the input flags, the scalars
    and the sequence layout."""
    tensors = (p.q, p.k, p.g, p.beta, p.A_log, p.dt_bias, p.cu_seqlens)
    addresses = tuple(None if x is None else (x.data_ptr(), x.shape, x.stride()) for x in tensors)
    return addresses, input_flags(p), p.scale, p.lower_bound, p.allow_neg_eigval, p.B, p.T, p.N, p.H


def _outputs(p: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, final state or None)`` of ``p``, uninitialised."""
    o = torch.empty_like(p.v)
    ht, h0, dtype = None, p.initial_state, p.final_state_dtype
    if p.output_final_state and h0 is not None and h0.dtype == dtype:
        # A given initial state has the final state's shape (and often its dtype), and is
        # contiguous: empty_like then skips parsing a shape, dtype and device.
        ht = torch.empty_like(h0)
    elif p.output_final_state:
        ht = p.q.new_empty(p.state_shape, dtype=dtype)
    return o, ht


def _tables_and_workspace(p: Problem, kernels, device_index: int, stream: int, capturing: bool, keep: bool = True):
    """``p``'s chunk tables (built by ``kernels``' own builder on ``stream``) and a K1 workspace
    for them: the stream's kept one when small enough, not capturing and ``keep``, else a fresh one."""
    with on_device(device_index):  # the launch goes to the current device's context
        tables = chunk_tables(p, capturing, kernels, stream)
    nbytes = workspace_bytes(p, tables)
    if keep and nbytes <= SHARED_WORKSPACE_BYTES and not capturing:
        workspace = stream_workspace(p.q, stream, nbytes)
    else:
        workspace = p.q.new_empty(nbytes, dtype=torch.uint8)
    return tables, workspace


def run_stages(
    p: Problem, o: torch.Tensor, ht: torch.Tensor | None, workspace: torch.Tensor, run_prepare: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K1 and K2 into given buffers (tests: poisoned outputs, a workspace read back through
    ``loader.workspace_views``, or filled by hand with ``run_prepare=False`` to test K2
    alone; the workspace's tile layout is the one :func:`recurrence_kind` picks for ``p``, so
    such tests pin it with ``KDA_CUDA_WARPS``). Not on the call path: :func:`chunk_forward`
    allocates its own."""
    kernels, device_index, stream, capturing = _launch_context(p)
    if p.N * p.H:
        with on_device(device_index):
            tables = chunk_tables(p, capturing, kernels, stream)
        _launch(p, o, ht, workspace, tables, kernels, device_index, stream, run_prepare)
    return o, ht


def _launch_context(p: Problem):
    """(kernels, device index, stream handle, whether the stream is capturing) for ``p``."""
    kernels = loader.kernels()
    device_index = p.q.get_device()
    if device_index < 0:  # CPU tensors: the host-side tests, which stand in for the device
        device_index = torch.cuda.current_device()
    kernels.configure(device_index)
    stream = current_stream(device_index)
    # No capture happens on the legacy default stream (handle 0, torch's default, as the direct
    # launch reads it): CUDA refuses it, so the query (0.3 us) is needed only on other streams.
    capturing = stream != 0 and p.q.is_cuda and stream_capturing(device_index)
    return kernels, device_index, stream, capturing


def prepare_kernel(p: Problem) -> str:
    """K1's entry point for ``p``'s gate (abi.prepare_kernel_name)."""
    return abi.prepare_kernel_name(p.gate_form == "lower_bound", p.lower_bound or 0.0)


def input_flags(p: Problem) -> int:
    """The flag bits of how ``p``'s inputs are read and activated (the gate and its A_log and
    dt_bias, l2norm, beta sigmoid, g and beta in float32), shared by every CUDA launch."""
    bits = 0
    if p.gate_form == "lower_bound":
        bits = FLAG_GATE_LOWER_BOUND
        if p.A_log is not None:
            bits |= FLAG_HAS_A_LOG
        if p.dt_bias is not None:
            bits |= FLAG_HAS_DT_BIAS
    if p.use_qk_l2norm:
        bits |= FLAG_L2NORM
    if p.use_beta_sigmoid:
        bits |= FLAG_BETA_SIGMOID
    if p.g.dtype == torch.float32:
        bits |= FLAG_G_FLOAT32
    if p.beta.dtype == torch.float32:
        bits |= FLAG_BETA_FLOAT32
    return bits


def state_flags(p: Problem, h0: torch.Tensor | None, ht: torch.Tensor | None) -> int:
    """The flag bits of the state read (``h0``: has_h0, h0_bfloat16), the state written (``ht``:
    store_ht, ht_bfloat16) and their layout (state_v_first)."""
    bits = 0
    if h0 is not None:
        bits |= FLAG_HAS_H0
        if h0.dtype == torch.bfloat16:
            bits |= FLAG_H0_BFLOAT16
    if ht is not None:
        bits |= FLAG_STORE_HT
        if ht.dtype == torch.bfloat16:
            bits |= FLAG_HT_BFLOAT16
    if p.state_v_first:
        bits |= FLAG_STATE_V_FIRST
    return bits


def workspace_address(workspace: torch.Tensor) -> int:
    """The address of a K1 workspace, which must start on ``abi.WORKSPACE_ALIGN`` bytes (torch's
    CUDA allocations do; a view at an offset might not). CPU tensors, which stand in for the
    device in the host-side tests and reach no kernel, are not asked."""
    address = workspace.data_ptr()
    if address % abi.WORKSPACE_ALIGN and workspace.is_cuda:
        raise ValueError(f"the K1 workspace must start on {abi.WORKSPACE_ALIGN} bytes, got address {address:#x}")
    return address


def forward_params(p, o, ht, workspace, tables, checkpoints=None, extra_bits: int = 0) -> tuple:
    """:func:`chunk_params` of K1 and K2 of ``p`` (its v and initial state) into ``o`` and ``ht``:
    its input and state flags, store_checkpoints where ``checkpoints`` are given, and
    ``extra_bits`` (such as v_zero)."""
    bits = input_flags(p) | state_flags(p, p.initial_state, ht) | extra_bits
    if checkpoints is not None:
        bits |= FLAG_STORE_CHECKPOINTS
    return chunk_params(p, p.v, p.initial_state, ht, o, workspace, tables, checkpoints, bits)


def chunk_params(p, v, h0, ht, o, workspace, tables, checkpoints, bits: int, q=None) -> tuple:
    """loader.Params field by field: ``p``'s inputs, with v, the state read and written, the
    output, the workspace and the checkpoints given, and q where given (the training backward's
    kernels take other tensors for some of them: kda.cuda.training); None is a null pointer."""
    return (
        (p.q if q is None else q).data_ptr(), p.k.data_ptr(), v.data_ptr(), p.g.data_ptr(), p.beta.data_ptr(),
        0 if p.A_log is None else p.A_log.data_ptr(), 0 if p.dt_bias is None else p.dt_bias.data_ptr(),
        0 if h0 is None else h0.data_ptr(), 0 if ht is None else ht.data_ptr(),
        0 if o is None else o.data_ptr(), workspace_address(workspace), *tables.addresses,
        0 if checkpoints is None else checkpoints.data_ptr(), tables.checkpoint_address,
        tables.num_chunks, p.N, p.H, bits,
        p.scale, p.lower_bound if p.lower_bound is not None else 0.0, 2.0 if p.allow_neg_eigval else 1.0,
    )  # fmt: skip


def _launch(
    p, o, ht, workspace, tables, kernels, device_index, stream, run_prepare, checkpoints=None, extra_bits=0,
    run_recurrence=True, wgmma_ctas=None, params=None,
) -> None:  # fmt: skip
    """Fill the Params block and launch K1 (unless ``run_prepare`` is False) and K2 (unless
    ``run_recurrence`` is False; writing ``checkpoints`` where given; ``extra_bits``: further
    flags, such as v_zero; ``wgmma_ctas``: the K2 kind the caller decided for the call, which
    K1 stores its tiles for; None: :func:`recurrence_kind` of ``p``; ``params``: the block
    already composed for these arguments, as :func:`chunk_forward_runs` has it)."""
    if params is not None and (checkpoints is not None or extra_bits):
        raise ValueError("_launch: a composed params block already holds the checkpoints and flags")
    N, H = p.N, p.H
    num_chunks = tables.num_chunks
    sms = sm_count(device_index)
    if wgmma_ctas is None:
        wgmma_ctas = recurrence_kind(p, sms, checkpoints is not None)
    if wgmma_ctas:  # K1's twin stores its tiles for the wgmma K2 (one decision for both: the same p)
        prepare_name = abi.PREPARE_WGMMA_TWINS[prepare_kernel(p)]
        name, shared_bytes = loader.RECURRENCE_WGMMA_KERNELS[wgmma_ctas]
        grid, threads = (wgmma_grid(N * H), 1), abi.WGMMA_THREADS
    else:
        warps, ksplit = recurrence_width(N * H, sms)
        prepare_name, (name, shared_bytes) = prepare_kernel(p), loader.RECURRENCE_KERNELS[warps, ksplit]
        grid, threads = (chain_grid(warps, N * H), 1), 32 * (warps * ksplit + 1)  # consumers and a producer warp
    if params is None:
        params = forward_params(p, o, ht, workspace, tables, checkpoints, extra_bits)
    with on_device(device_index), kernels.lock:
        kernels.bind_context(device_index)
        kernels.set_params(params)
        if num_chunks and run_prepare:
            kernels.launch(prepare_name, (num_chunks, H), loader.PREPARE_THREADS, 0, stream)
            note("cuda:prepare")
        if not run_recurrence:
            return
        kernels.launch(name, grid, threads, shared_bytes, stream)
        note("cuda:recurrence")
        if wgmma_ctas:
            note(f"cuda:recurrence:wgmma{wgmma_ctas}")
            log_once(f"chunk_kda: K2 on wgmma, {wgmma_ctas} CTA(s) an SM ({name})")
