// The decode step on Hopper (spec section 7): one CTA per (sequence, value head, slice of BV
// V columns) runs the token loop of reference.pooled_recurrent_kda over its sequence's tokens,
//   S = S Diag(exp(g_t)),  u = beta_t (v_t - S^T k_t),  S += k_t u^T,  o_t = scale S^T q_t,
// with the state slice [128, BV] read once and written once.
//
// A decode step is a copy of the states with a little arithmetic: it runs at the rate of the
// state bytes it keeps in flight and of the shared-memory and issue slots it spends per
// element. The slice arrives in shared memory by bulk (TMA) copies, so the bytes in flight
// hold no registers and no copy instructions (eight or nine 16 KB slices an SM at 64 bf16 or 32
// float32 columns, five 32 KB ones for whole bf16 heads: decode_ctas_per_sm). Each thread owns
// 16-byte runs of the slice, contiguous in memory and adjacent across a warp for either layout,
// and reads and writes them with 16-byte accesses; the token's per-K vectors (decay d, k, d k,
// d q) are one 16-byte broadcast read a run.
// (benchmarks/NOTES.md, 2026-12-02, has the versions measured: one thread a column with
// scalar reads had ncu's L1/shared pipe 93% busy at 56% of DRAM bandwidth; the runs held in
// registers, loaded without shared memory, held fewer slices in flight and ran slower.)
//
// Per token: a prologue gives each thread one K index (q, k, the gate and its decay; the sums
// q.q, k.k and q.k over K for the l2norm), then one pass over the thread's elements forms both
// sums over K, (S d).k and (S d).q, so that o needs no pass after the update:
//   o = scale (S d + k u^T)^T q = scale ((S d)^T q + u (k.q)),
// and a second pass, in registers, forms S d + k u^T. The state stays in its own dtype between
// tokens, so the host sends a bf16 state here only for one token a sequence (kda/cuda/decode.py).
//
// Slots (DecodeParams::index_mode): 0, sequence n is slot n (a plain call: h0 and ht are N
// states); 1, slot indices[n]; 2, indices[n, t] receives the state after token t and the first
// token reads indices[n, accepted[n] - 1]. A slot outside [0, pool_slots) is read as zeros and
// never written, so no index reaches memory outside the pool.
#include <type_traits>

#include "kda_cuda.cuh"

namespace kda {
namespace {

constexpr int kDecodeWarps = kDecodeThreads / 32;
static_assert(kDecodeThreads == kHeadDim, "the token prologue gives each thread one K index");

// A diagnostic build (-DKDA_DECODE_TRACE=1, benchmarks/decode_trace.py) writes, over each CTA's
// first output row, when it started and ended and the clock cycles to four points of its life.
#ifndef KDA_DECODE_TRACE
#define KDA_DECODE_TRACE 0
#endif
#if KDA_DECODE_TRACE
__device__ __forceinline__ int64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return int64_t(t);
}
#endif

__device__ __forceinline__ int64_t load_index(const void* base, int64_t i, bool is_int64) {
  return is_int64 ? static_cast<const int64_t*>(base)[i] : static_cast<int64_t>(static_cast<const int32_t*>(base)[i]);
}

// A run of state values (16 bytes; 8 of bf16 for a bf16 state written back in float32, below)
// <-> their values in float32.
template <typename E, int Vec = 16 / sizeof(E)>
struct Run;
template <>
struct Run<float, 4> {
  static constexpr int kVec = 4;
  using Raw = uint4;
  __device__ static void unpack(const uint4& raw, float (&x)[kVec]) {
    x[0] = __uint_as_float(raw.x);
    x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z);
    x[3] = __uint_as_float(raw.w);
  }
  __device__ static uint4 pack(const float (&x)[kVec]) {
    return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
  }
};
template <>
struct Run<__nv_bfloat16, 8> {
  static constexpr int kVec = 8;
  using Raw = uint4;
  __device__ static void unpack(const uint4& raw, float (&x)[kVec]) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // the lower address is the low half
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static uint4 pack(const float (&x)[kVec]) {
    return make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(x[4], x[5]), pack_bf16(x[6], x[7]));
  }
};
template <>
struct Run<__nv_bfloat16, 4> {
  static constexpr int kVec = 4;
  using Raw = uint2;
  __device__ static void unpack(const uint2& raw, float (&x)[kVec]) {
    x[0] = __uint_as_float(raw.x << 16);
    x[1] = __uint_as_float(raw.x & 0xffff0000u);
    x[2] = __uint_as_float(raw.y << 16);
    x[3] = __uint_as_float(raw.y & 0xffff0000u);
  }
  __device__ static uint2 pack(const float (&x)[kVec]) {
    return make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]));
  }
};

