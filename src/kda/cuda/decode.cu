// The decode step on Hopper (spec section 7): one CTA per (sequence, value head, slice of BV
// V columns) runs the token loop of reference.pooled_recurrent_kda over its sequence's tokens,
//   S = S Diag(exp(g_t)),  u = beta_t (v_t - S^T k_t),  S += k_t u^T,  o_t = scale S^T q_t,
// with the state slice [128, BV] staged in shared memory, read once and written once.
//
// Why shared memory and not registers (the Triton kernel's way): a decode step is a copy of the
// states with a little arithmetic, and a copy is as fast as the bytes it keeps in flight. A
// slice held in registers costs four bytes of register file per state element for the whole
// life of the program, so an SM holds at most ~60 KB of bf16 states in flight that way. Here
// the slice arrives by cp.async (no registers while in flight), each thread then owns 32 or 64
// elements of it in shared memory, and registers hold only the token's sums: about ten 16 KB
// slices per SM are in flight. (benchmarks/NOTES.md, 2026-12-02, has the measurements.)
//
// Per token: a prologue gives each thread one K index (q, k, the gate and its decay; the sums
// q.q, k.k and q.k over K for the l2norm), then one pass over the thread's elements forms both
// sums over K, (S d).k and (S d).q, so that o needs no second pass after the update:
//   o = scale (S d + k u^T)^T q = scale ((S d)^T q + u (k.q)).
// A second pass writes S d + k u^T back. The state stays in its own dtype between tokens, so
// the host sends a bf16 state here only for one token a sequence (kda/cuda/decode.py).
//
// Slots (DecodeParams::index_mode): 0, sequence n is slot n (a plain call: h0 and ht are N
// states); 1, slot indices[n]; 2, indices[n, t] receives the state after token t and the first
// token reads indices[n, accepted[n] - 1]. A slot outside [0, pool_slots) is read as zeros and
// never written, so no index reaches memory outside the pool.
#include "kda_cuda.cuh"

