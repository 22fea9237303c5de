// sage_attention.hip: INT8 Q.K^T + FP8 (hip_int8_fp8) or FP16 (hip_int8_fp16) P.V attention for
// gfx12 wave32, consuming a quant.QuantizedQKV. Launch geometry lives in kernels/backends/hip/kernel_abi.py.
//
// Work split: a block of 8 waves owns BM = 128 query rows (16 per wave) and walks the keys in tiles
// of BN = 64. Each wave computes S^T = K Q^T (A = K tile rows, B = its 16 queries), so in the gfx12
// accumulator layout lane (r, h) holds query r and keys 8h + e: the row max and row sum stay in the
// lane plus one lane^16 exchange, and the probabilities are already the B operand of
// O^T = V^T P^T (element e of lane (r, h) = P[query r][key 8h + e]) with no data movement at all. (For the f16
// builtin that element's K is not 8h + e (gfx12_prelude.h); V^T's A element e is key 8h + e too, so the
// product still sums over the same keys.)
// One softmax rescale per key tile (online softmax in base 2, FP32 max/sum), exp2 only.
// Tiles every row sees completely run in a loop without masking code; the causal diagonal and the
// key tail run in a second loop with per-element masks (workgroup-uniform split, no padding copies:
// out-of-range rows are clamped to a valid row and masked).
namespace sg {

constexpr int ATT_THREADS = 256, ATT_WAVES = 8, BM = 16 * ATT_WAVES, BN = 64;

template <int D, bool FP8PV> struct __attribute__((aligned(16))) AttnSmem {
  static constexpr int K_STRIDE = D + 16;                          // bytes per key row (bank spread)
  static constexpr int VT_STRIDE = FP8PV ? BN + 16 : 2 * BN + 16;  // bytes per V^T channel row
  // One LDS buffer: the next tile's global loads overlap the current tile's math in registers.
  // (A double-buffered LDS variant made clang-19 keep ~90 more VGPRs live and spill on gfx1201.)
  u8 k[BN * K_STRIDE];
  u8 vt[D * VT_STRIDE];
  float ks[BN];  // k_scale (see unbias_dot)
};

// A key-only mask (the *_kmask entry points): the LDS tile also holds each key's FP32 base-2 bias. The unmasked
// kernels keep AttnSmem itself (same LDS).
template <int D, bool FP8PV> struct __attribute__((aligned(16))) AttnSmemKM : AttnSmem<D, FP8PV> { float kb[BN]; };
template <int D, bool FP8PV, bool KM> struct SmemOf { typedef AttnSmem<D, FP8PV> type; };
template <int D, bool FP8PV> struct SmemOf<D, FP8PV, true> { typedef AttnSmemKM<D, FP8PV> type; };

// A key-only mask's operands (kernel_abi.attention_plan): bias (1 or B, 1 or Hq, Nk) FP32 base 2, -inf on dead keys,
// its (batch, head) strides 0 where it broadcasts; end: 1 + the last live key of that row (the key loop stops there);
// fill (a bool mask): keys at -inf score -inf whatever q.k is (their staged k_scale becomes 0, so a NaN or Inf K
// cannot make the product NaN).
struct KeyMask {
  const float* bias;
  i64 sbb, sbh;
  const int* end;
  i64 seb, seh;
  int fill;
};

SG_INLINE i32x2 mk_i32x2(u32 x, u32 y) { i32x2 a = {(int)x, (int)y}; return a; }
SG_INLINE int imin(int a, int b) { return a < b ? a : b; }

// Words of one thread's staged tile, held in registers between the global load and the LDS store.
template <int D, bool FP8PV> struct Stage {
  static constexpr int KB = BN * D / ATT_THREADS;      // K bytes per thread (32 or 16)
  static constexpr int CPT = D / 16;                    // V channels per thread (4 keys each)
  static constexpr int VW = CPT * (FP8PV ? 1 : 2) / 4;  // V words per key row
  u32x4 k[KB / 16];
  u32 v[4][VW];
  float ks;
  float kb;  // the key bias (masked kernels only)
};

// Global -> registers for key tile starting at kt0; rows past Nk are clamped to Nk - 1 (masked later).
// Offsets inside one head are 32-bit (kernel_abi refuses heads of 2^31 bytes or more): the 64-bit (b, h)
// base stays uniform in SGPRs and the address is base + zext(offset).
template <int D, bool FP8PV, bool K_ONLY = false, bool KM = false>
SG_INLINE void stage_load(Stage<D, FP8PV>& st, const i8* kbase, const u8* vbase, const float* ksbase, int kt0, int Nk,
                          const float* kbbase = nullptr) {
  typedef Stage<D, FP8PV> S;
  const int t = tid_x();
  auto load_k = [&] {
    const int row = imin(kt0 + t / 4, Nk - 1), col = (t % 4) * S::KB;
    const u32x4* src = (const u32x4*)(kbase + (u32)(row * D + col));
    #pragma unroll
    for (int i = 0; i < S::KB / 16; ++i) st.k[i] = src[i];
  };
  if (K_ONLY) { load_k(); return; }
  {
    const int kg = t / 16, cg = t % 16;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = imin(kt0 + 4 * kg + j, Nk - 1);
      const u8* src = vbase + (u32)((row * D + cg * S::CPT) * (FP8PV ? 1 : 2));
      if (S::VW == 4) { u32x4 x = *(const u32x4*)src; st.v[j][0] = x.x; st.v[j][1] = x.y; st.v[j][2] = x.z; st.v[j][3] = x.w; }
      else if (S::VW == 2) { u32x2 x = *(const u32x2*)src; st.v[j][0] = x.x; st.v[j][1] = x.y; }
      else st.v[j][0] = *(const u32*)src;
    }
  }
  // Every thread loads a k_scale (4 threads per key) so that no lane-divergent branch is needed.
  st.ks = ksbase[(u32)imin(kt0 + (t & (BN - 1)), Nk - 1)];
  if constexpr (KM) st.kb = kbbase[(u32)imin(kt0 + (t & (BN - 1)), Nk - 1)];
  sched_fence();
  load_k();  // issued last, stored first (see stage_store)
}