// The run a thread reads and writes: 16 bytes of the state, but for a bf16 [K, V] state written
// back in float32, 8 bytes, so that its float32 write is one 16-byte store a thread and a
// warp's stores are contiguous (16-byte bf16 runs stored as two float32 halves 16 bytes apart,
// each store instruction writing every other 16 bytes of a warp's span, ran at 0.87 of the
// copy bandwidth at N=256 on an H100 against the bf16 write-back's 0.94: run 205, 2026-12-07;
// in 8-byte runs N=32 0.0500 -> 0.0404 ms, N=256 0.3032 -> 0.2822, 0.94: run 206's A/B).
template <typename E, typename O, bool VFirst>
constexpr int run_vec() {
  return !VFirst && !std::is_same_v<E, O> ? 4 : Run<E>::kVec;
}

// N adjacent bf16 values (4 or 8: one 8- or 16-byte access).
template <int N>
struct alignas(2 * N) BfloatRun {
  __nv_bfloat16 x[N];
};

// Which elements of the slice [128, BV] a thread owns: kRuns runs of kVec elements that are
// contiguous in memory, at the same place in the shared copy of the slice (stored as in memory). [K, V] states: thread (tc fastest, tk) owns columns tc kVec .. + kVec
// of rows tk + kThreadsK r; [V, K] states: thread (tk fastest, tc) owns K indices tk kVec ..
// + kVec of columns tc + kThreadsC r. Either way a warp's runs of one r are adjacent in memory.
template <typename E, bool VFirst, int BV, int Vec>
struct Ownership {
  static constexpr int kVec = Vec;
  static constexpr int kElements = kHeadDim * BV / kDecodeThreads;
  static constexpr int kRuns = kElements / kVec;
  static constexpr int kThreadsC = VFirst ? kDecodeThreads * kVec / kHeadDim : BV / kVec;
  static constexpr int kThreadsK = kDecodeThreads / kThreadsC;
  static_assert(kRuns * kVec == kElements && kThreadsC * kThreadsK == kDecodeThreads, "ownership");
  static_assert(VFirst ? kThreadsC * kRuns == BV && kThreadsK <= 32 : kThreadsK * kRuns == kHeadDim && kThreadsC <= 32,
                "ownership covers the slice");
  int tk, tc;
  __device__ explicit Ownership(int tid)
      : tk(VFirst ? tid % kThreadsK : tid / kThreadsC), tc(VFirst ? tid / kThreadsK : tid % kThreadsC) {}
  // Run r's offset from the head's state origin ([128, 128] per head in either layout), and
  // within the slice as shared memory holds it ([128, BV] or [BV, 128]).
  __device__ int64_t offset(int r, int v0) const {
    return VFirst ? int64_t(v0 + tc + kThreadsC * r) * kHeadDim + tk * kVec
                  : int64_t(tk + kThreadsK * r) * kHeadDim + v0 + tc * kVec;
  }
  __device__ int shared(int r) const {
    return VFirst ? (tc + kThreadsC * r) * kHeadDim + tk * kVec : (tk + kThreadsK * r) * BV + tc * kVec;
  }
};

