// gfx12_prelude.h: the only "runtime header" of the kernels. No HIP/CUDA/std headers are included,
// so the same text compiles with clang/hiprtc for gfx1200/gfx1201, with a CUDA compiler, and
// (SAGE_HOST_SIM) as plain C++ on the CPU with one OS thread per GPU thread.
//
// Three targets:
//   SG_AMD   clang AMDGPU device compile (__AMDGCN__): real gfx12 builtins (v_wmma_*, v_permlanex16,
//            ds_swizzle, v_perm_b32, v_cvt_pk_fp8_f32, v_exp_f32, v_dot2_f32_f16) and a few instructions
//            as inline asm where clang-19's builtin or plain C costs instructions in the key loop
//            (v_fma_mixlo/mixhi_f16, v_fma_f32, v_permlanex16, s_barrier_signal/wait; docs/MEASUREMENTS.md).
//   SG_CUDA  a CUDA compiler: a wave32 is one CUDA warp; every gfx12 WMMA builtin is EMULATED lane by
//            lane: each lane stores the fragment it holds in the gfx12 layout to shared memory, the
//            warp syncs, and each lane computes exactly the 8 accumulator elements gfx12 gives it.
//   SG_SIM   host C++ for CPU tests: same emulation, barriers from the simulator (kernels/verify/sim_runtime.h).
//
// gfx12 wave32 16x16x16 WMMA layout (lane t, r = t % 16, h = t / 16, element e = 0..7 of the lane's fragment):
//   A (16 x K=16):  lane holds A[r][k(h, e)]   (8-bit: 8 bytes in 2 dwords; f16: 8 halves in 4 dwords)
//   B (K=16 x 16):  lane holds B[k(h, e)][r]
//   C/D (16 x 16):  lane holds D[8h + e][r]    (8 x i32 or 8 x f32)
//   8-bit (iu8, fp8):  k(h, e) = 8h + e                      (lanes 0-15: K 0-7, lanes 16-31: K 8-15)
//   f16:               k(h, e) = 8 (e / 4) + 4h + e % 4      (lanes 0-15: K 0-3 and 8-11, lanes 16-31: K 4-7, 12-15)
// Source: AMD's Matrix Instruction Calculator for RDNA4 (ROCm/amd_matrix_instruction_calculator, commit 2ef9189,
// matrix_calculator.py, InstCalcGfx12: __get_input_lane, __get_input_reg and __get_output_reg_lanes for wave32
// dense A/B and 32-bit C/D); for fp8 also the seed's hardware layout probe (DESIGN.md section 5,
// IxMxAMAR/SageAttention-RDNA4 sk1_layout_probe.hip), and clang's builtins-amdgcn-gfx12-wmma-w32.cl for the operand
// types (iu8/fp8: <2 x i32>, f16: <8 x half>, D: <8 x i32/float>). Unlike gfx11 there are no duplicated halves.
// Bytes within a dword are little-endian: element e sits in byte e % 4 of dword e / 4 (f16: half e % 2 of dword
// e / 2). A K order that A and B share cancels in every product, so the kernels only need A's and B's to agree
// (they do: each product puts the same channel or key in element e of A and of B); the emulation follows AMD's
// order so that it means what this comment says.
#ifndef SAGE_GFX12_PRELUDE_H
#define SAGE_GFX12_PRELUDE_H

#if defined(__AMDGCN__)
#define SG_AMD 1
#elif defined(__CUDACC__)
#define SG_CUDA 1
#elif defined(SAGE_HOST_SIM)
#define SG_SIM 1
#else
#error "gfx12_prelude.h: compile for AMDGPU (clang/hiprtc), as CUDA or with SAGE_HOST_SIM"
#endif

#if defined(SG_AMD)
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#define SG_INLINE __device__ inline __attribute__((always_inline))
#define SG_EMU_FN SG_INLINE
#define SG_LAUNCH_BOUNDS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
// Occupancy floor for the compiler's scheduler (waves per SIMD): without it, clang-19's scheduler may trade
// occupancy for latency hiding in the attention key loop (e.g. FP8 D128: 9 -> 8 waves for ~20 more VGPRs).
#define SG_MIN_WAVES(n) __attribute__((amdgpu_waves_per_eu(n)))
#define SG_SHARED __shared__
#elif defined(SG_CUDA)
#define SG_INLINE __device__ __forceinline__
#define SG_EMU_FN __device__ __noinline__  // one emulated WMMA body, called (keeps the CUDA compile fast)
#define SG_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define SG_MIN_WAVES(n)
#define SG_SHARED __shared__
#else
#define SG_INLINE inline
#define SG_EMU_FN __attribute__((noinline))
#define SG_LAUNCH_BOUNDS(n)
#define SG_MIN_WAVES(n)
#define SG_SHARED static
#define __global__
#define __device__
#endif