// The same for a tile wholly inside [0, Nk) (no clamping), from per-lane byte offsets computed once before the
// key loop (make_stage_offsets): the tile's base is uniform (SGPRs), the offsets loop-invariant VGPRs and the
// V rows immediate offsets, so the key loop spends no VALU on addresses. Each call passes the offsets through
// lane_offset again (a loop-carried value, same register, no instruction): a 32-bit offset defined outside
// the loop reaches instruction selection as a hoisted 64-bit zext, and loads then take 64-bit VGPR addresses.
struct StageOffsets { u32 k, v, ks; };
template <int D, bool FP8PV> SG_INLINE StageOffsets make_stage_offsets() {
  typedef Stage<D, FP8PV> S;
  const int t = tid_x();
  StageOffsets o;
  o.k = lane_offset((t / 4) * D + (t % 4) * S::KB);
  o.v = lane_offset((4 * (t / 16) * D + (t % 16) * S::CPT) * (FP8PV ? 1 : 2));
  o.ks = lane_offset(4 * (t & (BN - 1)));
  return o;
}
template <int D, bool FP8PV, bool KM = false>
SG_INLINE void stage_load_whole(Stage<D, FP8PV>& st, StageOffsets& so, const i8* kbase, const u8* vbase,
                                const float* ksbase, int kt0, const float* kbbase = nullptr) {
  typedef Stage<D, FP8PV> S;
  so.k = lane_offset(so.k);
  so.v = lane_offset(so.v);
  so.ks = lane_offset(so.ks);
  constexpr int VB = FP8PV ? 1 : 2;  // bytes per V element
  const u8* kt = (const u8*)uniform_ptr(kbase + (i64)kt0 * D);
  const u8* vt = uniform_ptr(vbase + (i64)kt0 * D * VB);
  const u8* kst = (const u8*)uniform_ptr(ksbase + kt0);
  const u32x4* ksrc = (const u32x4*)(kt + so.k);
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u8* src = vt + so.v + j * D * VB;
    if (S::VW == 4) { u32x4 x = *(const u32x4*)src; st.v[j][0] = x.x; st.v[j][1] = x.y; st.v[j][2] = x.z; st.v[j][3] = x.w; }
    else if (S::VW == 2) { u32x2 x = *(const u32x2*)src; st.v[j][0] = x.x; st.v[j][1] = x.y; }
    else st.v[j][0] = *(const u32*)src;
  }
  st.ks = *(const float*)(kst + so.ks);
  if constexpr (KM) st.kb = *(const float*)((const u8*)uniform_ptr(kbbase + kt0) + so.ks);
  sched_fence();
  #pragma unroll
  for (int i = 0; i < S::KB / 16; ++i) st.k[i] = ksrc[i];  // issued last, stored first (see stage_store)
}

// Scores without an int -> float conversion. The Q.K chain starts from C = QK_BIAS (the bits of 1/(2 pi), an
// inline constant of the WMMA, no registers) instead of 0, so the INT32 result read as a float is
// f = QK_BIAS_F + dot * 2^-26 exactly: |dot| <= 128 * 128 * 128 = 2^21 keeps the biased mantissa inside one
// binade (QK_BIAS's mantissa field is 0x22F983 > 2^21, and 2^23 - 0x22F983 > 2^21). Then
// fma(f, 2^26, -QK_BIAS_F * 2^26) is dot exactly (f * 2^26 = 2^23 + 0x22F983 + dot, integers below 2^24; the
// constant is the integer 2^23 + 0x22F983), and dot * k_scale rounds once: the same bits as (float)dot * k_scale,
// NaN/Inf included (0 * inf = NaN, -inf stays -inf). The FMA pairs as VOPD (v_dual_fmaak_f32) where
// v_cvt_f32_i32 never pairs, and k_scale is staged as loaded (no multiply).
constexpr int QK_BIAS = 0x3E22F983;
constexpr float QK_BIAS_F = 0.15915494f;  // == bit_cast<float>(QK_BIAS), exactly
constexpr float QK_SCALE_UP = 67108864.0f;  // 2^26
SG_INLINE float unbias_dot(int biased_dot) {  // dot, exact
  return fma_(bit_cast<float>(biased_dot), QK_SCALE_UP, -QK_BIAS_F * QK_SCALE_UP);
}

// fp8 V^T keeps keys in an order with bits 3 and 4 swapped, so that one 16-byte LDS read gives a
// lane its A operand for two consecutive 16-key steps (see pv_step).
SG_INLINE int vt_pos(int key) { return (key & ~24) | ((key & 8) << 1) | ((key & 16) >> 1); }

// Registers -> LDS: K rows as they are, V transposed (4 keys x CPT channels per thread, v_perm).
// The K rows are stored first and their global loads are issued last (stage_load, stage_load_whole): global loads
// complete in order, so the one s_wait_loadcnt 0 before the K store covers the V rows and k_scale too, instead of
// one partial wait per group (clang-19 schedules the V transposition first otherwise; the fence keeps this order).
template <int D, bool FP8PV, class SM = AttnSmem<D, FP8PV>, bool KM = false>
SG_INLINE void stage_store(const Stage<D, FP8PV>& st, SM& sm, int fill = 0) {
  typedef Stage<D, FP8PV> S;
  typedef AttnSmem<D, FP8PV> M;
  const int t = tid_x();
  {
    u32x4* dst = (u32x4*)(sm.k + (t / 4) * M::K_STRIDE + (t % 4) * S::KB);
    #pragma unroll
    for (int i = 0; i < S::KB / 16; ++i) dst[i] = st.k[i];
  }
  sched_fence();
  const int kg = t / 16, cg = t % 16, k0 = 4 * kg;
  #pragma unroll
  for (int w = 0; w < S::VW; ++w) {
    const u32 r0 = st.v[0][w], r1 = st.v[1][w], r2 = st.v[2][w], r3 = st.v[3][w];
    if (FP8PV) {
      const u32 lo01 = byte_perm(r0, r1, 0x5140u), hi01 = byte_perm(r0, r1, 0x7362u);
      const u32 lo23 = byte_perm(r2, r3, 0x5140u), hi23 = byte_perm(r2, r3, 0x7362u);
      const u32 ch[4] = {byte_perm(lo01, lo23, 0x5410u), byte_perm(lo01, lo23, 0x7632u),
                         byte_perm(hi01, hi23, 0x5410u), byte_perm(hi01, hi23, 0x7632u)};
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = cg * S::CPT + 4 * w + i;
        *(u32*)(sm.vt + c * M::VT_STRIDE + vt_pos(k0)) = ch[i];
      }
    } else {
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int c = cg * S::CPT + 2 * w + i;
        const u32 sel = i ? 0x7632u : 0x5410u;
        u32x2 p;
        p.x = byte_perm(r0, r1, sel);
        p.y = byte_perm(r2, r3, sel);
        *(u32x2*)(sm.vt + c * M::VT_STRIDE + 2 * k0) = p;
      }
    }
  }
  if constexpr (KM) {
    sm.ks[t & (BN - 1)] = fill && st.kb == neg_inf() ? 0.0f : st.ks;  // a bool mask's masked key: score -inf
    sm.kb[t & (BN - 1)] = st.kb;
  } else {
    sm.ks[t & (BN - 1)] = st.ks;  // 4 identical writes per slot, no branch
  }
}