// Shared memory of a CTA (decode_slice's arrays) and the CTAs an SM then holds (228 KB, 1 KB of
// it reserved per CTA), at most 10 for [K, V] states and 4 to 6 for [V, K] ones (whose sums over
// K take more registers): past that the register budget spills (ptxas, nvcc 13.0, 2026-12-02).
// The entry points declare it, so that registers never hold fewer CTAs than shared memory.
// With the per-token buffers single (2026-12-02): float32 64 columns 6 CTAs (78 registers; [V, K]
// 5, as before), bf16 64 columns 10; that took bf16 states from 0.69 to 0.79 of the copy
// bandwidth at N=256 (H200, run 36, benchmarks/NOTES.md). Whole heads (128 columns, 2026-12-02):
// bf16 [K, V] 5 CTAs (95 registers), float32 [K, V] 3; bf16 runs there (run 39: 0.92 of the copy
// bandwidth at N=1024 against 0.87 at 64 columns), float32 stays at 64. Six bf16 whole-head
// CTAs an SM (their partial sums laid over the dead pass-1 vectors, 37,888 B, e506c6c) ran as
// five did on an H100 (run 170) and on the H200 (run 192, 2026-12-06, graph ms of two rounds:
// pools N=256 0.1430 / 0.1430 against five's 0.1433 / 0.1430, plain 0.1396 / 0.1394 against
// 0.1394 / 0.1383), so that layout went again (benchmarks/NOTES.md).
template <typename E, int BV>
constexpr int decode_shared_bytes() {
  return kHeadDim * BV * sizeof(E) + 16 * kHeadDim + 4 * (kDecodeWarps * 3 + kDecodeWarps * 2 * BV) + 8;
}
template <typename E, bool VFirst, int BV>
constexpr int decode_ctas_per_sm() {
  const int ctas = (228 * 1024) / (decode_shared_bytes<E, BV>() + 1024);
  // [V, K] 64 columns: five (float32: 91 registers unbounded, at six it spilled 16 B; bf16 with
  // the bulk staging spilled 28 B at six, 2026-12-03); [V, K] 128 columns: four (bf16 spilled
  // 20 B at five; float32 holds three by its shared memory)
  // [K, V] bf16 32 columns: nine with the passes unrolled (2026-12-03; it spilled 4 B at ten),
  // then eight below. With the first token's inputs loaded before the staging (2026-12-03):
  // [K, V] float32 32 columns nine (32 B spilled at ten), bf16 32 and 64 columns eight (8 and
  // 20 B at nine), [V, K] bf16 64 columns four (16 B at five)
  const int most = !VFirst ? (sizeof(E) == 2 ? (BV == 128 ? 10 : 8) : BV == 32 ? 9 : 10)
                           : BV == 128 ? 4 : BV == 64 ? (sizeof(E) == 2 ? 4 : 5) : 6;
  return ctas < most ? ctas : most;
}

// A run of state, as E, stored as O: one store, or (a bf16 state written back in float32: a
// plain call's default final state) the run's values as float32 runs, one or two.
template <typename E, typename O, int Vec>
__device__ __forceinline__ void store_run(O* dst, const float (&x)[Vec]) {
  if constexpr (std::is_same_v<E, O>) {
    *reinterpret_cast<typename Run<E, Vec>::Raw*>(dst) = Run<E, Vec>::pack(x);
  } else {
    constexpr int kOut = Run<float>::kVec;
    static_assert(std::is_same_v<O, float> && Vec % kOut == 0, "bf16 -> float32 only");
#pragma unroll
    for (int h = 0; h < Vec / kOut; ++h) {
      float part[kOut];
#pragma unroll
      for (int e = 0; e < kOut; ++e) part[e] = x[h * kOut + e];
      reinterpret_cast<uint4*>(dst)[h] = Run<float>::pack(part);
    }
  }
}