namespace sg {

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

constexpr int WAVE = 32;
constexpr float F32_TINY = 1.17549435e-38f;  // torch.finfo(float32).tiny, the quantizers' clamp
constexpr float LN2 = 0.6931471805599453f;

// ---------------------------------------------------------------- vector types
#if defined(SG_AMD)
typedef int i32x2 __attribute__((ext_vector_type(2)));
typedef int i32x8 __attribute__((ext_vector_type(8)));
typedef float f32x8 __attribute__((ext_vector_type(8)));
typedef _Float16 h16;
typedef _Float16 f16x8 __attribute__((ext_vector_type(8)));
typedef u32 u32x2 __attribute__((ext_vector_type(2)));
typedef u32 u32x4 __attribute__((ext_vector_type(4)));
template <class To, class From> SG_INLINE To bit_cast(From f) { return __builtin_bit_cast(To, f); }
#else
template <class T, int N> struct vec {
  T v[N];
  SG_INLINE T& operator[](int i) { return v[i]; }
  SG_INLINE const T& operator[](int i) const { return v[i]; }
};
typedef vec<int, 2> i32x2;
typedef vec<int, 8> i32x8;
typedef vec<float, 8> f32x8;
typedef u16 h16;  // fp16 bits
typedef vec<u16, 8> f16x8;
struct __attribute__((aligned(8))) u32x2 { u32 x, y; };
struct __attribute__((aligned(16))) u32x4 { u32 x, y, z, w; };
template <class To, class From> SG_INLINE To bit_cast(From f) {
  union { From f; To t; } u;
  u.f = f;
  return u.t;
}
#endif

// ---------------------------------------------------------------- thread indices, barriers
#if defined(SG_AMD)
SG_INLINE int tid_x() { return (int)__builtin_amdgcn_workitem_id_x(); }
SG_INLINE int bid_x() { return (int)__builtin_amdgcn_workgroup_id_x(); }
SG_INLINE int bid_y() { return (int)__builtin_amdgcn_workgroup_id_y(); }
SG_INLINE int bid_z() { return (int)__builtin_amdgcn_workgroup_id_z(); }
// The kernels only exchange data through LDS inside a block, so the fences are restricted to the
// local address space (no global_wb / global_inv at every barrier).
// (The address-space argument of the fence needs clang >= 19; older hiprtc gets full fences.)
SG_INLINE void block_sync() {
#if __clang_major__ >= 19
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup", "local");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup", "local");
#else
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#endif
}
// The same barrier for LDS reuse only, without the s_wait_loadcnt 0 that clang-19 puts before every barrier on
// gfx12 (it does not model gfx12's barrier as one that may be passed with global loads in flight; later LLVM
// does): the next key tile's global loads, issued before it, then stay in flight across it. Inline asm, so that
// the compiler sees no barrier to wait for; the fences still order the LDS accesses around it.
SG_INLINE void block_sync_lds() {
#if __clang_major__ >= 19
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup", "local");
  asm volatile("s_barrier_signal -1\n\ts_barrier_wait -1" ::: "memory");
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup", "local");
#else
  block_sync();
#endif
}
#elif defined(SG_CUDA)
SG_INLINE int tid_x() { return (int)threadIdx.x; }
SG_INLINE int bid_x() { return (int)blockIdx.x; }
SG_INLINE int bid_y() { return (int)blockIdx.y; }
SG_INLINE int bid_z() { return (int)blockIdx.z; }
SG_INLINE void block_sync() { __syncthreads(); }
SG_INLINE void block_sync_lds() { __syncthreads(); }
SG_INLINE void warp_sync() { __syncwarp(); }
#else
// sim_runtime.h (host only) defines these before including the kernels.
SG_INLINE int tid_x() { return sim_tid(); }
SG_INLINE int bid_x() { return sim_bid(0); }
SG_INLINE int bid_y() { return sim_bid(1); }
SG_INLINE int bid_z() { return sim_bid(2); }
SG_INLINE void block_sync() { sim_block_sync(); }
SG_INLINE void block_sync_lds() { sim_block_sync(); }
SG_INLINE void warp_sync() { sim_warp_sync(); }
#endif
// Keeps the AMDGPU scheduler from hoisting one phase's LDS loads into another (register pressure).
#if defined(SG_AMD)
SG_INLINE void sched_fence() { __builtin_amdgcn_sched_barrier(0); }
#else
SG_INLINE void sched_fence() {}
#endif
SG_INLINE int lane_id() { return tid_x() & (WAVE - 1); }
// Address helpers for loads of the form uniform base (SGPRs) + per-lane 32-bit offset (global_load's saddr +
// voffset). lane_offset: a per-lane offset the compiler may not rewrite (an empty asm, no instruction), so it
// stays one 32-bit VGPR instead of being folded into 64-bit per-lane address arithmetic (two VALU adds per load).
SG_INLINE u32 lane_offset(u32 x) {
#if defined(SG_AMD)
  asm("" : "+v"(x));
#endif
  return x;
}
// Copies of x for two VALU operations that read it and should pair as VOPD, whose two operations must read their
// sources from different VGPR banks (the same register is the same bank). vgpr_copy: a copy in another VGPR (an
// empty asm that the compiler cannot see through; x itself stays live), in a bank the allocator picks. vgpr_pair:
// two copies in one register pair, adjacent registers, so different banks.
SG_INLINE float vgpr_copy(float x) {
#if defined(SG_AMD)
  asm("" : "+v"(x));
#endif
  return x;
}
struct FloatPair { float even, odd; };
SG_INLINE FloatPair vgpr_pair(float x) {
#if defined(SG_AMD)
  u32x2 r = {bit_cast<u32>(x), bit_cast<u32>(x)};
  asm("" : "+v"(r));
  return {bit_cast<float>(r.x), bit_cast<float>(r.y)};
#else
  return {x, x};
#endif
}
// uniform_ptr: a wave-uniform pointer, read back from lane 0 into SGPRs, so that loop strength reduction cannot
// merge a per-lane offset into a per-lane induction pointer.
template <class T> SG_INLINE T* uniform_ptr(T* p) {
#if defined(SG_AMD)
  const u64 a = (u64)p;
  const u32 lo = (u32)__builtin_amdgcn_readfirstlane((int)(u32)a), hi = (u32)__builtin_amdgcn_readfirstlane((int)(u32)(a >> 32));
  // Through a global-address-space pointer: from a plain integer it would be a flat pointer (flat_load).
  typedef __attribute__((address_space(1))) T GT;
  return (T*)(GT*)(((u64)hi << 32) | lo);
#else
  return p;
#endif
}