// Q fragments, the B operand of S^T = K Q^T. The contraction order over d is ours to choose as long
// as A and B agree: step s = 2c + u, lane half h, element e <-> d = 32c + 16h + 8u + e, so each lane
// reads 16 contiguous bytes of its row for two steps (one ds_read_b128 of K per two v_wmma).
template <int D> struct QFrag { u32x4 w[D / 32]; };
template <int D> SG_INLINE void load_q(QFrag<D>& qf, const i8* qrow_ptr) {
  const u32x4* src = (const u32x4*)(qrow_ptr + 16 * (lane_id() >> 4));
  #pragma unroll
  for (int c = 0; c < D / 32; ++c) qf.w[c] = src[2 * c];
}

// INT32 S^T for key rows 16j .. 16j+15 of the LDS tile: lane (r, h), element e <-> key 16j + 8h + e.
template <int D>
SG_INLINE i32x8 qk_subtile(const QFrag<D>& qf, const u8* ktile, int k_stride, int j) {
  const int l = lane_id();
  const u8* krow = ktile + (16 * j + (l & 15)) * k_stride + 16 * (l >> 4);
  i32x8 acc = {};
  #pragma unroll
  for (int c = 0; c < D / 32; ++c) {
    const u32x4 kv = *(const u32x4*)(krow + 32 * c);
    acc = wmma_iu8(mk_i32x2(kv.x, kv.y), mk_i32x2(qf.w[c].x, qf.w[c].y), acc);
    acc = wmma_iu8(mk_i32x2(kv.z, kv.w), mk_i32x2(qf.w[c].z, qf.w[c].w), acc);
  }
  return acc;
}

// The same for all four 16-key subtiles of the tile at once (acc[j]: key rows 16j .. 16j+15). The four chains
// run interleaved over d: per 32-byte chunk of d one LDS read per subtile and one wait, and a chain's
// consecutive WMMAs sit four apart (no stall between them). The accumulators become the scores in place.
template <int D>
SG_INLINE void qk_tile(i32x8* acc, const QFrag<D>& qf, const u8* ktile, int k_stride) {
  const int l = lane_id();
  const u8* krow = ktile + (l & 15) * k_stride + 16 * (l >> 4);
  #pragma unroll
  for (int j = 0; j < 4; ++j)
    #pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = QK_BIAS;  // biased chains: see unbias_dot
  #pragma unroll
  for (int c = 0; c < D / 32; ++c) {
    // Reads issued in reverse order of use: LDS reads complete in order, so the first WMMA's wait (for the
    // last read issued) covers the others and the chunk needs one s_wait_dscnt instead of four.
    u32x4 kv[4];
    #pragma unroll
    for (int j = 3; j >= 0; --j) kv[j] = *(const u32x4*)(krow + 16 * j * k_stride + 32 * c);
    sched_fence();  // the scheduler would otherwise serialise the chains again (fewer live registers)
    #pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] = wmma_iu8(mk_i32x2(kv[j].x, kv[j].y), mk_i32x2(qf.w[c].x, qf.w[c].y), acc[j]);
    #pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] = wmma_iu8(mk_i32x2(kv[j].z, kv[j].w), mk_i32x2(qf.w[c].z, qf.w[c].w), acc[j]);
    sched_fence();
  }
}

template <int D, bool FP8PV> struct PFrag;
template <int D> struct PFrag<D, true> { i32x2 p[4]; };
template <int D> struct PFrag<D, false> { f16x8 p[4]; };

// O^T[16tt + 8h + e][query r] = alpha * O^T + V^T P^T over the 64 keys of the tile (the online-softmax
// rescale folded in). Two-level accumulation: each 16-channel block's product over the tile is chained
// through the tile's WMMA steps from a zero C and only then added to the FP32 accumulator, with one FMA
// per element (o = fma(o, alpha, t), which replaces the separate o *= alpha). A matrix unit whose
// accumulator keeps fewer bits than FP32 (NVIDIA's FP8 MMA keeps ~13) then only rounds one tile's sum,
// never the small increment of a tile against the large running total of a long diffuse row.
// SC (the single-chain variant, for a unit whose accumulator keeps full FP32: probes.py reads it at first use):
// every WMMA step accumulates into o itself, no fold; attend_tile rescales o only on a tile whose shift moved
// (FP16: the running max grew; FP8's shift follows each tile's max, so only FP16 ships it, kernel_abi).
// SG_PV_SINGLE_CHAIN=1 (verification only) makes every kernel a single chain, FP8 included.
#ifndef SG_PV_SINGLE_CHAIN
#define SG_PV_SINGLE_CHAIN 0
#endif
// o * alpha + t as one three-address v_fma_f32. Written as plain C, clang-19 selects v_fmac_f32 (destination
// tied to the addend t) for some elements, which moves those accumulator elements into the WMMA temp's
// registers, adds copies on the loop's back edge and costs ~30 VGPRs (FP8 D128: 167 -> 196-201, 9 -> 7
// waves per SIMD); the VOP3 form keeps every accumulator element in its own register (167, as before).
SG_INLINE float fold_acc(float o, float alpha, float t) {
#if defined(SG_AMD)
  float r;
  asm("v_fma_f32 %0, %1, %2, %3" : "=v"(r) : "v"(o), "v"(alpha), "v"(t));
  return r;
#else
  return fma_(o, alpha, t);
#endif
}
template <bool SC> SG_INLINE void pv_begin(f32x8& t, const f32x8& o) {
  #pragma unroll
  for (int e = 0; e < 8; ++e) t[e] = SC ? o[e] : 0.0f;
}
template <bool SC> SG_INLINE void pv_end(f32x8& o, const f32x8& t, float alpha) {
  #pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = SC ? t[e] : fold_acc(o[e], alpha, t[e]);
}
// Two 16-channel blocks at a time: their chains interleave (a chain's consecutive WMMAs sit two apart) and
// their V^T reads are issued together, the first one used issued last (LDS reads complete in order, so one
// wait covers the batch). (Four blocks at a time at D64 spill at 12 waves per SIMD, for no fewer instructions.)
template <int D, bool SC>
SG_INLINE void pv_tile(f32x8* o, float alpha, const PFrag<D, true>& pf, const u8* vt, int vt_stride) {
  const int l = lane_id();
  const u8* base = vt + (l & 15) * vt_stride + 16 * (l >> 4);
  #pragma unroll
  for (int tt = 0; tt < D / 16; tt += 2) {
    u32x4 a[2][2];  // [block][16-byte read]: one read holds a lane's A operand for two 16-key steps
    #pragma unroll
    for (int m = 1; m >= 0; --m)
      #pragma unroll
      for (int u = 1; u >= 0; --u) {
        if (m == 0 && u == 0) sched_fence();  // the first read used stays the last issued
        a[u][m] = *(const u32x4*)(base + 16 * (tt + u) * vt_stride + 32 * m);
      }
    sched_fence();
    f32x8 t[2];
    #pragma unroll
    for (int u = 0; u < 2; ++u) pv_begin<SC>(t[u], o[tt + u]);
    #pragma unroll
    for (int m = 0; m < 2; ++m) {
      #pragma unroll
      for (int u = 0; u < 2; ++u) t[u] = wmma_fp8(mk_i32x2(a[u][m].x, a[u][m].y), pf.p[2 * m], t[u]);
      #pragma unroll
      for (int u = 0; u < 2; ++u) t[u] = wmma_fp8(mk_i32x2(a[u][m].z, a[u][m].w), pf.p[2 * m + 1], t[u]);
    }
    if (D != 64) sched_fence();  // D64: fences left out where clang-19 then schedules tighter (README, HIP kernels)
    #pragma unroll
    for (int u = 0; u < 2; ++u) pv_end<SC>(o[tt + u], t[u], alpha);
  }
}
template <int D, bool SC>
SG_INLINE void pv_tile(f32x8* o, float alpha, const PFrag<D, false>& pf, const u8* vt, int vt_stride) {
  const int l = lane_id();
  const u8* base = vt + (l & 15) * vt_stride + 16 * (l >> 4);
  #pragma unroll
  for (int tt = 0; tt < D / 16; tt += 2) {
    u32x4 a[2][4];
    #pragma unroll
    for (int j = 3; j >= 0; --j)
      #pragma unroll
      for (int u = 1; u >= 0; --u) {
        if (j == 0 && u == 0) sched_fence();  // the first read used stays the last issued (one wait)
        a[u][j] = *(const u32x4*)(base + 16 * (tt + u) * vt_stride + 32 * j);
      }
    sched_fence();
    f32x8 t[2];
    #pragma unroll
    for (int u = 0; u < 2; ++u) pv_begin<SC>(t[u], o[tt + u]);
    #pragma unroll
    for (int j = 0; j < 4; ++j)
      #pragma unroll
      for (int u = 0; u < 2; ++u) t[u] = wmma_f16(bit_cast<f16x8>(a[u][j]), pf.p[j], t[u]);
    if (D != 64) sched_fence();  // D64: the folds may move among the WMMAs (-2 instructions per tile, clang-19)
    #pragma unroll
    for (int u = 0; u < 2; ++u) pv_end<SC>(o[tt + u], t[u], alpha);
  }
}