// E: the state read (and kept in shared memory between tokens); O: the state written (E, or
// float32 for a bf16 state: fla's plain calls and kda's by default return float32 final states,
// which until 2026-12-07 sent every bf16 plain call to Triton's decode kernel).
template <typename E, typename O, bool VFirst, int BV>
__device__ __forceinline__ void decode_slice(const DecodeParams& p) {
  constexpr int kRunVec = run_vec<E, O, VFirst>();
  using Own = Ownership<E, VFirst, BV, kRunVec>;
  using R = Run<E, kRunVec>;
  using Raw = typename R::Raw;
  constexpr int kVec = Own::kVec, kRuns = Own::kRuns, kThreadsC = Own::kThreadsC, kThreadsK = Own::kThreadsK;
  constexpr int kColumns = VFirst ? kRuns : kVec;  // the columns a thread owns
  constexpr int kSlices = kHeadDim / BV;
  constexpr int64_t kHeadElements = int64_t(kHeadDim) * kHeadDim;
  constexpr int kTileBytes = kHeadDim * BV * int(sizeof(E));  // the slice, one copy's worth
  __shared__ alignas(16) E tile[kHeadDim * BV];  // the slice, as stored in memory
  // The token's per-K vectors (d, k, d k, d q) and sums, one buffer: a CTA barrier ends each
  // token that another follows, before the next prologue overwrites them. (Buffers by token
  // parity spared that barrier, but their 4 KB more of shared memory held five float32
  // 64-column CTAs an SM instead of six.)
  __shared__ float4 s_vec[kHeadDim];
  __shared__ float s_sums[kDecodeWarps][3];
  __shared__ alignas(16) float s_partial[kDecodeWarps][2][BV];  // [K, V] states: per-warp sums over K
  static_assert(sizeof(tile) + sizeof(s_vec) + sizeof(s_sums) + sizeof(s_partial) + sizeof(uint64_t) ==
                    decode_shared_bytes<E, BV>(),
                "decode_shared_bytes counts every array (and the staging barrier)");

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const Own own(tid);
#if KDA_DECODE_TRACE
  const int64_t trace_ns0 = global_ns(), trace_c0 = clock64();
  int64_t trace_c[4] = {};
#endif
  __shared__ uint64_t staged_bar;  // the staging copy's mbarrier (below)
  const int i_v = blockIdx.x % kSlices, v0 = i_v * BV;
  // The CTA's (sequence, value head, key head) by 32-bit divisions: the grid is under 2^31 CTAs
  // (loader.launch) and the head counts are small. A 64-bit division is a 98-instruction
  // subroutine, and three of them, one after another, stood between a CTA's start and its slot
  // index load and state copy (cuobjdump of kda_decode_bf16_kv_c128, 2026-12-04). Float32 [V, K]
  // slices of 64 columns keep them: with the 32-bit ones ptxas spilled 76 B in the token loop at
  // their five CTAs an SM (nvcc 13.0, 2026-12-04).
  constexpr bool kDivide64 = VFirst && sizeof(E) == 4 && BV == 64;
  const int64_t HV = p.value_heads;
  int64_t n, i_hv, i_h;
  if constexpr (kDivide64) {
    const int64_t pair = blockIdx.x / kSlices;
    n = pair / HV;
    i_hv = pair % HV;
    i_h = i_hv / (HV / p.heads);
  } else {
    const uint32_t pair = blockIdx.x / kSlices, heads_v = uint32_t(HV), n32 = pair / heads_v;
    const uint32_t i_hv32 = pair - n32 * heads_v;
    n = n32;
    i_hv = i_hv32;
    i_h = i_hv32 / (heads_v / uint32_t(p.heads));
  }
  const int64_t flags = p.flags, mode = p.index_mode, cols = p.index_cols, T = p.tokens;
  const bool idx64 = flags & kIndicesInt64;

  int64_t bos, eos;
  if (flags & kVarlen) {  // clamped into [0, T] (offsets unchecked on the host stay in bounds)
    bos = min(max(p.seq_offsets[n], int64_t(0)), T);
    eos = min(max(p.seq_offsets[n + 1], bos), T);
    if (mode == 2) eos = min(eos, bos + cols);  // and no token past the row of indices
  } else {
    bos = n * T;
    eos = bos + T;
  }
  int64_t first = n;
  if (mode == 1) {
    first = load_index(p.indices, n, idx64);
  } else if (mode == 2) {
    int64_t col = 0;
    if (p.accepted != nullptr)  // clamped into the row: an accepted count outside [1, S] reads no other row
      col = min(max(load_index(p.accepted, n, flags & kAcceptedInt64) - 1, int64_t(0)), cols - 1);
    first = load_index(p.indices, n * cols + col, idx64);
  }
  const int64_t slot_elements = HV * kHeadElements;
  const int64_t head_origin = i_hv * kHeadElements;
  const auto in_pool = [&](int64_t slot) { return slot >= 0 && slot < p.pool_slots; };
  // Piece i of the slice (BV values; see the staging below), from the head's state origin.
  const auto piece_offset = [&](int i) {
    return VFirst ? int64_t(v0) * kHeadDim + i * BV : int64_t(i) * kHeadDim + v0;
  };

  // A token's inputs at the thread's K index, as stored: q, k, g, and beta, their bits held
  // unconverted (a bf16 value in the low half) until the token loop uses them.
  struct TokenInputs {
    uint32_t q, k, g, beta;
    __device__ float value(uint32_t bits, bool is_float32) const {
      return __uint_as_float(is_float32 ? bits : bits << 16);
    }
  };
  const auto load_bits = [](const void* base, int64_t i, bool is_float32) -> uint32_t {
    return is_float32 ? static_cast<const uint32_t*>(base)[i] : static_cast<const uint16_t*>(base)[i];
  };
  const auto load_token = [&](int64_t t) {
    TokenInputs in;
    const int64_t qk_at = (t * p.heads + i_h) * kHeadDim + tid, row = t * HV + i_hv;
    in.q = load_bits(p.q, qk_at, false);
    in.k = load_bits(p.k, qk_at, false);
    in.g = load_bits(p.g, row * kHeadDim + tid, flags & kGFloat32);
    in.beta = load_bits(p.beta, row, flags & kBetaFloat32);
    return in;
  };
  // The first token's inputs are loaded before the staging, so that their latency overlaps the
  // slot index's and the copy's (run 55, 2026-12-03, bf16 whole heads: N=32 0.0293 -> 0.0256 ms,
  // N=256 0.1431 -> 0.1405; run 56: float32 64 columns N=32 0.0411 -> 0.0398, pools 0.0428 ->
  // 0.0412; at 32 and 64 columns it spilled until decode_ctas_per_sm held fewer CTAs an SM). They
  // stay unconverted until the token loop: converted where they were loaded, they held the bulk
  // copy's issue back by a global load's latency, 2.8 us of a CTA's 9.6 (run 62's trace, bf16
  // whole heads at N=256, benchmarks/NOTES.md).
  const TokenInputs first_inputs = bos < eos ? load_token(bos) : TokenInputs{};
  // Stage the slice (zeros without an initial state or a slot) through the bulk-copy unit onto
  // one mbarrier: a contiguous slice ([V, K], or a whole [K, V] head) in one copy, a [K, V]
  // slice of BV < 128 columns as 128 rows, a copy a thread (which the compiler issues one lane
  // at a time: a bulk copy takes its addresses in uniform registers). On the H200 (run 52,
  // benchmarks/NOTES.md, 2026-12-03) the row copies took fp32 N=32 from 0.0416 to 0.0402 ms and
  // bf16 N=256 at 64 columns from 0.1590 to 0.1476 against 16-byte cp.async copies a thread (15
  // instructions a run on the L1 pipe); run 53: one copy of a whole bf16 head 0.1589 -> 0.1485
  // against row copies.
  const bool read = (flags & kHasH0) && in_pool(first);  // (CTA-uniform)
  if (read) {
    if (tid == 0) {
      // (Initialised at the CTA's start instead, before any global load, the copy was issued
      // 1417 cycles into a bf16 N=256 CTA against 1581, 2850 against 3137 in a pool, and the
      // graph time did not move: H100, run 146, 2026-12-05. The pool's later copy waits for its
      // slot index, a DRAM round trip, not for the fence.)
      cute::initialize_barrier(staged_bar, 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      cute::set_barrier_transaction_bytes(staged_bar, kTileBytes);
    }
    const E* src = static_cast<const E*>(p.h0) + first * slot_elements + head_origin;
    if constexpr (VFirst || BV == kHeadDim) {  // a contiguous slice: one copy
      if (tid == 0) cute::SM90_BULK_COPY_G2S::copy(src + piece_offset(0), &staged_bar, tile, kTileBytes);
      __syncthreads();  // initialised before any thread waits on it
    } else {
      __syncthreads();  // initialised, and the byte count posted, before any piece is issued
      cute::SM90_BULK_COPY_G2S::copy(src + piece_offset(tid), &staged_bar, tile + tid * BV, BV * int(sizeof(E)));
    }
  } else {
#pragma unroll 1
    for (int r = 0; r < kRuns; ++r) *reinterpret_cast<Raw*>(tile + own.shared(r)) = Raw{};
  }
#if KDA_DECODE_TRACE
  trace_c[0] = clock64() - trace_c0;
#endif
  // (a thread reads other threads' pieces: every thread waits on the barrier; the zeros are
  // each thread's own runs, all it reads before the first CTA barrier)
  const auto wait_staged = [&] {
    if (read) mbarrier_wait(staged_bar, 0);
  };
  const auto run = [&](int r) { return *reinterpret_cast<const Raw*>(tile + own.shared(r)); };
  const auto destination = [&](int64_t slot) {
    return in_pool(slot) ? static_cast<O*>(p.ht) + slot * slot_elements + head_origin : nullptr;
  };
  // Column j of the thread's own: [K, V] states tc kVec + j, [V, K] states tc + kThreadsC j.
  const auto column = [&](int j) { return v0 + (VFirst ? own.tc + kThreadsC * j : own.tc * kVec + j); };
  const bool writes_o = own.tk == 0;  // one thread of each column writes its output

  const bool gate_lower_bound = flags & kGateLowerBound;
  const float gate_mul = (gate_lower_bound && (flags & kHasALog)) ? expf(p.A_log[i_hv]) : 1.f;
  const float bias = (gate_lower_bound && (flags & kHasDtBias)) ? p.dt_bias[i_hv * kHeadDim + tid] : 0.f;
  const float lower_bound = static_cast<float>(p.lower_bound), scale = static_cast<float>(p.scale);
  const float beta_scale = static_cast<float>(p.beta_scale);
  const bool store_ht = mode != 2 && (flags & kStoreHt);
  bool staged = false;
  for (int64_t t = bos; t < eos; ++t) {
    // Prologue: thread tid holds K index tid of q, k and the decay.
    const int64_t row = t * HV + i_hv;
    const TokenInputs in = t == bos ? first_inputs : load_token(t);
    const float qv = in.value(in.q, false), kv = in.value(in.k, false);
    float gv = in.value(in.g, flags & kGFloat32), beta = in.value(in.beta, flags & kBetaFloat32);
    if (gate_lower_bound) gv = sigmoid_scaled(lower_bound, gate_mul * (gv + bias));
    if (flags & kBetaSigmoid) beta = sigmoid_scaled(beta_scale, beta);
    float vc[kColumns];
    if constexpr (VFirst) {
#pragma unroll
      for (int j = 0; j < kColumns; ++j) vc[j] = __bfloat162float(p.v[row * kHeadDim + column(j)]);
    } else {  // the thread's columns are adjacent: one 16- or 8-byte load (v is 16-byte aligned: kda.cuda.misaligned)
      const auto raw = *reinterpret_cast<const BfloatRun<kColumns>*>(p.v + row * kHeadDim + column(0));
#pragma unroll
      for (int j = 0; j < kColumns; ++j) vc[j] = __bfloat162float(raw.x[j]);
    }
    const int64_t to = mode == 2 ? load_index(p.indices, n * cols + (t - bos), idx64) : 0;
    float sums[3] = {qv * qv, kv * kv, qv * kv};
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      for (int j = 0; j < 3; ++j) sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], offset);
    if (lane == 0)
      for (int j = 0; j < 3; ++j) s_sums[warp][j] = sums[j];
    const float d = exp2_approx(gv * kLog2e);  // g = -inf: exactly 0 (a hard reset)
    s_vec[tid] = make_float4(d, kv, d * kv, d * qv);
    if (!staged) {
      wait_staged();
      staged = true;
#if KDA_DECODE_TRACE
      trace_c[1] = clock64() - trace_c0;
#endif
    }
    __syncthreads();
    float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      qq += s_sums[w][0];
      kk += s_sums[w][1];
      qk += s_sums[w][2];
    }
    float rq = 1.f, rk = 1.f;
    if (flags & kL2norm) {
      rq = rsqrtf(qq + kL2normEps);
      rk = rsqrtf(kk + kL2normEps);
    }

    // Pass 1: (S d).k and (S d).q of each owned column, over the thread's K indices, then
    // over the threads that share the column.
    float dot_k[kColumns] = {}, dot_q[kColumns] = {};
    if constexpr (VFirst) {
      float2 dkq[kVec];  // (d k, d q) of the thread's K indices
#pragma unroll
      for (int e = 0; e < kVec; ++e) dkq[e] = reinterpret_cast<const float2*>(&s_vec[own.tk * kVec + e])[1];
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        float x[kVec];
        R::unpack(run(r), x);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          dot_k[r] = fmaf(x[e], dkq[e].x, dot_k[r]);
          dot_q[r] = fmaf(x[e], dkq[e].y, dot_q[r]);
        }
      }
