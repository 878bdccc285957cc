// Shared definitions of the two Hopper kernels (prepare.cu, recurrence.cu): the tile layout of
// the workspace between them and the warp-level tensor-core and copy helpers, which are CuTe's
// atoms (SM80 mma.sync and cp.async, SM75 ldmatrix, SM90 bulk copies with transaction-count
// mbarriers). The parameter block, its flags, the workspace layout and the constants Python
// shares come from kda_abi.h, which the build generates from src/kda/abi.py.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "kda_abi.h"

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm80.hpp>

// CuTe compiles its bulk (TMA) copies for sm_90 and for the arch-specific Blackwell targets
// (sm_100a, ...); for a plain sm_100 they become traps at run time. Fail the build instead of
// shipping kernels that trap.
#if defined(__CUDA_ARCH__) && !defined(CUTE_ARCH_TMA_SM90_ENABLED)
#error "kda: CuTe's bulk (TMA) copies are disabled for this target: build for an arch-specific target (KDA_CUDA_ARCHS=90a or 100a), not a plain sm_XY"
#endif

namespace kda {

constexpr float kLog2e = 1.4426950408889634f;

// Workspace of one (chunk, head) (kda_abi.h WorkspaceLayout), written by prepare and read once
// by the recurrence, which copies the whole block into shared memory with one bulk (TMA) copy.
// The [16, 128] tiles are therefore stored already swizzled for its ldmatrix reads (tile_offset).
static_assert(kWorkspaceBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

// Byte offset of element (row, col) of a [16, 128] bf16 tile as stored: the 16-byte piece
// col / 8 of row `row` sits at piece (col / 8) ^ (row % 8), so the eight rows an ldmatrix
// reads at one piece index land in eight different bank groups.
__host__ __device__ constexpr int tile_offset(int row, int col) {
  return row * kHeadDim * 2 + ((((col / 8) ^ (row % 8))) << 4) + (col % 8) * 2;
}

// ---- warp-level helpers ---------------------------------------------------------------

// D = A B + C on one m16n8k16 tile, bf16 operands, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1],
                                            d[2], d[3]);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two accumulator tiles (columns 8j..8j+7 and 8j+8..8j+15 of a 16-row block) are, element
// for element, the left operand of the next MMA over those 16 columns: no data movement.
__device__ __forceinline__ void accumulators_to_operand(uint32_t (&a)[4], const float (&c0)[4],
                                                        const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}

// CuTe's SM90_U16x8_STSM_T with a "memory" clobber: its asm names no memory operand, so the
// compiler could otherwise move the plain loads that read the stored tile back above it.
__device__ __forceinline__ void stmatrix_x4_trans(void* smem, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   cute::cast_smem_ptr_to_uint(smem)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// 2^x and x / y in one or two SFU instructions (relative error ~2^-22; subnormal results
// flush to zero, far below anything a bf16 output can show).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float sigmoid_scaled(float scale, float x) {
  return __fdividef(scale, 1.f + exp2_approx(-x * kLog2e));
}

// A B accumulated on one m16n8k8 tile in "3xTF32": each float operand x is split into
// hi = x with its low 13 mantissa bits cleared (exactly a tf32 value) and lo = x - hi
// (exact in float32; the tensor core reads its top 19 bits), and the three largest partial
// products are summed: close to float32 accuracy on the tensor cores. (cvt.rna.tf32 is
// emulated with five integer instructions on sm_90; the mask is one.) The three products
// go to three accumulators, summed by the caller small ones first, so they do not queue.
struct Tf32x3Accumulators {
  float hi[4] = {}, lo_a[4] = {}, lo_b[4] = {};
  __device__ __forceinline__ float sum(int e) const { return (lo_a[e] + lo_b[e]) + hi[e]; }
};

__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// The three products (a_lo b_hi, a_hi b_lo, a_hi b_hi, in that order) into three accumulators,
// which may be one and the same.
__device__ __forceinline__ void mma_3xtf32(float (&lo_a)[4], float (&lo_b)[4], float (&hi)[4], const float (&a)[4],
                                           const float (&b)[2]) {
  uint32_t a_hi[4], a_lo[4], b_hi[2], b_lo[2];
  for (int e = 0; e < 4; ++e) split_tf32(a[e], a_hi[e], a_lo[e]);
  for (int e = 0; e < 2; ++e) split_tf32(b[e], b_hi[e], b_lo[e]);
  using Tf32 = cute::SM80_16x8x8_F32TF32TF32F32_TN;
  Tf32::fma(lo_a[0], lo_a[1], lo_a[2], lo_a[3], a_lo[0], a_lo[1], a_lo[2], a_lo[3], b_hi[0], b_hi[1], lo_a[0], lo_a[1],
            lo_a[2], lo_a[3]);
  Tf32::fma(lo_b[0], lo_b[1], lo_b[2], lo_b[3], a_hi[0], a_hi[1], a_hi[2], a_hi[3], b_lo[0], b_lo[1], lo_b[0], lo_b[1],
            lo_b[2], lo_b[3]);
  Tf32::fma(hi[0], hi[1], hi[2], hi[3], a_hi[0], a_hi[1], a_hi[2], a_hi[3], b_hi[0], b_hi[1], hi[0], hi[1], hi[2],
            hi[3]);
}

__device__ __forceinline__ void mma_3xtf32(Tf32x3Accumulators& d, const float (&a)[4], const float (&b)[2]) {
  mma_3xtf32(d.lo_a, d.lo_b, d.hi, a, b);
}

// mbarrier wait (on a phase parity) and arrive, as CuTe's wait_barrier / arrive_barrier but
// with "memory" clobbers: the plain shared-memory loads of a stage must not be moved by the
// compiler above the wait that makes the stage valid, nor below the arrive that frees it.
__device__ __forceinline__ void mbarrier_wait(uint64_t& barrier, int phase) {
  const uint32_t address = cute::cast_smem_ptr_to_uint(&barrier);
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra WAIT;\n"
      "}\n" ::"r"(address),
      "r"(phase)
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t& barrier) {
  const uint32_t address = cute::cast_smem_ptr_to_uint(&barrier);
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(address) : "memory");
}

// An arrival on `barrier` once every cp.async this thread issued before it has landed
// (CUTLASS's cpasync_barrier_arrive_noinc, with a "memory" clobber as above): the arrival is
// one of those the barrier was initialised to expect, so the phase cannot complete without
// the copies' bytes, which are then visible to the threads that waited on it.
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t& barrier) {
  const uint32_t address = cute::cast_smem_ptr_to_uint(&barrier);
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(address) : "memory");
}

// 16-byte global -> shared copy; zero-fills the destination when !valid.
__device__ __forceinline__ void copy_async_16(void* smem, const void* gmem, bool valid) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
      *reinterpret_cast<const cute::uint128_t*>(gmem), *reinterpret_cast<cute::uint128_t*>(smem), valid);
}

}  // namespace kda