// o *= alpha (the single chain's rescale), the odd elements by a second copy of alpha, so that two multiplications
// pair as one VOPD v_dual_mul_f32 (vgpr_copy). D128 takes the copies as a register pair (vgpr_pair: always pairs);
// at D64 the pair's register costs the key loop's fast path 2 instructions (clang-19), and one copy pairs there.
template <int D> SG_INLINE void rescale_o(f32x8* o, float alpha) {
  const FloatPair a = D == 128 ? vgpr_pair(alpha) : FloatPair{alpha, vgpr_copy(alpha)};
  #pragma unroll
  for (int tt = 0; tt < D / 16; ++tt)
    #pragma unroll
    for (int e = 0; e < 8; ++e) o[tt][e] *= e & 1 ? a.odd : a.even;
}

// Probabilities of key step j into the B operand (element e in byte/half e of the fragment).
template <int D> SG_INLINE void pack_p(PFrag<D, true>& pf, int j, const float* p) {
  pf.p[j] = mk_i32x2(pack_e4m3x4(p[0], p[1], p[2], p[3]), pack_e4m3x4(p[4], p[5], p[6], p[7]));
}
template <int D> SG_INLINE void pack_p(PFrag<D, false>& pf, int j, const float* p) {
  u32x4 w;
  w.x = pack_f16x2(p[0], p[1]); w.y = pack_f16x2(p[2], p[3]); w.z = pack_f16x2(p[4], p[5]); w.w = pack_f16x2(p[6], p[7]);
  pf.p[j] = bit_cast<f16x8>(w);
}

// Per-lane online-softmax state: this lane's query row, half of its keys.
template <int D, bool FP8PV> struct RowState {
  f32x8 o[D / 16];
  float bias;  // the shift of o and l (base 2): FP16 p_shift of the running max, FP8 that of the last tile's max
               // (floored, see attend_tile); -inf while the row has seen no key
  float l;     // this lane's share of the running row sum (up to 448 per key for FP8 P)
  float floor;  // FP8: p_shift of the row's running max less FP8_TILE_SHIFT_RANGE (the lowest shift a tile takes)
  float qscale;
  // The lane's query row. D128 recomputes it from the block's first row (uniform: an SGPR), which frees the VGPR
  // that FP8's floor takes across the key loop; D64 keeps it (recomputing costs it 0.07-0.25 per v_wmma, clang-19).
  int q0, row;
  SG_INLINE int qrow() const { return D == 64 ? row : q0 + 16 * wave_id() + (lane_id() & 15); }
};

