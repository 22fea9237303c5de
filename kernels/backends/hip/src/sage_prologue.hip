// sage_prologue.hip: the quantization prologue, producing quant.QuantizedQKV exactly as
// kernels/quant.py specifies (same rounding steps, in the same order, in FP32; key mean in FP64).
// Inputs are strided HND views (fused-qkv projections, transposed NHD views) read through explicit
// element strides; every offset is 64-bit. Launch geometry lives in kernels/backends/hip/kernel_abi.py.
namespace sg {

constexpr int PRO_THREADS = 256;
constexpr int STAT_CHUNK = 512;  // tokens per column-statistics block

// Column statistics per (b, h, channel) over one chunk of tokens, into a f64 workspace
// ws[((b*H + h)*chunks + chunk)*D + d]. mode 0: sum (for the key and value means); mode 1: max |x|,
// or with `mean` (smooth_v) max |x - mean[b, h, d]| with the difference taken in FP32 as the spec does.
// Both keep NaN as torch does (a sum does by itself; the max through abs_max), so a NaN or Inf
// anywhere in a channel gives that channel a NaN/Inf statistic instead of a finite one.
// `live` (a key-only mask's live keys, int8 (B, H, N) contiguous, or nullptr): a dead key counts as x * 0
// (quant.smooth_keys_live: 0, or NaN where x is NaN/Inf), in the sum and, without the mean, in the max.
template <class T>
SG_INLINE void colstats(const u16* x, i64 sb, i64 sh, i64 sn, i64 sd, int H, int N, int D, int chunks,
                        int mode, const float* mean, const i8* live, double* ws) {
  SG_SHARED double part[PRO_THREADS];
  const int chunk = bid_x(), h = bid_y(), b = bid_z(), t = tid_x();
  const int rows = PRO_THREADS / D, d = t % D, r = t / D;
  const u16* base = x + (i64)b * sb + (i64)h * sh + (i64)d * sd;
  const int n_end = (chunk + 1) * STAT_CHUNK < N ? (chunk + 1) * STAT_CHUNK : N;
  double acc = 0.0;
  if (r < rows) {
    const float mu = mean && mode != 0 ? mean[((i64)b * H + h) * D + d] : 0.0f;
    const i8* live_row = live ? live + ((i64)b * H + h) * N : nullptr;
    for (int n = chunk * STAT_CHUNK + r; n < n_end; n += rows) {
      float v = T::load(base[(i64)n * sn]);
      if (live_row && !live_row[n]) v = v * 0.0f;
      else if (mean && mode != 0) v = v - mu;
      if (mode == 0) acc += (double)v;
      else acc = abs_max(acc, (double)fabs_(v));
    }
  }
  part[t] = acc;
  block_sync();
  if (t < D) {
    double s = part[t];
    for (int i = 1; i < rows; ++i) {
      double o = part[i * D + t];
      s = mode == 0 ? s + o : abs_max(s, o);
    }
    ws[(((i64)b * H + h) * chunks + chunk) * D + t] = s;
  }
}

// Combine the chunks, in chunk order, and finish one statistic per (b, h, channel):
//   mode 0: key/value mean = float(sum / N)                     (torch: x.double().mean().float())
//           or, with `count` (a key-only mask: the FP64 live keys per (b, h), at least 1), float(sum / count)
//   mode 1: fp8 scale  = max(amax / 448, tiny)                  (quant.quantize_v_fp8)
//   mode 2: fp16 scale = smallest power of two >= max(amax / 32768, 2^-126)   (quant.fp16_v_scale)
// A NaN amax gives a NaN scale and an Inf amax an Inf scale (torch's clamp_min keeps both).
SG_INLINE void colstats_finalize(const double* ws, int chunks, i64 rows, int D, int N, int mode, const double* count,
                                 float* out) {
  const i64 i = (i64)bid_x() * PRO_THREADS + tid_x();
  if (i >= rows * D) return;
  const i64 bh = i / D;
  const int d = (int)(i % D);
  double s = 0.0;
  for (int c = 0; c < chunks; ++c) {
    double o = ws[(bh * chunks + c) * D + d];
    s = mode == 0 ? s + o : abs_max(s, o);
  }
  float res;
  if (mode == 0) {
    res = count ? (float)(s / count[bh]) : N > 0 ? (float)(s / (double)N) : 0.0f;
  } else if (mode == 1) {
    res = abs_max((float)s / 448.0f, F32_TINY);
  } else {
    // Up or down, so small V is not lost in FP16's subnormals; the floor keeps the scale normal.
    float over = abs_max((float)s / 32768.0f, F32_TINY);
    u32 bits = bit_cast<u32>(over);
    // exp2(ceil(log2(over))) without transcendental rounding: exact powers of two stay; Inf and NaN
    // (bits at or above 0x7f800000, over being >= 2^-126 or NaN) pass unchanged.
    if ((bits & 0x7fffffu) && bits < 0x7f800000u) bits = (bits & 0x7f800000u) + 0x800000u;
    res = bit_cast<float>(bits);
  }
  out[i] = res;
}

// Per-token (G == 1) or per-block-of-G-tokens INT8 quantization of Q or K, D = 64 or 128.
//   x = float(in) * mult (Q: mult = fp32(sm_scale * log2 e)) or x = float(in) - mean[d] (smoothed K)
//   amax = max(max|x| over the group, tiny); q = clamp(rint(x * ((1 / amax) * 127)), -127, 127);
//   scale = amax / 127.
// Non-finite input: NaN in the group gives amax NaN, Inf gives Inf (torch.amax, NaN winning), so the
// scale is NaN/Inf and every q of the group is 0 (x * inv is NaN or 0; torch casts NaN to int8 0):
// the scores of that token become NaN (0 * Inf, x * NaN) and reach the output instead of garbage.
// One block = 8 waves; a wave handles TB/8 tokens, a lane D/32 adjacent channels.
// `live` (K under a key-only mask, as colstats'): a dead key is x * 0, so its code is 0 and it widens no block's amax.
template <int D, int G, class T>
SG_INLINE void quant_qk(const u16* x, i64 sb, i64 sh, i64 sn, i64 sd, int H, int N, float mult,
                        const float* mean, const i8* live, i8* out, float* scale) {
  constexpr int TB = G == 1 ? 32 : G, TPW = TB / 8, EPL = D / 32;
  SG_SHARED float wave_amax[8];
  const int h = bid_y(), b = bid_z(), lane = lane_id(), w = wave_id();
  const int n0 = bid_x() * TB + w * TPW;
  const i64 bh = (i64)b * H + h;
  const u16* base = x + (i64)b * sb + (i64)h * sh;
  float mu[EPL];
  #pragma unroll
  for (int i = 0; i < EPL; ++i) mu[i] = mean ? mean[bh * D + lane * EPL + i] : 0.0f;
  float v[TPW][EPL];
  float amax[TPW];
  float group_amax = 0.0f;
  #pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int n = n0 + t;
    float m = 0.0f;
    #pragma unroll
    for (int i = 0; i < EPL; ++i) {
      float f = 0.0f;
      if (n < N) {
        f = T::load(base[(i64)n * sn + (i64)(lane * EPL + i) * sd]);
        if (live && !live[bh * N + n]) f = f * 0.0f;
        else f = mean ? f - mu[i] : f * mult;
      }
      v[t][i] = f;
      m = abs_max(m, fabs_(f));
    }
    amax[t] = wave_abs_max(m);
    group_amax = abs_max(group_amax, amax[t]);
  }
  if (G > 1) {
    if (lane == 0) wave_amax[w] = group_amax;
    block_sync();
    group_amax = wave_amax[0];
    #pragma unroll
    for (int i = 1; i < 8; ++i) group_amax = abs_max(group_amax, wave_amax[i]);
  }
  #pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int n = n0 + t;
    if (n >= N) continue;
    const float a = abs_max(G == 1 ? amax[t] : group_amax, F32_TINY);
    // quant.py writes INT8_MAX / amax: a Python scalar over a tensor is reciprocal() * 127 in torch.
    const float inv = (1.0f / a) * 127.0f;
    u32 packed = 0;
    #pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float r = v[t][i] * inv;
      const float q = r == r ? fmin_(fmax_(round_even(r), -127.0f), 127.0f) : 0.0f;
      packed |= ((u32)(int)q & 0xffu) << (8 * i);
    }
    i8* dst = out + (bh * N + n) * D + lane * EPL;
    if (EPL == 4) *(u32*)dst = packed;
    else *(u16*)dst = (u16)packed;
    if (lane == 0) scale[bh * N + n] = a / 127.0f;
  }
}