#pragma unroll
      for (int offset = 1; offset < kThreadsK; offset *= 2)  // the column's threads: lanes tk of one warp
        for (int j = 0; j < kColumns; ++j) {
          dot_k[j] += __shfl_xor_sync(0xffffffffu, dot_k[j], offset);
          dot_q[j] += __shfl_xor_sync(0xffffffffu, dot_q[j], offset);
        }
    } else {
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        const float4 vec = s_vec[own.tk + kThreadsK * r];
        float x[kVec];
        R::unpack(run(r), x);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          dot_k[e] = fmaf(x[e], vec.z, dot_k[e]);
          dot_q[e] = fmaf(x[e], vec.w, dot_q[e]);
        }
      }
#pragma unroll
      for (int offset = kThreadsC; offset < 32; offset *= 2)  // the column's threads in this warp
        for (int j = 0; j < kColumns; ++j) {
          dot_k[j] += __shfl_xor_sync(0xffffffffu, dot_k[j], offset);
          dot_q[j] += __shfl_xor_sync(0xffffffffu, dot_q[j], offset);
        }
      if (lane < kThreadsC)  // then over the warps
        for (int j = 0; j < kColumns; ++j) {
          s_partial[warp][0][own.tc * kVec + j] = dot_k[j];
          s_partial[warp][1][own.tc * kVec + j] = dot_q[j];
        }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        dot_k[j] = s_partial[0][0][own.tc * kVec + j];
        dot_q[j] = s_partial[0][1][own.tc * kVec + j];