// The softmax shift of a row whose max score is m (units of int-dot * k_scale): P = exp2(s * qscale - shift).
// FP16 P: m * qscale - FP16_P_LOG2_MAX (P <= 2^15: every weight above 2^-29 of the max is an fp16 normal, so a
// WMMA that flushes subnormal inputs loses nothing that counts; output and row sum do not depend on the scale, the
// LSE takes it back through the shift). FP8 P: the max's P is exp2(FP8_P_LOG2_MAX) = 447.9953, below 448 by 1.1e-5
// relative, far more than v_exp_f32's error (1 ulp, 1.2e-7). m * qscale - FP8_P_LOG2_MAX is rounded, by up to half
// an ulp of its value; raised by |bias| * 2^-23 (at least one ulp of bias, never less after rounding) it is >= the
// exact value, so for every s <= m, fma(s, qscale, -shift) <= FP8_P_LOG2_MAX after rounding (rounding is
// monotone; a bias so small that the raise rounds away leaves an error below that fma's own rounding). So no P
// above 448 reaches v_cvt_pk_fp8_f32, which has no clamp bit on gfx12, whatever the scores.
// Both maps are monotone in m, so the shift of a running max is the max of the shifts: the row state keeps the
// shift (FP8 also its floor). (FP8: m = -inf gives NaN, which fmax drops; qscale > 0, or NaN, which makes the row NaN as it should.)
constexpr float FP8_P_LOG2_MAX = 8.80733967f;  // fp32 nearest log2(448) - 2^-16
constexpr float FP16_P_LOG2_MAX = 15.0f;
// FP8: a tile's shift stays within this of the running max's, so o and l (units of exp2(-shift)) stay below
// 2^(64 + 8.8) per key times |V|: far from FP32's overflow for any key count.
constexpr float FP8_TILE_SHIFT_RANGE = 64.0f;
template <bool FP8PV> SG_INLINE float p_shift(float m, float qscale) {
  if (!FP8PV) return fma_(m, qscale, -FP16_P_LOG2_MAX);
  const float bias = fma_(m, qscale, -FP8_P_LOG2_MAX);
  return fma_(fabs_(bias), 1.1920929e-07f, bias);  // + |bias| * 2^-23
}
// The masked kernels' shift: their scores are whole base-2 scores, rounded (qscale and the key bias applied), so
// m is a score itself. Where FP8_P_LOG2_MAX vanishes in m's rounding (|m| >= 2^28) the shift is m with no raise:
// s - m <= 0 for every score, P <= 1; the raise would put every P of a row near -FP32 max (a -finfo.max mask on
// every key, which SDPA averages uniformly) to 0. m = -inf stays -inf (no NaN: the row has seen no live key).
template <bool FP8PV> SG_INLINE float p_shift_scores(float m) {
  if (!FP8PV) return m - FP16_P_LOG2_MAX;
  const float c = m - FP8_P_LOG2_MAX;
  return c == m ? c : fma_(fabs_(c), 1.1920929e-07f, c);
}