SG_INLINE int wave_id() { return tid_x() / WAVE; }

// ---------------------------------------------------------------- float helpers
#if defined(SG_AMD)
#if __has_builtin(__builtin_amdgcn_exp2f)
SG_INLINE float fast_exp2(float x) { return __builtin_amdgcn_exp2f(x); }  // v_exp_f32
SG_INLINE float fast_log2(float x) { return __builtin_amdgcn_logf(x); }   // v_log_f32
#else
SG_INLINE float fast_exp2(float x) { return __builtin_exp2f(x); }
SG_INLINE float fast_log2(float x) { return __builtin_log2f(x); }
#endif
SG_INLINE float round_even(float x) { return __builtin_rintf(x); }
SG_INLINE float fmax_(float a, float b) { return __builtin_fmaxf(a, b); }
SG_INLINE float fmin_(float a, float b) { return __builtin_fminf(a, b); }
SG_INLINE float fabs_(float a) { return __builtin_fabsf(a); }
SG_INLINE float fma_(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#elif defined(SG_CUDA)
SG_INLINE float fast_exp2(float x) { return exp2f(x); }
SG_INLINE float fast_log2(float x) { return log2f(x); }
SG_INLINE float round_even(float x) { return rintf(x); }
SG_INLINE float fmax_(float a, float b) { return fmaxf(a, b); }
SG_INLINE float fmin_(float a, float b) { return fminf(a, b); }
SG_INLINE float fabs_(float a) { return fabsf(a); }
SG_INLINE float fma_(float a, float b, float c) { return fmaf(a, b, c); }
#else
SG_INLINE float fast_exp2(float x) { return std::exp2(x); }
SG_INLINE float fast_log2(float x) { return std::log2(x); }
SG_INLINE float round_even(float x) { return std::nearbyint(x); }
SG_INLINE float fmax_(float a, float b) { return std::fmax(a, b); }
SG_INLINE float fmin_(float a, float b) { return std::fmin(a, b); }
SG_INLINE float fabs_(float a) { return std::fabs(a); }
SG_INLINE float fma_(float a, float b, float c) { return std::fma(a, b, c); }
#endif
SG_INLINE float neg_inf() { return bit_cast<float>(0xff800000u); }

// ---------------------------------------------------------------- NaN-keeping max and clamp
// The spec's torch amax and clamp propagate NaN; fmaxf/fminf drop it, which would give a NaN token a
// finite scale and finite garbage. These keep it.
// Max of two values that are >= 0 or NaN (absolute values, amaxes): such floats order like their bit
// patterns read as unsigned integers, with +Inf above every finite value and every NaN above +Inf, so
// one integer max (v_max_u32) propagates NaN and lets it win over Inf, as torch.amax does.
SG_INLINE float abs_max(float a, float b) {
  const u32 x = bit_cast<u32>(a), y = bit_cast<u32>(b);
  return bit_cast<float>(x > y ? x : y);
}
SG_INLINE double abs_max(double a, double b) { return (b > a || b != b) ? b : a; }
// Clamp to [-big, big] (big > 0); NaN stays NaN (a comparison with NaN is false). One compare on |x| and a
// sign copy: 3 instructions on gfx12 where two compares and selects take 4.
SG_INLINE float clamp_keep_nan(float x, float big) {
  return fabs_(x) > big ? bit_cast<float>((bit_cast<u32>(x) & 0x80000000u) | bit_cast<u32>(big)) : x;
}

// ---------------------------------------------------------------- 16-bit floats
SG_INLINE float bf16_to_f32(u16 b) { return bit_cast<float>((u32)b << 16); }
SG_INLINE u16 f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet (as torch)
  u32 u = bit_cast<u32>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#if defined(SG_AMD)
SG_INLINE float f16_to_f32(u16 b) { return (float)bit_cast<_Float16>(b); }
SG_INLINE h16 f32_to_h16(float f) { return (_Float16)f; }
SG_INLINE u16 f32_to_f16(float f) { return bit_cast<u16>((_Float16)f); }
#elif defined(SG_CUDA)
SG_INLINE float f16_to_f32(u16 b) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b)); return f; }
SG_INLINE u16 f32_to_f16(float f) { u16 b; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(f)); return b; }
SG_INLINE h16 f32_to_h16(float f) { return f32_to_f16(f); }
#else
SG_INLINE float f16_to_f32(u16 b) { return sim_f16_to_f32(b); }
SG_INLINE u16 f32_to_f16(float f) { return sim_f32_to_f16(f); }
SG_INLINE h16 f32_to_h16(float f) { return f32_to_f16(f); }
#endif

