// K1, prepare: token-parallel, one CTA of 128 threads (4 warps) per (chunk, head).
//
// For its 16 tokens the CTA activates the inputs (gate, l2norm, beta sigmoid), takes the
// chunk-local cumulative log-decay G (base 2, anchored at the chunk start so no row depends
// on a later one), and writes the workspace of kda_cuda.cuh (kda-spec.md section 2;
// reference.prepare_chunk is the same computation in torch):
//
//   1. q, k, g rows -> shared memory (cp.async; rows past the sequence end zero-filled);
//      one thread per channel then owns that channel's 16 rows: gate, cumulative sum,
//      decayed operands, all in registers.
//   2. A = K~ K^-T and M = Q~ K^-T (16 x 16 over 128 channels) on the tensor cores, one
//      warp per (matrix, 8 columns), in 3xTF32: float32-level accuracy for ~100 MMAs.
//   3. inverse_beta = (I + A)^-1 Diag(beta) by forward substitution, one column per thread
//      of the first half warp, and
//   4. w = (I + A)^-1 Diag(beta) K~ the same way, (I + A) w = Diag(beta) K~, one channel
//      per thread in registers. Float32 throughout.
//
// Exponents: A and M need exp(G_i - G_j), j <= i. The fast form factors it as
// (k_i exp(G_i)) . (k_j exp(-G_j)), with exp(-G_j) clamped at 2^116 (the lower-bound gate,
// lb >= -5, never reaches it: |G| <= 80 / ln 2 over 16 tokens; a precomputed g may). Row i
// only needs j <= i, whose -G_j <= -G_i, so a row whose own decay stays inside the limit is
// exact in the factored form; a row past it is recomputed in the pairwise form, exact at any
// depth. The choice is made per row from that row's own G: a later token never changes how
// an earlier row is computed, which keeps strict causality bit for bit.
#include "kda_cuda.cuh"

