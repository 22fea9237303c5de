// Hardware probes: one-wave kernels that exercise exactly the instructions the attention kernels rely on and write
// raw results. kernels/backends/hip/probes.py builds their inputs, computes what the spec expects on the host and
// runs them once per device before any self-check; a result that breaks an assumption disables the kernels that
// depend on it. Compiled after sage_attention.hip (kernel_abi.SOURCE_FILES): the bias probe uses its QK_BIAS.

namespace sg {

// One 16x16x16 product per builtin, operands given in the gfx12 per-lane layout (32 lanes x 8 elements,
// lane-major) and D returned per lane (kind 0 iu8 signed x signed, 1 fp8 x fp8, 2 f16). c == NULL: C is the
// constant 0 (the inline operand the P.V chains start from) instead of registers loaded from c.
SG_INLINE void wmma_probe(int kind, const u32* a, const u32* b, const u32* c, u32* d) {
  const int l = lane_id();
  if (kind == 2) {
    u32x4 aw = *(const u32x4*)(a + 4 * l), bw = *(const u32x4*)(b + 4 * l);
    f32x8 r;
    if (c) {
      f32x8 cv;
      #pragma unroll
      for (int e = 0; e < 8; ++e) cv[e] = bit_cast<float>(c[8 * l + e]);
      r = wmma_f16(bit_cast<f16x8>(aw), bit_cast<f16x8>(bw), cv);
    } else {
      r = wmma_f16(bit_cast<f16x8>(aw), bit_cast<f16x8>(bw), f32x8{});
    }
    #pragma unroll
    for (int e = 0; e < 8; ++e) d[8 * l + e] = bit_cast<u32>(r[e]);
    return;
  }
  const i32x2 av = mk_i32x2(a[2 * l], a[2 * l + 1]), bv = mk_i32x2(b[2 * l], b[2 * l + 1]);
  if (kind == 0) {  // C from registers only: the kernels' iu8 chains start from QK_BIAS (bias_probe)
    i32x8 cv;
    #pragma unroll
    for (int e = 0; e < 8; ++e) cv[e] = c ? (int)c[8 * l + e] : 0;
    const i32x8 r = wmma_iu8(av, bv, cv);
    #pragma unroll
    for (int e = 0; e < 8; ++e) d[8 * l + e] = (u32)r[e];
  } else {
    f32x8 r;
    if (c) {
      f32x8 cv;
      #pragma unroll
      for (int e = 0; e < 8; ++e) cv[e] = bit_cast<float>(c[8 * l + e]);
      r = wmma_fp8(av, bv, cv);
    } else {
      r = wmma_fp8(av, bv, f32x8{});
    }
    #pragma unroll
    for (int e = 0; e < 8; ++e) d[8 * l + e] = bit_cast<u32>(r[e]);
  }
}

// The Q.K chain's start: the iu8 WMMA with C = QK_BIAS written as the kernels write it (a constant splat, which
// the compiler encodes as the float inline constant 1/(2 pi)). Writes the raw int32 D and unbias_dot(D).
SG_INLINE void bias_probe(const u32* a, const u32* b, u32* d, float* dot) {
  const int l = lane_id();
  const i32x2 av = mk_i32x2(a[2 * l], a[2 * l + 1]), bv = mk_i32x2(b[2 * l], b[2 * l + 1]);
  i32x8 cv;
  #pragma unroll
  for (int e = 0; e < 8; ++e) cv[e] = QK_BIAS;
  const i32x8 r = wmma_iu8(av, bv, cv);
  #pragma unroll
  for (int e = 0; e < 8; ++e) {
    d[8 * l + e] = (u32)r[e];
    dot[8 * l + e] = unbias_dot(r[e]);
  }
}

// The accumulator probe: `steps` WMMAs of one builtin (kind 1 fp8 x fp8, 2 f16) in one chain, each D the next C,
// as a single-chain P.V accumulates; A and B the same every step, C from c before the first. Writes the last D.
// probes.py chooses operands whose exact sums tell how many fraction bits C keeps across the chain.
SG_INLINE void acc_probe(int kind, const u32* a, const u32* b, const u32* c, int steps, u32* d) {
  const int l = lane_id();
  f32x8 acc;
  #pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = bit_cast<float>(c[8 * l + e]);
  if (kind == 2) {
    const f16x8 av = bit_cast<f16x8>(*(const u32x4*)(a + 4 * l)), bv = bit_cast<f16x8>(*(const u32x4*)(b + 4 * l));
    for (int s = 0; s < steps; ++s) acc = wmma_f16(av, bv, acc);
  } else {
    const i32x2 av = mk_i32x2(a[2 * l], a[2 * l + 1]), bv = mk_i32x2(b[2 * l], b[2 * l + 1]);
    for (int s = 0; s < steps; ++s) acc = wmma_fp8(av, bv, acc);
  }
  #pragma unroll
  for (int e = 0; e < 8; ++e) d[8 * l + e] = bit_cast<u32>(acc[e]);
}

// n floats (n a multiple of 4) to e4m3 bytes through pack_e4m3x4, the conversion P and V go through (one dword
// of 4 bytes per thread): rounding, byte order, overflow.
SG_INLINE void e4m3_probe(const float* x, u32* out, int n) {
  const int i = bid_x() * WAVE + tid_x();
  if (4 * i < n) out[i] = pack_e4m3x4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
}

// The cross-lane and packed-half helpers, one row of 32 lanes each (x: 64 floats, w: 32 dwords of two fp16):
// rows 0-4 lane_xor<1, 2, 4, 8, 16>(x[l]) (ds_swizzle; v_permlanex16 for 16), 5 lane_xor16_full_wave(x[l]),
// 6 wave_abs_max(|x[l]|), 7 add_f16x2(w[l], x[l]) (v_dot2_f32_f16), 8 pack_f16x2(x[l], x[32 + l]) (v_fma_mix),
// 9 add_f16x2(w[l], 0) (the row sum's first step: the accumulator as the inline constant 0).
SG_INLINE void lane_probe(const float* x, const u32* w, u32* out) {
  const int l = lane_id();
  const float v = x[l];
  out[0 * WAVE + l] = bit_cast<u32>(lane_xor<1>(v));
  out[1 * WAVE + l] = bit_cast<u32>(lane_xor<2>(v));
  out[2 * WAVE + l] = bit_cast<u32>(lane_xor<4>(v));
  out[3 * WAVE + l] = bit_cast<u32>(lane_xor<8>(v));
  out[4 * WAVE + l] = bit_cast<u32>(lane_xor<16>(v));
  out[5 * WAVE + l] = bit_cast<u32>(lane_xor16_full_wave(v));
  out[6 * WAVE + l] = bit_cast<u32>(wave_abs_max(fabs_(v)));
  out[7 * WAVE + l] = bit_cast<u32>(add_f16x2(w[l], v));
  out[8 * WAVE + l] = pack_f16x2(v, x[WAVE + l]);
  out[9 * WAVE + l] = bit_cast<u32>(add_f16x2(w[l], 0.0f));
}

}  // namespace sg

extern "C" __global__ SG_LAUNCH_BOUNDS(32) void sage_wmma_probe(int kind, const sg::u32* a, const sg::u32* b,
                                                                const sg::u32* c, sg::u32* d) {
  sg::wmma_probe(kind, a, b, c, d);
}

extern "C" __global__ SG_LAUNCH_BOUNDS(32) void sage_bias_probe(const sg::u32* a, const sg::u32* b, sg::u32* d,
                                                                float* dot) {
  sg::bias_probe(a, b, d, dot);
}

extern "C" __global__ SG_LAUNCH_BOUNDS(32) void sage_acc_probe(int kind, const sg::u32* a, const sg::u32* b,
                                                               const sg::u32* c, int steps, sg::u32* d) {
  sg::acc_probe(kind, a, b, c, steps, d);
}

extern "C" __global__ SG_LAUNCH_BOUNDS(32) void sage_e4m3_probe(const float* x, sg::u32* out, int n) {
  sg::e4m3_probe(x, out, n);
}

extern "C" __global__ SG_LAUNCH_BOUNDS(32) void sage_lane_probe(const float* x, const sg::u32* w, sg::u32* out) {
  sg::lane_probe(x, w, out);
}