// `prefetch` issues the next tile's global loads once the scores are out of the WMMA accumulators: their
// registers then overlap the softmax and P.V, not the Q.K phase, where the key loop's register peak is.
// KM (a key-only mask): each score becomes the whole base-2 score s * qscale + the key's bias (the tile's biases
// in LDS, `key_bias`), so the shift and P take qscale 1; a row may see no live key in any tile.
template <int D, bool FP8PV, bool SC, bool MASK, bool KM, class Prefetch>
SG_INLINE void attend_tile(RowState<D, FP8PV>& rs, const QFrag<D>& qf, const AttnSmem<D, FP8PV>& sm,
                           int kt0, int Nk, int causal, const Prefetch& prefetch, const float* key_bias = nullptr) {
  typedef AttnSmem<D, FP8PV> M;
  const int h = lane_id() >> 4;
  float s[4][8];
  // Masked tiles: key visible iff key <= last (tail: Nk - 1; causal: also the query row).
  const int last = causal ? imin(Nk - 1, rs.qrow()) : Nk - 1;
  i32x8 acc4[4];
  qk_tile<D>(acc4, qf, sm.k, M::K_STRIDE);
  if constexpr (!MASK) {
    // The k_scale reads of two subtiles at a time, the first one used issued last (one wait per pair); the 32
    // unbiasing FMAs, which need none of them, run under the first pair's latency, in VOPD pairs as the
    // multiplications after them. All four subtiles' reads at once (one wait) only for FP16 P.V D64: the FP8
    // kernels spill with them and FP16 D128 gains nothing.
    constexpr int G = D == 64 && !FP8PV ? 4 : 2;
    // KM: the keys' biases are read in the same batches, issued first (the one wait covers them), except for FP16
    // D64, whose batch of four then spills: there they follow in a pass of their own (clang-19).
    constexpr bool BIAS_IN_BATCH = KM && G == 2;
    #pragma unroll
    for (int j0 = 0; j0 < 4; j0 += G) {
      u32x4 kq[G][2];
      u32x4 bq[G][2];
      if constexpr (BIAS_IN_BATCH) {
        #pragma unroll
        for (int i = 2 * G - 1; i >= 0; --i)
          bq[i / 2][i % 2] = *(const u32x4*)(key_bias + 16 * (j0 + i / 2) + 8 * h + 4 * (i % 2));
      }
      #pragma unroll
      for (int i = 2 * G - 1; i >= 0; --i) {
        if (i == 0) sched_fence();
        kq[i / 2][i % 2] = *(const u32x4*)(sm.ks + 16 * (j0 + i / 2) + 8 * h + 4 * (i % 2));
      }
      sched_fence();  // (FP8 D64 was 4 instructions shorter without it until the shift became p_shift, clang-19)
      if (j0 == 0) {
        #pragma unroll
        for (int j = 0; j < 4; ++j)
          #pragma unroll
          for (int e = 0; e < 8; ++e) s[j][e] = unbias_dot(acc4[j][e]);
        if (D != 64) sched_fence();  // D64: left out, as the fences marked D64 below (README, HIP kernels)
      }
      #pragma unroll
      for (int jj = 0; jj < G; ++jj) {
        const u32x4 ka = kq[jj][0], kb = kq[jj][1];
        const u32 km[8] = {ka.x, ka.y, ka.z, ka.w, kb.x, kb.y, kb.z, kb.w};
        #pragma unroll
        for (int e = 0; e < 8; ++e) s[j0 + jj][e] *= bit_cast<float>(km[e]);
        if constexpr (BIAS_IN_BATCH) {
          const u32 bm[8] = {bq[jj][0].x, bq[jj][0].y, bq[jj][0].z, bq[jj][0].w,
                             bq[jj][1].x, bq[jj][1].y, bq[jj][1].z, bq[jj][1].w};
          #pragma unroll
          for (int e = 0; e < 8; ++e) s[j0 + jj][e] = fma_(s[j0 + jj][e], rs.qscale, bit_cast<float>(bm[e]));
        }
      }
    }
    if constexpr (KM && !BIAS_IN_BATCH) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32x4 ba = *(const u32x4*)(key_bias + 16 * j + 8 * h);
        const u32x4 bb = *(const u32x4*)(key_bias + 16 * j + 8 * h + 4);
        const u32 bm[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
        #pragma unroll
        for (int e = 0; e < 8; ++e) s[j][e] = fma_(s[j][e], rs.qscale, bit_cast<float>(bm[e]));
      }
    }
  } else {
    // Masked tiles (the causal diagonal, the key tail): fewer live registers, a subtile at a time.
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32x4 ka = *(const u32x4*)(sm.ks + 16 * j + 8 * h);
      const u32x4 kb = *(const u32x4*)(sm.ks + 16 * j + 8 * h + 4);
      const u32 km[8] = {ka.x, ka.y, ka.z, ka.w, kb.x, kb.y, kb.z, kb.w};
      float bias[8] = {};
      if constexpr (KM) {
        const u32x4 ba = *(const u32x4*)(key_bias + 16 * j + 8 * h);
        const u32x4 bb = *(const u32x4*)(key_bias + 16 * j + 8 * h + 4);
        const u32 bm[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
        #pragma unroll
        for (int e = 0; e < 8; ++e) bias[e] = bit_cast<float>(bm[e]);
      }
      #pragma unroll
      for (int e = 0; e < 8; ++e) {
        float v = unbias_dot(acc4[j][e]) * bit_cast<float>(km[e]);
        if constexpr (KM) v = fma_(v, rs.qscale, bias[e]);
        s[j][e] = kt0 + 16 * j + 8 * h + e <= last ? v : neg_inf();
      }
    }
  }
  prefetch();
  if (!(D == 64 && !FP8PV)) sched_fence();  // FP16 D64: left out (README, HIP kernels)
  float mj[4];
  #pragma unroll
  for (int j = 0; j < 4; ++j)
    mj[j] = fmax_(fmax_(fmax_(s[j][0], s[j][1]), fmax_(s[j][2], s[j][3])), fmax_(fmax_(s[j][4], s[j][5]), fmax_(s[j][6], s[j][7])));
  const float mx = fmax_(fmax_(mj[0], mj[1]), fmax_(mj[2], mj[3]));  // this lane's half of the row
  // The tile's shift, from this lane's and the other half's (lane ^ 16) max and the row state: one v_max3.
  const float qs = KM ? 1.0f : rs.qscale;  // KM: the scores carry qscale already
  const float sh = KM ? p_shift_scores<FP8PV>(mx) : p_shift<FP8PV>(mx, rs.qscale);
  const float sh_other = lane_xor16_full_wave(sh);
  float bias_new;
  if constexpr (FP8PV) {
    // FP8 P takes this tile's own max as its top (448), not the row's running max: the tile's weights down to
    // 2^-14.8 of its max are e4m3 normals, so a WMMA that flushes subnormal inputs drops at most 63 keys below
    // that per tile (< 0.3 % of the tile's mass) where the row sum still counts them. o and l move to the shift.
    // The shift stays at most FP8_TILE_SHIFT_RANGE below the running max's (rs.floor, updated after P.V, where
    // fewer registers are live): the same v_max3 as the running max alone.
    bias_new = fmax_(fmax_(sh, sh_other), rs.floor);
  } else {
    bias_new = fmax_(fmax_(rs.bias, sh), sh_other);
  }
  // A row that has seen no key yet keeps the shift -inf: its P use the shift of m = 0 (exact zeros).
  const float bias = (MASK || KM) && bias_new == neg_inf() ? p_shift<FP8PV>(0.0f, qs) : bias_new;
  // o and l move from the last tile's shift to this one's: exactly the shifts their P used (FP8: P < 448).
  // FAST: the unmasked single chain, whose fast path (no lane's shift moved) needs no alpha (see below).
  constexpr bool FAST = SC && !MASK && !KM && !FP8PV;
  float alpha = FAST ? 1.0f : fast_exp2(rs.bias - bias);
  PFrag<D, FP8PV> pf;
  float part[4];  // independent partial sums: short dependency chains
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    float p[8];
    #pragma unroll
    for (int e = 0; e < 8; ++e) p[e] = fast_exp2(fma_(s[j][e], qs, -bias));
    if constexpr (FP8PV) {  // the sum first: the conversion may then reuse P's registers (pack_e4m3x4)
      part[j] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
      pack_p(pf, j, p);
    } else {
      pack_p(pf, j, p);
      // FP16 P: the row sum adds the fp16 P that P.V uses, two per instruction (add_f16x2), so the output is
      // an exact convex combination of V rows up to FP32 rounding. Against the spec's sum of unrounded p the
      // relative difference is below 2^-11 (fp16 rounding of each term, mostly cancelling).
      const u32x4 w = bit_cast<u32x4>(pf.p[j]);
      part[j] = add_f16x2(w.w, add_f16x2(w.z, add_f16x2(w.y, add_f16x2(w.x, 0.0f))));
    }
  }
  const float tile_sum = (part[0] + part[1]) + (part[2] + part[3]);
  if constexpr (FAST) {
    // Where no lane's shift moved (no row's max grew), o, l and the shift stay as they are: l + tile_sum is what
    // fma(l, alpha = 1, tile_sum) gives, and no exp2 runs. Equal shifts compare equal without the subtraction
    // (bias_new >= rs.bias, neither is NaN); a shift at +-inf on both sides (alpha NaN) only meets a row whose
    // P are NaN already.
    float l = rs.l + tile_sum;
    if (wave_any(bias_new != rs.bias)) {
      alpha = fast_exp2(rs.bias - bias_new);
      l = fold_acc(rs.l, alpha, tile_sum);
      rescale_o<D>(rs.o, alpha);
      rs.bias = bias_new;  // here only: the fast path keeps the register (no copy on the back edge)
    }
    rs.l = l;
  } else {
    rs.l = fold_acc(rs.l, alpha, tile_sum);  // VOP3: no copy on the back edge
    rs.bias = bias_new;
    if (D != 64 || FP8PV) sched_fence();  // FP16 D64: left out (README, HIP kernels); FP8 D64: -2 per tile (clang-19)
    if constexpr (SC) {
      // The masked tiles' single chain rescales o only on a tile whose shift moved in some lane (alpha is exactly 1
      // elsewhere).
      if (wave_any(alpha != 1.0f)) rescale_o<D>(rs.o, alpha);
    }
  }
  pv_tile<D, SC>(rs.o, alpha, pf, sm.vt, M::VT_STRIDE);
  // max(running max, this tile's max) - range = max(floor, shift - range): the shift is the tile's max or the floor.
  if constexpr (FP8PV) rs.floor = fmax_(rs.floor, bias_new - FP8_TILE_SHIFT_RANGE);
  if (D != 64) sched_fence();  // D64: the last folds may meet the loop's tail (left out, README, HIP kernels)
}