// Two floats to two fp16 in one dword (lo in bits 0..15), round to nearest even. gfx12: v_fma_mixlo_f16 /
// v_fma_mixhi_f16 (x * 1.0 + 0 in FP32, one rounding to fp16 with the mode's RNE, written into one half of the
// dword) are 2 instructions where two v_cvt_f16_f32 and a v_pack_b32_f16 are 3. The addend +0 changes no
// value here (P >= 0: -0 never occurs).
SG_INLINE u32 pack_f16x2(float lo, float hi) {
#if defined(SG_AMD)
  u32 w;
  asm("v_fma_mixlo_f16 %0, %1, 1.0, 0" : "=v"(w) : "v"(lo));
  asm("v_fma_mixhi_f16 %0, %1, 1.0, 0" : "+v"(w) : "v"(hi));
  return w;
#else
  return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
#endif
}

// acc + lo + hi of a dword of two fp16 (v_dot2_f32_f16 against (1, 1): the products are exact, one instruction
// adds two fp16 values to an FP32 sum). The emulation adds them in FP32 in this order; the hardware's internal
// rounding of the three-term sum is not documented (last-bit differences of the sum at most).
SG_INLINE float add_f16x2(u32 w, float acc) {
#if defined(SG_AMD)
  typedef _Float16 h2 __attribute__((ext_vector_type(2)));
  const h2 one = {(_Float16)1.0f, (_Float16)1.0f};
  return __builtin_amdgcn_fdot2(bit_cast<h2>(w), one, acc, false);
#else
  return acc + (f16_to_f32((u16)(w & 0xffffu)) + f16_to_f32((u16)(w >> 16)));
#endif
}

// Input element types: a tag type per storage format, all read as float.
// store_sat: the spec's saturating output cast (reference.saturating_cast): finite overflow and +-Inf
// clamp to the format's largest finite value, NaN stays NaN.
struct F16 { typedef u16 storage; static SG_INLINE float load(u16 b) { return f16_to_f32(b); }
             static SG_INLINE u16 store(float f) { return f32_to_f16(f); }
             static SG_INLINE u16 store_sat(float f) { return f32_to_f16(clamp_keep_nan(f, 65504.0f)); } };
struct BF16 { typedef u16 storage; static SG_INLINE float load(u16 b) { return bf16_to_f32(b); }
              static SG_INLINE u16 store(float f) { return f32_to_bf16(f); }
              // 0x7f7f0000: the largest finite bf16 (3.3895e38), exact in fp32 and kept by f32_to_bf16
              static SG_INLINE u16 store_sat(float f) { return f32_to_bf16(clamp_keep_nan(f, 3.3895313892515355e38f)); } };