// V for FP8 P.V: e4m3(clamp(v / scale, -448, 448)); for FP16 P.V: fp16(v / scale); with smooth_v
// (mean != nullptr) v is float(x) - mean[b, h, d] first (FP32, as quant.smooth_values).
// NaN (a NaN/Inf channel: its scale is NaN/Inf) stays NaN through the clamp and the e4m3 encoding.
// `live` (as colstats'): a dead key is x * 0 (code 0, or NaN from a NaN/Inf x).
// One thread = 4 adjacent channels of one token; output (B, H, N, Dv) contiguous.
template <bool FP8, class T>
SG_INLINE void quant_v(const u16* x, i64 sb, i64 sh, i64 sn, i64 sd, int H, int N, int Dv,
                       const float* vscale, const float* mean, const i8* live, void* out) {
  const int h = bid_y(), b = bid_z();
  const i64 bh = (i64)b * H + h;
  const i64 idx = (i64)bid_x() * PRO_THREADS + tid_x();
  const int groups = Dv / 4;
  if (idx >= (i64)N * groups) return;
  const i64 n = idx / groups;
  const int d0 = (int)(idx % groups) * 4;
  const u16* src = x + (i64)b * sb + (i64)h * sh + n * sn + (i64)d0 * sd;
  const bool dead = live && !live[bh * N + n];
  float y[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    float f = T::load(src[(i64)i * sd]);
    if (dead) f = f * 0.0f;
    else if (mean) f = f - mean[bh * Dv + d0 + i];
    f = f / vscale[bh * Dv + d0 + i];
    y[i] = FP8 ? clamp_keep_nan(f, 448.0f) : f;
  }
  const i64 o = (bh * N + n) * Dv + d0;
  if (FP8) {
    *(u32*)((u8*)out + o) = pack_e4m3x4(y[0], y[1], y[2], y[3]);
  } else {
    u32x2 p;
    p.x = (u32)f32_to_f16(y[0]) | ((u32)f32_to_f16(y[1]) << 16);
    p.y = (u32)f32_to_f16(y[2]) | ((u32)f32_to_f16(y[3]) << 16);
    *(u32x2*)((u16*)out + o) = p;
  }
}

}  // namespace sg