#pragma unroll
        for (int w = 1; w < kDecodeWarps; ++w) {
          dot_k[j] += s_partial[w][0][own.tc * kVec + j];
          dot_q[j] += s_partial[w][1][own.tc * kVec + j];
        }
      }
    }
#if KDA_DECODE_TRACE
    trace_c[2] = clock64() - trace_c0;
#endif
    // With k^ = rk k and q^ = rq q: u = beta (v - (S d)^T k^), o = scale ((S d)^T q^ + u k^.q^),
    // and the new state S d + k^ u^T = S d + k (rk u)^T.
    float u_k[kColumns];
    BfloatRun<kColumns> o_run;  // [K, V] states: the thread's outputs, adjacent, stored at once
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const float u = beta * (vc[j] - dot_k[j] * rk);
      const __nv_bfloat16 o_j = __float2bfloat16_rn(scale * (dot_q[j] * rq + u * (qk * rq * rk)));
      if constexpr (VFirst) {
        if (writes_o) p.o[row * kHeadDim + column(j)] = o_j;
      } else {
        o_run.x[j] = o_j;
      }
      u_k[j] = u * rk;
    }
    if constexpr (!VFirst)
      if (writes_o) *reinterpret_cast<BfloatRun<kColumns>*>(p.o + row * kHeadDim + column(0)) = o_run;

    // Pass 2: the new state, back into shared memory for the next token, and to memory where
    // this token's state is stored (every token's with 2-D indices, else the last one's).
    const bool last = t + 1 == eos;
    O* dst = destination(mode == 2 ? to : store_ht && last ? first : -1);
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      float x[kVec];
      R::unpack(run(r), x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        // (d, k) of the element's K index
        const float2 dk = *reinterpret_cast<const float2*>(&s_vec[VFirst ? own.tk * kVec + e : own.tk + kThreadsK * r]);
        x[e] = fmaf(dk.y, u_k[VFirst ? r : e], x[e] * dk.x);
      }
      if (!last) *reinterpret_cast<Raw*>(tile + own.shared(r)) = R::pack(x);
      if (dst != nullptr) store_run<E>(dst + own.offset(r, v0), x);
    }
    if (!last) __syncthreads();  // every thread is done with s_vec and s_sums (uniform: t and eos are the CTA's)
  }
  // No tokens: the state passes through to a new final state; a pool slot (h0 == ht) keeps its
  // state unwritten, so a slot shared with a sequence that has tokens is that sequence's alone.
  // Either way the staging copy is waited for: no CTA leaves with a bulk copy still writing
  // into its shared memory (the token loop waits at its first token).