// ---------------------------------------------------------------- fp8 e4m3 (OCP, max 448)
// Exact decode, and a software RNE encoder with saturation for the emulation targets.
SG_INLINE float e4m3_to_f32(u32 code) {
  u32 s = (code >> 7) & 1u, e = (code >> 3) & 15u, m = code & 7u;
  float mag = e == 0 ? (float)m * 0.001953125f  // subnormal: m * 2^-9
                     : bit_cast<float>(((e + 120u) << 23) | (m << 20));
  if (e == 15u && m == 7u) mag = bit_cast<float>(0x7fc00000u);
  return s ? -mag : mag;
}
SG_INLINE u32 f32_to_e4m3_soft(float x) {
  u32 u = bit_cast<u32>(x), sign = (u >> 24) & 0x80u;
  float a = fabs_(x);
  u32 code;
  if (a != a) return 0x7fu;
  if (a < 0.015625f) {  // below 2^-6: subnormal grid of 2^-9 (the 8th step is the smallest normal)
    code = (u32)round_even(a * 512.0f);
  } else {
    u32 b = bit_cast<u32>(a);
    b = b + 0x7ffffu + ((b >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
    code = (((b >> 23) - 120u) << 3) | ((b >> 20) & 7u);
  }
  if (code > 0x7eu) code = 0x7eu;  // saturate to 448
  return code | sign;
}
// Verification option SG_EMU_FP8_NONSAT (emulation targets only; kernel_abi.VERIFY_OPTIONS fp8_nonsat): the
// non-saturating reading of gfx12's v_cvt_pk_fp8_f32, which has no clamp bit: |x| > 448 (Inf included) gives NaN
// (0x7f, 0xff when negative), as HIP's software e4m3 conversion does when not saturating. Default 0: saturate to
// +-448 (CUDA's satfinite). Lets the emulation show any P or V that reaches the conversion above 448.
#if !defined(SG_AMD)
#ifndef SG_EMU_FP8_NONSAT
#define SG_EMU_FP8_NONSAT 0
#endif
SG_INLINE u32 emu_e4m3_overflow(float x, u32 code) {
  return SG_EMU_FP8_NONSAT && fabs_(x) > 448.0f ? 0x7fu | ((bit_cast<u32>(x) >> 24) & 0x80u) : code;
}
#endif
// Two floats to two e4m3 bytes in the low 16 bits (lo in byte 0).
#if defined(SG_AMD)
SG_INLINE u32 pack_e4m3x2(float lo, float hi) { return (u32)__builtin_amdgcn_cvt_pk_fp8_f32(lo, hi, 0, false) & 0xffffu; }
SG_INLINE u32 pack_e4m3x4(float a, float b, float c, float d) {
  // Builtins only: inline asm on v_cvt_pk_fp8_f32 is not supported where LLVM's gfx12 real-true16 mode gives it a
  // 16-bit destination. The first conversion writes the low word and keeps the old operand's high word, which the
  // second overwrites: any old value will do. `a` (dead once converted: the FP8 row sum reads P first) lets the
  // result take its register; a constant old costs a v_mov per dword (clang-19: FP8 D128 +0.11 per v_wmma).
  const int w = __builtin_amdgcn_cvt_pk_fp8_f32(a, b, bit_cast<int>(a), false);
  return (u32)__builtin_amdgcn_cvt_pk_fp8_f32(c, d, w, true);
}
#elif defined(SG_CUDA)
SG_INLINE u32 pack_e4m3x2(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return emu_e4m3_overflow(lo, r & 0xffu) | (emu_e4m3_overflow(hi, (u32)r >> 8) << 8);
}
SG_INLINE u32 pack_e4m3x4(float a, float b, float c, float d) { return pack_e4m3x2(a, b) | (pack_e4m3x2(c, d) << 16); }
#else
SG_INLINE u32 pack_e4m3x2(float lo, float hi) {
  return emu_e4m3_overflow(lo, f32_to_e4m3_soft(lo)) | (emu_e4m3_overflow(hi, f32_to_e4m3_soft(hi)) << 8);
}
SG_INLINE u32 pack_e4m3x4(float a, float b, float c, float d) { return pack_e4m3x2(a, b) | (pack_e4m3x2(c, d) << 16); }
#endif

// ---------------------------------------------------------------- byte permute
// Result byte i = byte sel_i of the 8-byte value {hi:lo} (selectors 0..7 only).
SG_INLINE u32 byte_perm(u32 lo, u32 hi, u32 sel) {
#if defined(SG_AMD)
  return __builtin_amdgcn_perm(hi, lo, sel);
#elif defined(SG_CUDA)
  return __byte_perm(lo, hi, sel);
#else
  u64 v = ((u64)hi << 32) | lo;
  u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= (u32)((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}

// ---------------------------------------------------------------- cross-lane
#if !defined(SG_AMD)
// Emulation scratch: one slot per wave of up to 8 waves (256-thread blocks) for lane exchange and
// for the WMMA operands (A and B, 16x16 of up to 2 bytes each).
struct WaveScratch { u32 lanes[WAVE]; u8 a[16 * 16 * 2]; u8 b[16 * 16 * 2]; };
SG_INLINE WaveScratch& wave_scratch() {
  SG_SHARED WaveScratch scratch[8];
  return scratch[wave_id()];
}
SG_INLINE u32 emu_shfl_xor(u32 v, int mask) {
#if defined(SG_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, mask);
#else
  WaveScratch& s = wave_scratch();
  s.lanes[lane_id()] = v;
  warp_sync();
  u32 r = s.lanes[lane_id() ^ mask];
  warp_sync();
  return r;
#endif
}
#endif

// Value of lane (lane ^ MASK), MASK in {1, 2, 4, 8, 16}.
template <int MASK> SG_INLINE float lane_xor(float v) {
#if defined(SG_AMD)
  if (MASK == 16)  // VALU cross-row permute: lane i reads lane i ^ 16
    return bit_cast<float>(__builtin_amdgcn_permlanex16(bit_cast<u32>(v), bit_cast<u32>(v), 0x76543210u, 0xfedcba98u, false, false));
  // ds_swizzle bit-mask mode within 32 lanes: and_mask 0x1f, or_mask 0, xor_mask MASK.
  return bit_cast<float>(__builtin_amdgcn_ds_swizzle(bit_cast<int>(v), (MASK << 10) | 0x1f));
#else
  return bit_cast<float>(emu_shfl_xor(bit_cast<u32>(v), MASK));
#endif
}
// lane_xor<16> for code where all 32 lanes are active (the attention key loop). Then no lane keeps the
// destination's old value, so as asm the result gets a register of its own: the builtin ties the destination
// to an input that is still live and costs a v_mov.
SG_INLINE float lane_xor16_full_wave(float v) {
#if defined(SG_AMD)
  u32 r;
  asm("v_permlanex16_b32 %0, %1, %2, 0xfedcba98" : "=v"(r) : "v"(bit_cast<u32>(v)), "s"(0x76543210u));
  return bit_cast<float>(r);
#else
  return lane_xor<16>(v);
#endif
}
// Whether x holds in any lane of the wave (a wave-uniform answer: a scalar branch on AMD).
SG_INLINE bool wave_any(bool x) {
#if defined(SG_AMD)
  return __builtin_amdgcn_ballot_w32(x) != 0u;
#elif defined(SG_CUDA)
  return __any_sync(0xffffffffu, x);
#else
  const u32 v = x ? 1u : 0u;
  u32 r = v | emu_shfl_xor(v, 16);
  r |= emu_shfl_xor(r, 8); r |= emu_shfl_xor(r, 4); r |= emu_shfl_xor(r, 2); r |= emu_shfl_xor(r, 1);
  return r != 0u;
#endif
}
// Wave-wide abs_max of values >= 0 or NaN (NaN in any lane gives NaN in every lane).
SG_INLINE float wave_abs_max(float v) {
  v = abs_max(v, lane_xor<16>(v)); v = abs_max(v, lane_xor<8>(v)); v = abs_max(v, lane_xor<4>(v));
  v = abs_max(v, lane_xor<2>(v)); v = abs_max(v, lane_xor<1>(v));
  return v;
}

// ---------------------------------------------------------------- truncating accumulator (emulation only)
// Verification option: SG_EMU_ACC_TRUNC_BITS (fp8 builtin) and SG_EMU_F16_ACC_TRUNC_BITS (f16 builtin),
// 0 = exact (default). N > 0 models a matrix unit whose accumulator keeps N fraction bits, as NVIDIA's
// FP8 MMA does (~13 bits, an FP22; SageAttention2's paper): per output element the 17 terms, C and the
// 16 products (each exact in fp32), are aligned to the largest exponent emax among the nonzero terms
// and every bit below 2^(emax - N) is dropped (each term truncated toward zero to a multiple of
// 2^(emax - N)); the aligned terms are summed exactly and the sum is normalised into the N-bit
// accumulator, again truncating toward zero (N fraction bits below its leading bit), and stored as fp32
// (round to nearest even: exact for N <= 23; N = 24 models a unit one bit wider than its fp32 register).
// Terms that are NaN or Inf give the plain sum. A pure-torch twin of this model is
// kernels/verify/hip_checks.py (trunc_acc_model); tests compare the two bit for bit. It says nothing about
// what RDNA4 does: it lets the emulation show which kernels survive a truncating accumulator.
#if !defined(SG_AMD)
#ifndef SG_EMU_ACC_TRUNC_BITS
#define SG_EMU_ACC_TRUNC_BITS 0
#endif
#ifndef SG_EMU_F16_ACC_TRUNC_BITS
#define SG_EMU_F16_ACC_TRUNC_BITS 0
#endif
// Exponent of the leading bit of a finite nonzero float (subnormals count as 2^-127 and below: -127).
SG_INLINE int emu_exponent(float x) {
  const int ef = (int)((bit_cast<u32>(x) >> 23) & 0xffu);
  return ef ? ef - 127 : -127;
}
// x truncated toward zero to a multiple of 2^g (finite x; bit masking of the fp32 encoding).
SG_INLINE float emu_trunc_to_grid(float x, int g) {
  const u32 u = bit_cast<u32>(x);
  const int ef = (int)((u >> 23) & 0xffu);
  const int drop = g - ((ef ? ef : 1) - 150);  // bits below 2^g; the last mantissa bit is 2^(ef - 150)
  if (drop <= 0) return x;
  if (drop >= 24) return bit_cast<float>(u & 0x80000000u);  // |x| < 2^g: signed zero
  return bit_cast<float>(u & ~((1u << drop) - 1u));
}
SG_INLINE float emu_trunc_acc(const float* t, int bits) {
  int emax = -1000;
  bool finite = true;
  for (int i = 0; i < 17; ++i) {
    if (!(fabs_(t[i]) <= 3.40282347e38f)) finite = false;
    else if (t[i] != 0.0f && emu_exponent(t[i]) > emax) emax = emu_exponent(t[i]);
  }
  if (!finite) {
    float acc = 0.0f;
    for (int i = 1; i < 17; ++i) acc += t[i];
    return acc + t[0];
  }
  if (emax == -1000) return t[0] + 0.0f;  // all terms zero
  double sum = 0.0;  // multiples of 2^(emax - bits) below 17 * 2^(emax + 1): exact in double
  for (int i = 0; i < 17; ++i) sum += (double)emu_trunc_to_grid(t[i], emax - bits);
  if (sum == 0.0) return (float)sum;
  // Normalised in double (the sum may need bits + 5 significant bits), then stored as fp32.
  const u64 u = bit_cast<u64>(sum);
  const int drop = 52 - bits;  // sum is a normal double: its leading bit is 2^52 units of its last mantissa bit
  return (float)bit_cast<double>(u & ~((1ull << drop) - 1ull));
}
#endif

// ---------------------------------------------------------------- WMMA 16x16x16, wave32
#if !defined(SG_AMD)
// Verification option SG_EMU_WMMA_K_FAULT (kernel_abi.VERIFY_OPTIONS wmma_k_fault; emulation only), a planted
// fault for the layout probe: 1 = B alone takes the other family's K order (f16: the contiguous 8h + e, 8-bit:
// the f16 order), so A and B disagree and every product is wrong; 2 = A and B both take it, a shared permutation
// that no WMMA output can show. 0 (default): the gfx12 layout above.
#ifndef SG_EMU_WMMA_K_FAULT
#define SG_EMU_WMMA_K_FAULT 0
#endif
// Verification option SG_EMU_FLUSH_SUBNORMAL (kernel_abi.VERIFY_OPTIONS emu_flush_subnormal; emulation only): 1 =
// the fp8 and f16 WMMAs read subnormal A/B inputs (e4m3 exponent field 0, f16 exponent field 0) as zero, a model of
// a matrix unit that flushes them (public measurements found RDNA3.5 WMMA flushing bf16 subnormals; what RDNA4
// does is unknown, nothing here has run on it). 0 (default): subnormal inputs read exactly.
#ifndef SG_EMU_FLUSH_SUBNORMAL
#define SG_EMU_FLUSH_SUBNORMAL 0
#endif
SG_INLINE float emu_e4m3_in(u32 code) { return SG_EMU_FLUSH_SUBNORMAL && !(code & 0x78u) ? 0.0f : e4m3_to_f32(code); }
SG_INLINE float emu_f16_in(u16 b) { return SG_EMU_FLUSH_SUBNORMAL && !(b & 0x7c00u) ? 0.0f : f16_to_f32(b); }
// K of element e in lane half h (the layout above); `other`: the other family's order.
template <int ESZ> SG_INLINE int emu_k(int h, int e, bool other) {
  return (ESZ == 2) != other ? 8 * (e >> 2) + 4 * h + (e & 3) : 8 * h + e;
}
// Each lane publishes its A row slice and B column slice (gfx12 layout), then computes its own
// D[8h + e][r]. ESZ is the element size in bytes; A is stored row-major, B column-major, by K.
template <int ESZ> SG_INLINE void emu_publish(const u8* a, const u8* b) {
  WaveScratch& s = wave_scratch();
  int l = lane_id(), r = l & 15, h = l >> 4;
  for (int e = 0; e < 8; ++e) {
    const int ka = emu_k<ESZ>(h, e, SG_EMU_WMMA_K_FAULT == 2), kb = emu_k<ESZ>(h, e, SG_EMU_WMMA_K_FAULT != 0);
    for (int i = 0; i < ESZ; ++i) {
      s.a[(r * 16 + ka) * ESZ + i] = a[e * ESZ + i];  // A[r][k]
      s.b[(r * 16 + kb) * ESZ + i] = b[e * ESZ + i];  // B[k][r]
    }
  }
  warp_sync();
}
#endif

SG_EMU_FN i32x8 wmma_iu8(i32x2 a, i32x2 b, i32x8 c) {
#if defined(SG_AMD)
  return __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32_gfx12(true, a, true, b, c, false);
#else
  emu_publish<1>((const u8*)&a, (const u8*)&b);
  WaveScratch& s = wave_scratch();
  int l = lane_id(), r = l & 15, h = l >> 4;
  i32x8 d;
  for (int e = 0; e < 8; ++e) {
    int m = 8 * h + e, acc = c[e];
    for (int k = 0; k < 16; ++k) acc += (int)(i8)s.a[m * 16 + k] * (int)(i8)s.b[r * 16 + k];
    d[e] = acc;
  }
  warp_sync();
  return d;
#endif
}

// fp8 e4m3 x fp8 e4m3 -> f32. Products are exact in f32; the emulation sums them in K order and
// then adds C (the hardware's internal summation order is not documented: last-bit differences).
// With SG_EMU_ACC_TRUNC_BITS > 0 it models a truncating accumulator instead (emu_trunc_acc).
SG_EMU_FN f32x8 wmma_fp8(i32x2 a, i32x2 b, f32x8 c) {
#if defined(SG_AMD)
  return __builtin_amdgcn_wmma_f32_16x16x16_fp8_fp8_w32_gfx12(a, b, c);
#else
  emu_publish<1>((const u8*)&a, (const u8*)&b);
  WaveScratch& s = wave_scratch();
  int l = lane_id(), r = l & 15, h = l >> 4;
  f32x8 d;
  for (int e = 0; e < 8; ++e) {
    int m = 8 * h + e;
    if (SG_EMU_ACC_TRUNC_BITS > 0) {
      float t[17];
      t[0] = c[e];
      for (int k = 0; k < 16; ++k) t[k + 1] = emu_e4m3_in(s.a[m * 16 + k]) * emu_e4m3_in(s.b[r * 16 + k]);
      d[e] = emu_trunc_acc(t, SG_EMU_ACC_TRUNC_BITS);
      continue;
    }
    float acc = 0.0f;
    for (int k = 0; k < 16; ++k) acc = fma_(emu_e4m3_in(s.a[m * 16 + k]), emu_e4m3_in(s.b[r * 16 + k]), acc);
    d[e] = acc + c[e];
  }
  warp_sync();
  return d;
#endif
}

SG_EMU_FN f32x8 wmma_f16(f16x8 a, f16x8 b, f32x8 c) {
#if defined(SG_AMD)
  return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(a, b, c);
#else
  emu_publish<2>((const u8*)&a, (const u8*)&b);
  WaveScratch& s = wave_scratch();
  int l = lane_id(), r = l & 15, h = l >> 4;
  const u16* sa = (const u16*)s.a;
  const u16* sb = (const u16*)s.b;
  f32x8 d;
  for (int e = 0; e < 8; ++e) {
    int m = 8 * h + e;
    if (SG_EMU_F16_ACC_TRUNC_BITS > 0) {
      float t[17];
      t[0] = c[e];
      for (int k = 0; k < 16; ++k) t[k + 1] = emu_f16_in(sa[m * 16 + k]) * emu_f16_in(sb[r * 16 + k]);
      d[e] = emu_trunc_acc(t, SG_EMU_F16_ACC_TRUNC_BITS);
      continue;
    }
    float acc = 0.0f;
    for (int k = 0; k < 16; ++k) acc = fma_(emu_f16_in(sa[m * 16 + k]), emu_f16_in(sb[r * 16 + k]), acc);
    d[e] = acc + c[e];
  }
  warp_sync();
  return d;
#endif
}

}  // namespace sg
#endif  // SAGE_GFX12_PRELUDE_H