// The whole attention for one block of BM query rows of one (batch, q head). SC_: the single P.V chain. KM: with a
// key-only mask (`km`).
template <int D, bool FP8PV, bool SC_, class T, bool KM = false>
SG_INLINE void attention(const i8* q8, const float* q_scale, const i8* k8, const float* k_scale, const u8* v,
                         const float* v_scale, const float* v_mean, int Hq, int Hkv, int Nq, int Nk, int causal,
                         u16* out, i64 osb, i64 osh, i64 osn, float* lse,
                         const u16* q, i64 qsb, i64 qsh, i64 qsn, i64 qsd, const float* k_mean, float sm_scale,
                         const KeyMask& km = KeyMask()) {
  typedef typename SmemOf<D, FP8PV, KM>::type M;
  constexpr bool SC = SC_ || SG_PV_SINGLE_CHAIN;
  SG_SHARED M sm;
  const int hq = bid_y(), b = bid_z(), hk = hq / (Hq / Hkv);
  const int lane = lane_id(), h = lane >> 4;
  const int q0 = bid_x() * BM;
  const i64 bhq = (i64)b * Hq + hq, bhk = (i64)b * Hkv + hk;
  const i8* kbase = k8 + bhk * Nk * D;
  const u8* vbase = v + bhk * Nk * D * (FP8PV ? 1 : 2);
  const float* ksbase = k_scale + bhk * Nk;
  // KM: the keys from the mask row's end on are dead (bias -inf): the tiling below runs over [0, Nk_used) only.
  const float* kbbase = KM ? km.bias + (i64)b * km.sbb + (i64)hq * km.sbh : nullptr;
  const int Nk_used = KM ? km.end[(i64)b * km.seb + (i64)hq * km.seh] : Nk;

  RowState<D, FP8PV> rs;
  rs.q0 = q0;
  rs.row = q0 + 16 * wave_id() + (lane & 15);
  const int qr = imin(rs.qrow(), Nq - 1);
  QFrag<D> qf;
  load_q<D>(qf, q8 + (bhq * Nq + qr) * D);
  rs.qscale = q_scale[bhq * Nq + qr];
  rs.bias = neg_inf();  // the first tile's alpha: exp2(-inf) = 0 (o and l are 0)
  rs.floor = neg_inf();
  rs.l = 0.0f;
  #pragma unroll
  for (int tt = 0; tt < D / 16; ++tt)
    #pragma unroll
    for (int e = 0; e < 8; ++e) rs.o[tt][e] = 0.0f;

  // Key tiles: [0, n_full) are fully visible to every row of the block, [n_full, n_tiles) need masks.
  // Tiles [0, n_whole) lie wholly inside [0, Nk): the unmasked loop runs while the tile it prefetches is one of
  // them (no clamping, uniform addresses); the rest, at most one unmasked tile more, goes through the masked loop
  // (its masks then keep everything).
  const int kv_end = causal ? imin(Nk_used, q0 + BM) : Nk_used;
  const int n_tiles = (kv_end + BN - 1) / BN;
  const int n_whole = Nk_used / BN;
  const int n_full = imin(n_whole, causal ? (q0 + 1) / BN : n_whole);
  const int n_main = imin(n_full, imin(n_whole, n_tiles) - 1);
  // One LDS buffer: store tile i, barrier, compute tile i (issuing tile i+1's global loads after its Q.K), barrier.
  Stage<D, FP8PV> st;
  StageOffsets so = make_stage_offsets<D, FP8PV>();
  const float* kb_lds = nullptr;
  if constexpr (KM) kb_lds = sm.kb;
  if (n_tiles > 0) stage_load<D, FP8PV, false, KM>(st, kbase, vbase, ksbase, 0, Nk_used, kbbase);
  int i = 0;
  for (; i < n_main; ++i) {
    stage_store<D, FP8PV, M, KM>(st, sm, km.fill);
    block_sync();
    attend_tile<D, FP8PV, SC, false, KM>(rs, qf, sm, i * BN, Nk_used, causal,
                                 [&] { stage_load_whole<D, FP8PV, KM>(st, so, kbase, vbase, ksbase, (i + 1) * BN,
                                                                      kbbase); }, kb_lds);
    block_sync_lds();  // the next tile's global loads stay in flight across it
  }
  for (; i < n_tiles; ++i) {
    stage_store<D, FP8PV, M, KM>(st, sm, km.fill);
    block_sync();
    if (i + 1 < n_tiles) stage_load<D, FP8PV, false, KM>(st, kbase, vbase, ksbase, (i + 1) * BN, Nk_used, kbbase);
    attend_tile<D, FP8PV, SC, true, KM>(rs, qf, sm, i * BN, Nk_used, causal, [] {}, kb_lds);
    block_sync();
  }

  // Epilogue: out = acc / row_sum * v_scale (the x448 of FP8 P cancels between acc and sum), plus V's
  // channel mean with smooth_v (v_mean != nullptr). Dividing first keeps acc * v_scale from overflowing
  // FP32 (V near the bf16 max); the cast saturates (FP8 rounding of P lifts a convex combination of V up
  // to ~6 % above max|V|: fp16 V at 65504 would be Inf) and keeps NaN. Only a row that saw no key has
  // l_tot == 0 (zeros out, without the mean); a NaN row sum (NaN or Inf in q or k) must stay NaN, so it
  // is not tested with `> 0`.
  const float l_tot = rs.l + lane_xor<16>(rs.l);
  const float inv = l_tot == 0.0f ? 0.0f : 1.0f / l_tot;
  if (rs.qrow() < Nq) {
    u16* orow = out + (i64)b * osb + (i64)hq * osh + (i64)rs.qrow() * osn;
    const float* vs = v_scale + bhk * D;
    const float* vm = v_mean && l_tot != 0.0f ? v_mean + bhk * D : nullptr;
    #pragma unroll
    for (int tt = 0; tt < D / 16; ++tt) {
      const int c0 = 16 * tt + 8 * h;
      float y[8];
      #pragma unroll
      for (int e = 0; e < 8; ++e) y[e] = rs.o[tt][e] * inv * vs[c0 + e];
      if (vm) {
        #pragma unroll
        for (int e = 0; e < 8; ++e) y[e] += vm[c0 + e];
      }
      u32 w[4];
      #pragma unroll
      for (int e = 0; e < 8; e += 2) w[e / 2] = (u32)T::store_sat(y[e]) | ((u32)T::store_sat(y[e + 1]) << 16);
      u32x4 pk;
      pk.x = w[0]; pk.y = w[1]; pk.z = w[2]; pk.w = w[3];
      *(u32x4*)(orow + c0) = pk;
    }
  }
  if (lse) {
    // Natural-log LSE; with smooth_k, add back q . k_mean * sm_scale (each half-wave sums half of d).
    float corr = 0.0f;
    if (k_mean) {
      const u16* qrow_ptr = q + (i64)b * qsb + (i64)hq * qsh + (i64)imin(rs.qrow(), Nq - 1) * qsn;
      const float* km = k_mean + bhk * D;
      for (int d = h * (D / 2); d < (h + 1) * (D / 2); ++d) corr = fma_(T::load(qrow_ptr[(i64)d * qsd]), km[d], corr);
      corr = (corr + lane_xor<16>(corr)) * sm_scale;
    }
    const float base2 = rs.bias + fast_log2(l_tot);  // l_tot is in units of exp2(-rs.bias)
    const float val = l_tot == 0.0f ? neg_inf() : base2 * LN2 + corr;  // NaN row sum: NaN LSE
    if (h == 0 && rs.qrow() < Nq) lse[bhq * Nq + rs.qrow()] = val;
  }
}