#if KDA_DECODE_TRACE
  trace_c[3] = clock64() - trace_c0;
  const int64_t trace_ns1 = global_ns();
  __syncthreads();
  if (tid == 0 && bos < eos) {
    uint32_t sm;
    asm("mov.u32 %0, %%smid;" : "=r"(sm));
    int64_t* at = reinterpret_cast<int64_t*>(p.o + (bos * HV + i_hv) * kHeadDim);
    at[0] = trace_ns0;
    at[1] = trace_ns1;
    for (int i = 0; i < 4; ++i) at[2 + i] = trace_c[i];
    at[6] = sm;
    at[7] = i_v;
  }
#endif
  if (bos == eos) wait_staged();
  if (bos == eos && store_ht && p.h0 != p.ht) {
    O* dst = destination(first);
    if (dst != nullptr)
#pragma unroll 1
      for (int r = 0; r < kRuns; ++r) {
        if constexpr (std::is_same_v<E, O>) {  // the bits as read
          *reinterpret_cast<Raw*>(dst + own.offset(r, v0)) = run(r);
        } else {
          float x[kVec];
          R::unpack(run(r), x);
          store_run<E>(dst + own.offset(r, v0), x);
        }
      }
  }
}

}  // namespace

#define KDA_DECODE_ENTRY(NAME, E, O, VFIRST, BV)                                          \
  extern "C" __global__ void __launch_bounds__(kDecodeThreads, (decode_ctas_per_sm<E, VFIRST, BV>())) \
      NAME(const DecodeParams p) {                                                         \
    decode_slice<E, O, VFIRST, BV>(p);                                                     \
  }