namespace kda {
namespace {

constexpr int kThreads = 128;  // one per channel
// Row stride (floats) of the float32 operand tiles: 132 = 4 mod 32, so the (row g, column t)
// pattern of an MMA fragment load, g < 8, t < 4, hits 32 distinct banks.
constexpr int kPad = kHeadDim + 4;
constexpr int kRowPad = kChunk + 4;  // A's rows 16-byte aligned for float4 reads

struct __align__(16) PrepareShared {
  __nv_bfloat16 q[kChunk][kHeadDim];  // raw inputs as loaded
  __nv_bfloat16 k[kChunk][kHeadDim];
  union {                                // raw g as loaded, then G once every thread has read g
    float g32[kChunk][kHeadDim];
    __nv_bfloat16 g16[kChunk][kHeadDim];
    float G[kChunk][kPad];               // cumulative log2-decay (the pairwise rows read it)
  } g;
  float qd[kChunk][kPad];  // scale q exp(G): left operand of M
  float kd[kChunk][kPad];  // k exp(G): left operand of A
  float ki[kChunk][kPad];  // k exp(min(-G, limit)): right operand of A and M
  float A[kChunk][kRowPad];  // strictly lower, row i times beta_i
  float M[kChunk][kChunk + 1];
  float rq[kChunk], rk[kChunk], beta[kChunk];
  unsigned far_rows;  // bit i: row i's decay passes the limit
};

__device__ __forceinline__ float load_as_float(const void* base, int64_t index, bool is_f32) {
  return is_f32 ? static_cast<const float*>(base)[index]
                : __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
}

// x_i = b_i - sum_{l < i} A_il x_l for the 16 rows of one right-hand side, in place.
__device__ __forceinline__ void forward_substitute(float (&x)[kChunk], const float (*A)[kRowPad]) {
#pragma unroll
  for (int i = 1; i < kChunk; ++i) {
    float acc = x[i];
#pragma unroll
    for (int l0 = 0; l0 < kChunk; l0 += 4) {
      if (l0 >= i) break;
      const float4 a = *reinterpret_cast<const float4*>(&A[i][l0]);
      const float row[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int l = 0; l < 4; ++l)
        if (l0 + l < i) acc = fmaf(-row[l], x[l0 + l], acc);
    }
    x[i] = acc;
  }
}

// Rows g, g + 8 and columns c0 + t, c0 + t + 4 of X: the left operand of an m16n8k8 MMA.
template <int STRIDE>
__device__ __forceinline__ void left_fragment(float (&a)[4], const float (*X)[STRIDE], int c0, int g, int t) {
  a[0] = X[g][c0 + t];
  a[1] = X[g + 8][c0 + t];
  a[2] = X[g][c0 + t + 4];
  a[3] = X[g + 8][c0 + t + 4];
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 5) kda_prepare(const Params p) {
  __shared__ PrepareShared s;
  using WS = WorkspaceLayout;
  const int64_t c = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g_row = lane / 4, t_col = lane % 4;  // MMA fragment coordinates

  const int64_t n = p.chunk_seq[c];
  const int64_t bos = p.seq_offsets[n] + (c - p.chunk_offsets[n]) * kChunk;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kChunk), p.seq_offsets[n + 1] - bos));
  const bool g_f32 = p.flags & kGFloat32;
  unsigned char* ws = p.workspace + (c * p.heads + h) * kWorkspaceBytes;

  // 1. Inputs -> shared memory, 16-byte pieces. 64-bit offsets: T * H * 128 can pass 2^31.
  for (int piece = tid; piece < kChunk * 16; piece += kThreads) {
    const int r = piece / 16, col = (piece % 16) * 8;
    const bool valid = r < rows;
    const int64_t src = valid ? ((bos + r) * p.heads + h) * kHeadDim + col : 0;
    copy_async_16(&s.q[r][col], p.q + src, valid);
    copy_async_16(&s.k[r][col], p.k + src, valid);
  }
  const int g_pieces = g_f32 ? 32 : 16;  // per row
  for (int piece = tid; piece < kChunk * g_pieces; piece += kThreads) {
    const int r = piece / g_pieces, col = piece % g_pieces;
    const bool valid = r < rows;
    const int64_t row = valid ? ((bos + r) * p.heads + h) * kHeadDim : 0;
    const unsigned char* src = g_f32 ? reinterpret_cast<const unsigned char*>(static_cast<const float*>(p.g) + row)
                                     : reinterpret_cast<const unsigned char*>(static_cast<const __nv_bfloat16*>(p.g) + row);
    copy_async_16(reinterpret_cast<unsigned char*>(&s.g) + (r * g_pieces + col) * 16, src + col * 16, valid);
  }
  cute::cp_async_fence();
  if (tid < kChunk) {
    float b = tid < rows ? load_as_float(p.beta, (bos + tid) * p.heads + h, p.flags & kBetaFloat32) : 0.f;
    if ((p.flags & kBetaSigmoid) && tid < rows) b = sigmoid_scaled(static_cast<float>(p.beta_scale), b);
    s.beta[tid] = b;
    if (!(p.flags & kL2norm)) s.rq[tid] = s.rk[tid] = 1.f;
  }
  if (tid == 0) s.far_rows = 0;
  const int ch = tid;
  const bool lower_bound = p.flags & kGateLowerBound;
  const float gate_a = lower_bound && (p.flags & kHasALog) ? expf(p.A_log[h]) : 1.f;
  const float gate_bias = lower_bound && (p.flags & kHasDtBias) ? p.dt_bias[h * kHeadDim + ch] : 0.f;
  cute::cp_async_wait<0>();
  __syncthreads();

  // l2norm: 8 threads per row, 16 channels each.
  if (p.flags & kL2norm) {
    const int r = tid / 8, c0 = (tid % 8) * 16;
    float sq = 0.f, sk = 0.f;
    for (int half = 0; half < 16; half += 8) {
      const uint4 qraw = *reinterpret_cast<const uint4*>(&s.q[r][c0 + half]);
      const uint4 kraw = *reinterpret_cast<const uint4*>(&s.k[r][c0 + half]);
      const __nv_bfloat16* qv = reinterpret_cast<const __nv_bfloat16*>(&qraw);
      const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(&kraw);
      for (int x = 0; x < 8; ++x) {
        sq = fmaf(__bfloat162float(qv[x]), __bfloat162float(qv[x]), sq);
        sk = fmaf(__bfloat162float(kv[x]), __bfloat162float(kv[x]), sk);
      }
    }
    for (int offset = 4; offset > 0; offset >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, offset);
      sk += __shfl_xor_sync(0xffffffffu, sk, offset);
    }
    if (tid % 8 == 0) {
      s.rq[r] = rsqrtf(sq + kL2normEps);
      s.rk[r] = rsqrtf(sk + kL2normEps);
    }
  }
  // Gate and cumulative log2-decay of this thread's channel. Rows past the end add no decay.
  float G[kChunk];
  float acc = 0.f;
  for (int r = 0; r < kChunk; ++r) {
    float gv = g_f32 ? s.g.g32[r][ch] : __bfloat162float(s.g.g16[r][ch]);
    if (lower_bound) gv = sigmoid_scaled(static_cast<float>(p.lower_bound), gate_a * (gv + gate_bias));
    acc += (r < rows ? gv : 0.f) * kLog2e;
    G[r] = acc;
  }
  __syncthreads();  // every thread has read g and the row norms: G may replace g

  // Decayed operands: float32 tiles for the MMAs; q_decayed and k_restored to the workspace.
  const float scale = static_cast<float>(p.scale);
  // The lower-bound gate decays by at most |lb| a token: with lb >= -5.02 no row of 16 tokens
  // gets past the limit, and the per-row test is skipped.
  const bool may_be_far = !lower_bound || p.lower_bound * kChunk * kLog2e < -kExp2Limit;
  unsigned far = 0;
  for (int r = 0; r < kChunk; ++r) {
    s.g.G[r][ch] = G[r];
    const float qn = __bfloat162float(s.q[r][ch]) * s.rq[r], kn = __bfloat162float(s.k[r][ch]) * s.rk[r];
    const float decay = exp2_approx(G[r]);
    const float qd = scale * qn * decay;
    s.qd[r][ch] = qd;
    s.kd[r][ch] = kn * decay;
    s.ki[r][ch] = kn * exp2_approx(fminf(-G[r], kExp2Limit));
    *reinterpret_cast<__nv_bfloat16*>(ws + WS::q_decayed + tile_offset(r, ch)) = __float2bfloat16_rn(qd);
    *reinterpret_cast<__nv_bfloat16*>(ws + WS::k_restored + tile_offset(r, ch)) =
        __float2bfloat16_rn(kn * exp2_approx(G[kChunk - 1] - G[r]));
    if (may_be_far) far |= static_cast<unsigned>(G[r] < -kExp2Limit) << r;
  }
  reinterpret_cast<float*>(ws + WS::gamma)[ch] = exp2_approx(G[kChunk - 1]);
  if (may_be_far) {
    far = __reduce_or_sync(0xffffffffu, far);
    if (lane == 0 && far) atomicOr(&s.far_rows, far);
  }
  __syncthreads();

  // 2. A (warps 0, 1) and M (warps 2, 3), 8 columns j each, factored form.
  {
    const bool is_A = warp < 2;
    const int j0 = (warp % 2) * 8;
    Tf32x3Accumulators d[2];  // even and odd k-steps: two independent MMA chains
    for (int k0 = 0; k0 < kHeadDim; k0 += 8) {
      float a[4], b[2];
      left_fragment(a, is_A ? s.kd : s.qd, k0, g_row, t_col);
      b[0] = s.ki[j0 + g_row][k0 + t_col];
      b[1] = s.ki[j0 + g_row][k0 + t_col + 4];
      mma_3xtf32(d[(k0 / 8) % 2], a, b);
    }
    for (int e = 0; e < 4; ++e) {
      const int i = g_row + 8 * (e / 2), j = j0 + 2 * t_col + e % 2;
      const float value = d[0].sum(e) + d[1].sum(e);
      if (is_A)
        s.A[i][j] = j < i ? value * s.beta[i] : 0.f;
      else
        s.M[i][j] = j <= i ? value : 0.f;
    }
  }
  __syncthreads();
  const unsigned far_rows = s.far_rows;
  if (far_rows) {  // rows past the limit: exp(G_i - G_j) pairwise, exact at any depth
    for (int e = tid; e < kChunk * kChunk; e += kThreads) {
      const int i = e / kChunk, j = e % kChunk;
      if (!((far_rows >> i) & 1) || j > i) continue;
      float a = 0.f, m = 0.f;
      for (int d = 0; d < kHeadDim; ++d) {
        const float kj = __bfloat162float(s.k[j][d]) * s.rk[j] * exp2f(fminf(s.g.G[i][d] - s.g.G[j][d], 0.f));
        a = fmaf(__bfloat162float(s.k[i][d]), kj, a);
        m = fmaf(__bfloat162float(s.q[i][d]), kj, m);
      }
      s.A[i][j] = j < i ? a * s.rk[i] * s.beta[i] : 0.f;
      s.M[i][j] = m * s.rq[i] * scale;
    }
    __syncthreads();
  }
  for (int e = tid; e < kChunk * kChunk; e += kThreads)
    reinterpret_cast<__nv_bfloat16*>(ws + WS::M)[e] = __float2bfloat16_rn(s.M[e / kChunk][e % kChunk]);

  // 3. inverse_beta column j = (I + A)^-1 beta_j e_j, as a bf16 pair (hi + lo) for the recurrence.
  if (tid < kChunk) {
    const int j = tid;
    float ib[kChunk];
    for (int r = 0; r < kChunk; ++r) ib[r] = r == j ? s.beta[j] : 0.f;
    forward_substitute(ib, s.A);
    for (int r = 0; r < kChunk; ++r) {
      const __nv_bfloat16 hi = __float2bfloat16_rn(ib[r]);
      reinterpret_cast<__nv_bfloat16*>(ws + WS::inverse_beta_hi)[r * kChunk + j] = hi;
      reinterpret_cast<__nv_bfloat16*>(ws + WS::inverse_beta_lo)[r * kChunk + j] =
          __float2bfloat16_rn(ib[r] - __bfloat162float(hi));
    }
  }
  __syncwarp();  // keeps the two solves apart: interleaved, their registers spill
  // 4. w = (I + A)^-1 Diag(beta) K~ for this channel.
  float w[kChunk];
  for (int r = 0; r < kChunk; ++r) w[r] = s.beta[r] * s.kd[r][ch];
  forward_substitute(w, s.A);
  for (int r = 0; r < kChunk; ++r)
    *reinterpret_cast<__nv_bfloat16*>(ws + WS::w + tile_offset(r, ch)) = __float2bfloat16_rn(w[r]);
}

}  // namespace kda