// ---------------------------------------------------------------- entry points
#define SG_COLSTATS(SUF, T)                                                                              \
  extern "C" __global__ SG_LAUNCH_BOUNDS(256) void sage_colstats_##SUF(                                  \
      const sg::u16* x, sg::i64 sb, sg::i64 sh, sg::i64 sn, sg::i64 sd, int H, int N, int D, int chunks, \
      int mode, const float* mean, const sg::i8* live, double* ws) {                                      \
    sg::colstats<sg::T>(x, sb, sh, sn, sd, H, N, D, chunks, mode, mean, live, ws);                      \
  }
SG_COLSTATS(f16, F16)
SG_COLSTATS(bf16, BF16)

extern "C" __global__ SG_LAUNCH_BOUNDS(256) void sage_colstats_finalize(const double* ws, int chunks, sg::i64 rows,
                                                                        int D, int N, int mode, const double* count,
                                                                        float* out) {
  sg::colstats_finalize(ws, chunks, rows, D, N, mode, count, out);
}

#define SG_QUANT_QK(D, G, SUF, T)                                                                           \
  extern "C" __global__ SG_LAUNCH_BOUNDS(256) void sage_quant_qk_d##D##_g##G##_##SUF(                       \
      const sg::u16* x, sg::i64 sb, sg::i64 sh, sg::i64 sn, sg::i64 sd, int H, int N, float mult,         \
      const float* mean, const sg::i8* live, sg::i8* out, float* scale) {                                   \
    sg::quant_qk<D, G, sg::T>(x, sb, sh, sn, sd, H, N, mult, mean, live, out, scale);                      \
  }
#define SG_QUANT_QK_G(D, SUF, T) SG_QUANT_QK(D, 1, SUF, T) SG_QUANT_QK(D, 32, SUF, T) \
  SG_QUANT_QK(D, 64, SUF, T) SG_QUANT_QK(D, 128, SUF, T)
SG_QUANT_QK_G(64, f16, F16)
SG_QUANT_QK_G(128, f16, F16)
SG_QUANT_QK_G(64, bf16, BF16)
SG_QUANT_QK_G(128, bf16, BF16)

#define SG_QUANT_V(PV, FP8, SUF, T)                                                                          \
  extern "C" __global__ SG_LAUNCH_BOUNDS(256) void sage_quant_v_##PV##_##SUF(                                 \
      const sg::u16* x, sg::i64 sb, sg::i64 sh, sg::i64 sn, sg::i64 sd, int H, int N, int Dv,               \
      const float* vscale, const float* mean, const sg::i8* live, void* out) {                                \
    sg::quant_v<FP8, sg::T>(x, sb, sh, sn, sd, H, N, Dv, vscale, mean, live, out);                           \
  }
SG_QUANT_V(fp8, true, f16, F16)
SG_QUANT_V(fp8, true, bf16, BF16)
SG_QUANT_V(fp16, false, f16, F16)
SG_QUANT_V(fp16, false, bf16, BF16)