// Names: abi.decode_kernel_name (state dtype, "_to_f32" where a bf16 state is written back in
// float32, layout: kv = [K, V], vk = [V, K], columns).
KDA_DECODE_ENTRY(kda_decode_f32_kv_c32, float, float, false, 32)
KDA_DECODE_ENTRY(kda_decode_f32_kv_c64, float, float, false, 64)
KDA_DECODE_ENTRY(kda_decode_f32_vk_c32, float, float, true, 32)
KDA_DECODE_ENTRY(kda_decode_f32_vk_c64, float, float, true, 64)
KDA_DECODE_ENTRY(kda_decode_f32_kv_c128, float, float, false, 128)
KDA_DECODE_ENTRY(kda_decode_f32_vk_c128, float, float, true, 128)
KDA_DECODE_ENTRY(kda_decode_bf16_kv_c32, __nv_bfloat16, __nv_bfloat16, false, 32)
KDA_DECODE_ENTRY(kda_decode_bf16_kv_c64, __nv_bfloat16, __nv_bfloat16, false, 64)
KDA_DECODE_ENTRY(kda_decode_bf16_vk_c32, __nv_bfloat16, __nv_bfloat16, true, 32)
KDA_DECODE_ENTRY(kda_decode_bf16_vk_c64, __nv_bfloat16, __nv_bfloat16, true, 64)
KDA_DECODE_ENTRY(kda_decode_bf16_kv_c128, __nv_bfloat16, __nv_bfloat16, false, 128)
KDA_DECODE_ENTRY(kda_decode_bf16_vk_c128, __nv_bfloat16, __nv_bfloat16, true, 128)
KDA_DECODE_ENTRY(kda_decode_bf16_to_f32_kv_c32, __nv_bfloat16, float, false, 32)
KDA_DECODE_ENTRY(kda_decode_bf16_to_f32_kv_c64, __nv_bfloat16, float, false, 64)
KDA_DECODE_ENTRY(kda_decode_bf16_to_f32_kv_c128, __nv_bfloat16, float, false, 128)
KDA_DECODE_ENTRY(kda_decode_bf16_to_f32_vk_c32, __nv_bfloat16, float, true, 32)
KDA_DECODE_ENTRY(kda_decode_bf16_to_f32_vk_c64, __nv_bfloat16, float, true, 64)
KDA_DECODE_ENTRY(kda_decode_bf16_to_f32_vk_c128, __nv_bfloat16, float, true, 128)

}  // namespace kda