namespace kda {
namespace {

constexpr int kDecodeWarps = kDecodeThreads / 32;
static_assert(kDecodeThreads == kHeadDim, "the token prologue gives each thread one K index");

__device__ __forceinline__ float load_float(const void* base, int64_t i, bool is_float32) {
  return is_float32 ? static_cast<const float*>(base)[i] : __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

__device__ __forceinline__ int64_t load_index(const void* base, int64_t i, bool is_int64) {
  return is_int64 ? static_cast<const int64_t*>(base)[i] : static_cast<int64_t>(static_cast<const int32_t*>(base)[i]);
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename E>
__device__ __forceinline__ E from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The slice of one (slot, head) and V columns [v0, v0 + BV), as stored in shared memory. The
// state is [K, V] (rows of BV elements) or, V first, [V, K] (rows of 128 elements, each padded
// by 16 bytes: the 16-byte reads of 32 rows by a warp then fall in distinct bank groups, as the
// row pitch is 16 modulo 128 bytes). A thread owns column c = tid % BV at K indices
// [k0, k0 + kSpan), k0 = (tid / BV) kSpan.
template <typename E, bool VFirst, int BV>
struct Slice {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(E));  // elements of a 16-byte piece
  static constexpr int kRows = VFirst ? BV : kHeadDim;
  static constexpr int kRowLength = VFirst ? kHeadDim : BV;
  static constexpr int kPitch = VFirst ? kHeadDim + kVec : BV;
  static constexpr int kRowPieces = kRowLength / kVec;
  static constexpr int kPieces = kRows * kRowPieces;
  static constexpr int kGroups = kDecodeThreads / BV;
  static constexpr int kSpan = kHeadDim / kGroups;
  static_assert(kHeadDim % BV == 0 && kDecodeThreads % BV == 0 && kSpan % kVec == 0, "slice shape");
  static_assert(kPieces % kDecodeThreads == 0, "every thread copies the same number of pieces");
  static_assert((kPitch * sizeof(E)) % 16 == 0, "rows start on 16-byte boundaries");

  __device__ static int shared_piece(int i) { return (i / kRowPieces) * kPitch + (i % kRowPieces) * kVec; }
  // Offset of piece i from the head's state origin (the state is [128, 128] per head either way).
  __device__ static int64_t global_piece(int i, int v0) {
    const int row = i / kRowPieces, col = (i % kRowPieces) * kVec;
    return VFirst ? int64_t(v0 + row) * kHeadDim + col : int64_t(row) * kHeadDim + v0 + col;
  }

  // Elements (k .. k + kVec - 1, c) in float32, and back.
  __device__ static void load(const E* tile, int k, int c, float (&x)[kVec]) {
    if constexpr (VFirst) {
      const uint4 raw = *reinterpret_cast<const uint4*>(tile + c * kPitch + k);
      const E* e = reinterpret_cast<const E*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = to_float(e[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = to_float(tile[(k + j) * kPitch + c]);
    }
  }
  __device__ static void store(E* tile, int k, int c, const float (&x)[kVec]) {
    if constexpr (VFirst) {
      uint4 raw;
      E* e = reinterpret_cast<E*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) e[j] = from_float<E>(x[j]);
      *reinterpret_cast<uint4*>(tile + c * kPitch + k) = raw;
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) tile[(k + j) * kPitch + c] = from_float<E>(x[j]);
    }
  }
};

// Shared memory of a CTA (decode_slice's arrays) and the CTAs an SM can then hold (228 KB, 1 KB
// of it reserved per CTA): the register budget the entry points declare keeps registers from
// holding fewer CTAs than shared memory allows. The loops over a thread's elements are not
// unrolled: unrolled, their loads in flight need registers past that budget (spills).
template <typename E, bool VFirst, int BV>
constexpr int decode_shared_bytes() {
  using S = Slice<E, VFirst, BV>;
  return S::kRows * S::kPitch * sizeof(E) + 4 * (3 * 2 * kHeadDim + 2 * kDecodeWarps * 3 + 2 * 2 * S::kGroups * BV);
}
template <typename E, bool VFirst, int BV>
constexpr int decode_ctas_per_sm() {
  // At most 10: past that the register budget (48 at 10) spills (ptxas, nvcc 13.0, 2026-12-02).
  const int ctas = (228 * 1024) / (decode_shared_bytes<E, VFirst, BV>() + 1024);
  return ctas < 10 ? ctas : 10;
}

template <typename E, bool VFirst, int BV>
__device__ __forceinline__ void decode_slice(const DecodeParams& p) {
  using S = Slice<E, VFirst, BV>;
  constexpr int kVec = S::kVec, kGroups = S::kGroups, kSpan = S::kSpan;
  constexpr int kSlices = kHeadDim / BV;
  constexpr int64_t kHeadElements = int64_t(kHeadDim) * kHeadDim;
  __shared__ alignas(16) E tile[S::kRows * S::kPitch];
  // The token's vectors and sums, double-buffered by token parity: the next token's prologue
  // may then write them while slower threads still read this token's.
  __shared__ float s_q[2][kHeadDim], s_k[2][kHeadDim], s_decay[2][kHeadDim];
  __shared__ float s_sums[2][kDecodeWarps][3];
  __shared__ float s_partial[2][2][kGroups][BV];
  static_assert(sizeof(tile) + sizeof(s_q) + sizeof(s_k) + sizeof(s_decay) + sizeof(s_sums) + sizeof(s_partial) ==
                    decode_shared_bytes<E, VFirst, BV>(),
                "decode_shared_bytes counts every array");

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int c = tid % BV, group = tid / BV, k0 = group * kSpan;
  const int i_v = blockIdx.x % kSlices, v0 = i_v * BV;
  const int64_t pair = blockIdx.x / kSlices;
  const int64_t HV = p.value_heads, n = pair / HV, i_hv = pair % HV, i_h = i_hv / (HV / p.heads);
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

  // Stage the slice (zeros without an initial state or a slot).
  {
    const bool read = (flags & kHasH0) && in_pool(first);
    const E* src = static_cast<const E*>(p.h0) + (read ? first * slot_elements + head_origin : 0);
#pragma unroll 1
    for (int i = tid; i < S::kPieces; i += kDecodeThreads)
      copy_async_16(tile + S::shared_piece(i), read ? src + S::global_piece(i, v0) : src, read);
    cute::cp_async_fence();
  }
  const auto store_slice = [&](int64_t slot) {
    if (!in_pool(slot)) return;
    E* dst = static_cast<E*>(p.ht) + slot * slot_elements + head_origin;
#pragma unroll 1
    for (int i = tid; i < S::kPieces; i += kDecodeThreads)
      *reinterpret_cast<uint4*>(dst + S::global_piece(i, v0)) = *reinterpret_cast<const uint4*>(tile + S::shared_piece(i));
  };

  const bool gate_lower_bound = flags & kGateLowerBound;
  const float gate_mul = (gate_lower_bound && (flags & kHasALog)) ? expf(p.A_log[i_hv]) : 1.f;
  const float bias = (gate_lower_bound && (flags & kHasDtBias)) ? p.dt_bias[i_hv * kHeadDim + tid] : 0.f;
  const float lower_bound = static_cast<float>(p.lower_bound), scale = static_cast<float>(p.scale);
  const float beta_scale = static_cast<float>(p.beta_scale);
  bool staged = false;
  int par = 0;
  for (int64_t t = bos; t < eos; ++t, par ^= 1) {
    // Prologue: thread tid holds K index tid of q, k and the decay.
    const int64_t qk_at = (t * p.heads + i_h) * kHeadDim + tid;
    const int64_t row = t * HV + i_hv;
    const float qv = __bfloat162float(p.q[qk_at]), kv = __bfloat162float(p.k[qk_at]);
    float gv = load_float(p.g, row * kHeadDim + tid, flags & kGFloat32);
    if (gate_lower_bound) gv = sigmoid_scaled(lower_bound, gate_mul * (gv + bias));
    float beta = load_float(p.beta, row, flags & kBetaFloat32);
    if (flags & kBetaSigmoid) beta = sigmoid_scaled(beta_scale, beta);
    const float vc = __bfloat162float(p.v[row * kHeadDim + v0 + c]);
    const int64_t to = mode == 2 ? load_index(p.indices, n * cols + (t - bos), idx64) : 0;
    float sums[3] = {qv * qv, kv * kv, qv * kv};
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      for (int j = 0; j < 3; ++j) sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], offset);
    if (lane == 0)
      for (int j = 0; j < 3; ++j) s_sums[par][warp][j] = sums[j];
    s_q[par][tid] = qv;
    s_k[par][tid] = kv;
    s_decay[par][tid] = exp2_approx(gv * kLog2e);  // g = -inf: exactly 0 (a hard reset)
    if (!staged) {
      cute::cp_async_wait<0>();
      staged = true;
    }
    __syncthreads();
    float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      qq += s_sums[par][w][0];
      kk += s_sums[par][w][1];
      qk += s_sums[par][w][2];
    }
    float rq = 1.f, rk = 1.f;
    if (flags & kL2norm) {
      rq = rsqrtf(qq + kL2normEps);
      rk = rsqrtf(kk + kL2normEps);
    }