// Debug/verification kernel: the INT32 Q.K^T products through the same LDS staging and WMMA
// fragments as attention (scores[b, hq, q, key], row-major, Nq x Nk per head).
template <int D>
SG_INLINE void qk_scores(const i8* q8, const i8* k8, int Hq, int Hkv, int Nq, int Nk, int* scores) {
  typedef AttnSmem<D, true> M;
  SG_SHARED M sm;
  const int hq = bid_y(), b = bid_z(), hk = hq / (Hq / Hkv);
  const int lane = lane_id(), h = lane >> 4;
  const i64 bhq = (i64)b * Hq + hq, bhk = (i64)b * Hkv + hk;
  const int qrow = bid_x() * BM + 16 * wave_id() + (lane & 15);
  QFrag<D> qf;
  load_q<D>(qf, q8 + (bhq * Nq + imin(qrow, Nq - 1)) * D);
  Stage<D, true> st;
  for (int kt0 = 0; kt0 < Nk; kt0 += BN) {
    stage_load<D, true, true>(st, k8 + bhk * Nk * D, nullptr, nullptr, kt0, Nk);
    stage_store<D, true>(st, sm);  // V^T and k_scale slots get stale registers: unused here
    block_sync();
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const i32x8 acc = qk_subtile<D>(qf, sm.k, M::K_STRIDE, j);
      #pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int key = kt0 + 16 * j + 8 * h + e;
        if (qrow < Nq && key < Nk) scores[(bhq * Nq + qrow) * Nk + key] = acc[e];
      }
    }
    block_sync();
  }
}

}  // namespace sg

// ---------------------------------------------------------------- entry points
#define SG_ATTN(PV, FP8, D, SUF, T, WAVES, SC, CHAIN)                                                        \
  extern "C" __global__ SG_LAUNCH_BOUNDS(256) SG_MIN_WAVES(WAVES) void sage_attn_i8##PV##_d##D##_##SUF##CHAIN(                   \
      const sg::i8* q8, const float* q_scale, const sg::i8* k8, const float* k_scale, const sg::u8* v,        \
      const float* v_scale, const float* v_mean, int Hq, int Hkv, int Nq, int Nk, int causal, sg::u16* out,  \
      sg::i64 osb, sg::i64 osh, sg::i64 osn, float* lse, const sg::u16* q, sg::i64 qsb, sg::i64 qsh,         \
      sg::i64 qsn, sg::i64 qsd, const float* k_mean, float sm_scale) {                                        \
    sg::attention<D, FP8, SC, sg::T>(q8, q_scale, k8, k_scale, v, v_scale, v_mean, Hq, Hkv, Nq, Nk, causal, out, \
                                 osb, osh, osn, lse, q, qsb, qsh, qsn, qsd, k_mean, sm_scale);                \
  }
// Two-level P.V (any accumulator), then the FP16 single-chain variants (`_sc`: a unit keeping full FP32 in C). FP8
// has none: its shift moves every tile, and clang-19 spills around the rescale branch (docs/MEASUREMENTS.md).
SG_ATTN(f8, true, 128, f16, F16, 9, false, )
SG_ATTN(f8, true, 128, bf16, BF16, 9, false, )
SG_ATTN(f8, true, 64, f16, F16, 12, false, )
SG_ATTN(f8, true, 64, bf16, BF16, 12, false, )
SG_ATTN(f16, false, 128, f16, F16, 8, false, )
SG_ATTN(f16, false, 128, bf16, BF16, 8, false, )
SG_ATTN(f16, false, 64, f16, F16, 10, false, )
SG_ATTN(f16, false, 64, bf16, BF16, 10, false, )
SG_ATTN(f16, false, 128, f16, F16, 8, true, _sc)
SG_ATTN(f16, false, 128, bf16, BF16, 8, true, _sc)
SG_ATTN(f16, false, 64, f16, F16, 10, true, _sc)
SG_ATTN(f16, false, 64, bf16, BF16, 10, true, _sc)

// The same with a key-only mask (KeyMask): its bias and end pointers with their (batch, head) strides, and fill.
#define SG_ATTN_KMASK(PV, FP8, D, SUF, T, WAVES)                                                             \
  extern "C" __global__ SG_LAUNCH_BOUNDS(256) SG_MIN_WAVES(WAVES) void sage_attn_i8##PV##_d##D##_##SUF##_kmask(  \
      const sg::i8* q8, const float* q_scale, const sg::i8* k8, const float* k_scale, const sg::u8* v,        \
      const float* v_scale, const float* v_mean, int Hq, int Hkv, int Nq, int Nk, int causal, sg::u16* out,  \
      sg::i64 osb, sg::i64 osh, sg::i64 osn, float* lse, const sg::u16* q, sg::i64 qsb, sg::i64 qsh,         \
      sg::i64 qsn, sg::i64 qsd, const float* k_mean, float sm_scale, const float* kbias, sg::i64 sbb,        \
      sg::i64 sbh, const int* kend, sg::i64 seb, sg::i64 seh, int fill) {                                     \
    const sg::KeyMask km = {kbias, sbb, sbh, kend, seb, seh, fill};                                           \
    sg::attention<D, FP8, false, sg::T, true>(q8, q_scale, k8, k_scale, v, v_scale, v_mean, Hq, Hkv, Nq, Nk, causal, \
                                       out, osb, osh, osn, lse, q, qsb, qsh, qsn, qsd, k_mean, sm_scale, km);  \
  }
SG_ATTN_KMASK(f8, true, 128, f16, F16, 8)
SG_ATTN_KMASK(f8, true, 128, bf16, BF16, 8)
SG_ATTN_KMASK(f8, true, 64, f16, F16, 10)
SG_ATTN_KMASK(f8, true, 64, bf16, BF16, 10)
SG_ATTN_KMASK(f16, false, 128, f16, F16, 7)
SG_ATTN_KMASK(f16, false, 128, bf16, BF16, 7)
SG_ATTN_KMASK(f16, false, 64, f16, F16, 10)
SG_ATTN_KMASK(f16, false, 64, bf16, BF16, 10)

#define SG_QK_SCORES(D)                                                                                     \
  extern "C" __global__ SG_LAUNCH_BOUNDS(256) void sage_qk_scores_d##D(                                      \
      const sg::i8* q8, const sg::i8* k8, int Hq, int Hkv, int Nq, int Nk, int* scores) {                    \
    sg::qk_scores<D>(q8, k8, Hq, Hkv, Nq, Nk, scores);                                                       \
  }
SG_QK_SCORES(64)
SG_QK_SCORES(128)