    // Pass 1: (S d).k and (S d).q over the thread's K span, then over the groups.
    float dot_k = 0.f, dot_q = 0.f;
#pragma unroll 1
    for (int j = 0; j < kSpan; j += kVec) {
      float x[kVec];
      S::load(tile, k0 + j, c, x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int kk_at = k0 + j + e;
        const float s = x[e] * s_decay[par][kk_at];
        dot_k = fmaf(s, s_k[par][kk_at], dot_k);
        dot_q = fmaf(s, s_q[par][kk_at], dot_q);
      }
    }
    s_partial[par][0][group][c] = dot_k;
    s_partial[par][1][group][c] = dot_q;
    __syncthreads();
    dot_k = dot_q = 0.f;
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
      dot_k += s_partial[par][0][gi][c];
      dot_q += s_partial[par][1][gi][c];
    }
    // With k^ = rk k and q^ = rq q: u = beta (v - (S d)^T k^), o = scale ((S d)^T q^ + u k^.q^).
    const float u = beta * (vc - dot_k * rk);
    if (group == 0) p.o[row * kHeadDim + v0 + c] = __float2bfloat16_rn(scale * (dot_q * rq + u * (qk * rq * rk)));
    const float u_k = u * rk;  // S d + k^ u^T = S d + k (rk u)^T

    // Pass 2: the new state over the same elements.
#pragma unroll 1
    for (int j = 0; j < kSpan; j += kVec) {
      float x[kVec];
      S::load(tile, k0 + j, c, x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int kk_at = k0 + j + e;
        x[e] = fmaf(s_k[par][kk_at], u_k, x[e] * s_decay[par][kk_at]);
      }
      S::store(tile, k0 + j, c, x);
    }
    if (mode == 2) {  // the state after token t into indices[n, t - bos]
      __syncthreads();
      store_slice(to);
    }
  }
  if (!staged) cute::cp_async_wait<0>();
  if (mode != 2 && (flags & kStoreHt)) {
    __syncthreads();
    store_slice(first);
  }
}

}  // namespace

#define KDA_DECODE_ENTRY(NAME, E, VFIRST, BV) \
  extern "C" __global__ void __launch_bounds__(kDecodeThreads, (decode_ctas_per_sm<E, VFIRST, BV>())) \
      NAME(const DecodeParams p) {                                                                       \
    decode_slice<E, VFIRST, BV>(p);                                                                      \
  }

// Names: abi.decode_kernel_name (state dtype, layout: kv = [K, V], vk = [V, K], columns).
KDA_DECODE_ENTRY(kda_decode_f32_kv_c32, float, false, 32)
KDA_DECODE_ENTRY(kda_decode_f32_kv_c64, float, false, 64)
KDA_DECODE_ENTRY(kda_decode_f32_vk_c32, float, true, 32)
KDA_DECODE_ENTRY(kda_decode_f32_vk_c64, float, true, 64)
KDA_DECODE_ENTRY(kda_decode_bf16_kv_c32, __nv_bfloat16, false, 32)
KDA_DECODE_ENTRY(kda_decode_bf16_kv_c64, __nv_bfloat16, false, 64)
KDA_DECODE_ENTRY(kda_decode_bf16_vk_c32, __nv_bfloat16, true, 32)
KDA_DECODE_ENTRY(kda_decode_bf16_vk_c64, __nv_bfloat16, true, 64)

}  // namespace kda
