// Row-times-tokens dot products for one SIMD width, included once per instruction set by
// moe_cpu.cpp inside a `#pragma GCC target` region and a namespace (avx2, avx512), so one
// source gives both kernels and the right one is picked at run time.
//
// Every kernel reads one weight row once and multiplies it with up to kTile tokens, so a
// batch whose tokens share an expert streams that expert's weights from RAM once.
// Needs: TANDEM_WIDE (1 for 512-bit vectors), TANDEM_BF16DOT (1: bf16 rows by vdpbf16ps, AVX512_BF16),
// <immintrin.h>, <cstdint>, and Mat from moe_cpu.cpp.

// (sum a, sum b, sum c, sum d) of four 8-float vectors: three horizontal adds and one lane add,
// against four full reductions.
static inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // [a b c d] x 2 halves
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#if TANDEM_WIDE
struct V {
  using T = __m512;
  static constexpr int W = 16;
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T set1(float v) { return _mm512_set1_ps(v); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  // 64 bytes of a bf16 or f32 weight row, in two 256-bit loads: on the Zen 4 development VM such
  // streams came from RAM 6-8% faster than in one 512-bit load each (Zen 4 runs 512-bit operations
  // as two 256-bit halves); int8 and int4 rows, whose arithmetic is heavier, did not move and keep
  // theirs (benchmarks/RESULTS.md, round thirty-nine). Not measured on Intel's AVX-512 cores, where
  // the split costs one shuffle per 64 bytes. Activations, read from L1, keep 512-bit loads.
  static inline __m512i load_w(const void* p) {
    const __m256i* q = static_cast<const __m256i*>(p);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(q)), _mm256_loadu_si256(q + 1), 1);
  }
  static inline T load_wf(const float* p) { return _mm512_castsi512_ps(load_w(p)); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  static inline float sum(T a) { return _mm512_reduce_add_ps(a); }
  // the four sums of a, b, c and d in one vector: halves added down to 256 bits, then as AVX2
  static inline __m128 sum4(T a, T b, T c, T d) {
    return sum4_256(half_sum(a), half_sum(b), half_sum(c), half_sum(d));
  }
  static inline __m256 half_sum(T a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static inline T div(T a, T b) { return _mm512_div_ps(a, b); }
  static inline T min(T a, T b) { return _mm512_min_ps(a, b); }
  static inline T max(T a, T b) { return _mm512_max_ps(a, b); }
  static inline T floor(T a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // 2^n for whole n in [-127, 128] (the exponent field built directly)
  static inline T pow2(T n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static inline void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static inline T load_bf16(const uint16_t* p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static inline T load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static inline T load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 16 bytes -> 32 weights: low nibbles are weights 0..15, high nibbles 16..31.
  static inline void load_i4(const uint8_t* p, T* q) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(0x0F);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
  }
  // int4 x int8, a superblock of 4 blocks (128 weights, 64 bytes): activations are stored in
  // superblock order (the 4 blocks' first halves, then their second halves), so the low and
  // high nibbles of one 64-byte load meet their activations in two loads.
  static constexpr int kSuper = 4;
  struct I4 {
    __m512i lo, hi;  // a superblock's low and high nibbles, as bytes 0..15
  };
  static inline I4 unpack_i4(const uint8_t* w) {
    const __m512i raw = _mm512_loadu_si512(w);
    const __m512i m = _mm512_set1_epi8(0x0F);
    return {_mm512_and_si512(raw, m), _mm512_and_si512(_mm512_srli_epi16(raw, 4), m)};
  }
  static inline __m512i dot_i4(const I4& u, const int8_t* x) {
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.lo, _mm512_loadu_si512(x));
    return _mm512_dpbusd_epi32(acc, u.hi, _mm512_loadu_si512(x + 64));  // lanes 4i..4i+3: block i
  }
  static inline __m512i dot_i4_q8(const uint8_t* w, const int8_t* x) { return dot_i4(unpack_i4(w), x); }
  static inline T cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
  // 4 per-block scales -> each repeated over its block's 4 lanes
  static inline T expand_blocks(__m128 s) {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s));
  }
  // Q8 of one 32-block: max |x|; then round(x * inv) as int8, weights 0..15 to lo and 16..31 to
  // hi, returning their sum (cvtps rounds to nearest even, as std::nearbyint does by default).
  static inline float absmax32(const float* x) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  }
  static inline int32_t quant32(const float* x, float inv, int8_t* lo, int8_t* hi) {
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), s));
    const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), s));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(b));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
  }
  // int8 x int8, 64 weights: w + 128 (a sign-bit flip) is unsigned, so one vpdpbusd does it;
  // the 128 * sum(x) this adds is taken off once per row (Act::c).
  static constexpr int kI8 = 64;
  struct I8 {
    __m512i wu;  // w + 128
  };
  static inline I8 unpack_i8(const int8_t* w) {
    return {_mm512_xor_si512(_mm512_loadu_si512(w), _mm512_set1_epi8(static_cast<char>(0x80)))};
  }
  static inline __m512i dot_i8(const I8& u, const int8_t* x) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.wu, _mm512_loadu_si512(x));
  }
  static inline __m512i dot_i8_q8(const int8_t* w, const int8_t* x) { return dot_i8(unpack_i8(w), x); }
};
#else
struct V {
  using T = __m256;
  static constexpr int W = 8;
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T set1(float v) { return _mm256_set1_ps(v); }
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline T load_wf(const float* p) { return load(p); }  // a weight row's (see the AVX-512 V)
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
  static inline float sum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline __m128 sum4(T a, T b, T c, T d) { return sum4_256(a, b, c, d); }
  static inline T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static inline T div(T a, T b) { return _mm256_div_ps(a, b); }
  static inline T min(T a, T b) { return _mm256_min_ps(a, b); }
  static inline T max(T a, T b) { return _mm256_max_ps(a, b); }
  static inline T floor(T a) { return _mm256_floor_ps(a); }
  static inline T pow2(T n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static inline void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static inline T load_bf16(const uint16_t* p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static inline T load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static inline T load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void load_i4(const uint8_t* p, T* q) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  // int4 x int8, a superblock of 2 blocks (64 weights, 32 bytes); see the AVX-512 version.
  static constexpr int kSuper = 2;
  struct I4 {
    __m256i lo, hi;  // a superblock's low and high nibbles, as bytes 0..15
  };
  static inline I4 unpack_i4(const uint8_t* w) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(raw, m), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m)};
  }
  // u8 x s8 pairs, and the sum of a low pair and the high pair of the same block, fit int16
  // (2 * 2 * 15 * 127 < 32767): the halves are added before one widening, not after two (on
  // cores that run 256-bit integer multiplies at half rate, each one saved is 1/4 of the work).
  // int16 lanes 8i..8i+7: block i.
  static inline __m256i sum_i4(const I4& u, const int8_t* x) {
    const __m256i a = _mm256_maddubs_epi16(u.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    const __m256i b = _mm256_maddubs_epi16(u.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
    return _mm256_add_epi16(a, b);
  }
  static inline __m256i dot_i4(const I4& u, const int8_t* x) {
    return _mm256_madd_epi16(sum_i4(u, x), _mm256_set1_epi16(1));  // lanes 4i..4i+3: block i
  }
  static inline __m256i dot_i4_q8(const uint8_t* w, const int8_t* x) { return dot_i4(unpack_i4(w), x); }
  static inline T cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
  static inline T expand_blocks(__m128 s) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  }
  static inline float absmax32(const float* x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 8; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
  }
  static inline int32_t quant32(const float* x, float inv, int8_t* lo, int8_t* hi) {
    const __m256 s = _mm256_set1_ps(inv);
    __m256i v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), s));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    // |v| <= 127: the saturating packs are exact; they interleave 128-bit lanes, the permute undoes it
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    const __m256i q = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(q, 1));
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1)));
  }
  // int8 x int8, 32 weights: |w| times x with w's sign (maddubs needs one unsigned side).
  static constexpr int kI8 = 32;
  struct I8 {
    __m256i w, abs;  // w, and |w| (unsigned for maddubs)
  };
  static inline I8 unpack_i8(const int8_t* w) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return {wv, _mm256_sign_epi8(wv, wv)};
  }
  static inline __m256i dot_i8(const I8& u, const int8_t* x) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i p = _mm256_maddubs_epi16(u.abs, _mm256_sign_epi8(xv, u.w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  }
  static inline __m256i dot_i8_q8(const int8_t* w, const int8_t* x) { return dot_i8(unpack_i8(w), x); }
};
#endif

using T = V::T;
constexpr int W = V::W;
// Prefetch the weight stream at p g_weight_prefetch bytes ahead (nothing where that is 0; see
// moe_cpu.cpp's set_weight_prefetch). Rows are stored back to back, so this runs on into the next row and the stream
// never stalls at a row (often a 4 KiB page) boundary the hardware prefetcher stops at.
static inline void prefetch_weights(const void* p) {
  if (const int64_t ahead = g_weight_prefetch) _mm_prefetch(static_cast<const char*>(p) + ahead, _MM_HINT_T0);
}

struct LoadF32 {
  using E = float;
  static inline T load(const E* p) { return V::load_wf(p); }
  static inline float scalar(E v) { return v; }
};
struct LoadBF16 {
  using E = uint16_t;
  static inline T load(const E* p) { return V::load_bf16(p); }
  static inline float scalar(E v) { return bf16_to_float(v); }
};
struct LoadI8 {
  using E = int8_t;
  static inline T load(const E* p) { return V::load_i8(p); }
  static inline float scalar(E v) { return static_cast<float>(v); }
};

// res[t] = dot(w, x[t]) for NT tokens; two accumulators per token hide the FMA latency.
template <class L, int NT>
static void dot_dense(const typename L::E* w, int64_t K, const float* const* x, float* res) {
  T acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = V::zero();
  int64_t k = 0;
  for (; k + 2 * W <= K; k += 2 * W) {
    prefetch_weights(w + k);
    const T w0 = L::load(w + k), w1 = L::load(w + k + W);
    for (int t = 0; t < NT; ++t) {
      acc0[t] = V::fma(w0, V::load(x[t] + k), acc0[t]);
      acc1[t] = V::fma(w1, V::load(x[t] + k + W), acc1[t]);
    }
  }
  for (; k + W <= K; k += W) {
    const T w0 = L::load(w + k);
    for (int t = 0; t < NT; ++t) acc0[t] = V::fma(w0, V::load(x[t] + k), acc0[t]);
  }
  for (int t = 0; t < NT; ++t) {
    float r = V::sum(V::add(acc0[t], acc1[t]));
    for (int64_t j = k; j < K; ++j) r += L::scalar(w[j]) * x[t][j];
    res[t] = r;
  }
}

// Two rows at once, sharing each activation load: twice the independent weight streams (more
// loads in flight) and half the activation loads of two dot_dense calls.
template <class L, int NT>
static void dot_dense2(const typename L::E* w0, const typename L::E* w1, int64_t K, const float* const* x,
                       float* res0, float* res1) {
  T acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = V::zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    prefetch_weights(w0 + k);
    prefetch_weights(w1 + k);
    const T v0 = L::load(w0 + k), v1 = L::load(w1 + k);
    for (int t = 0; t < NT; ++t) {
      const T xv = V::load(x[t] + k);
      acc0[t] = V::fma(v0, xv, acc0[t]);
      acc1[t] = V::fma(v1, xv, acc1[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    float r0 = V::sum(acc0[t]), r1 = V::sum(acc1[t]);
    for (int64_t j = k; j < K; ++j) {
      r0 += L::scalar(w0[j]) * x[t][j];
      r1 += L::scalar(w1[j]) * x[t][j];
    }
    res0[t] = r0;
    res1[t] = r1;
  }
}

#if TANDEM_BF16DOT
// bf16 rows times bf16 activations (Act::xb, x rounded to nearest even once a call), with
// vdpbf16ps: each instruction multiplies 32 pairs and adds them into 16 f32 lanes, where the
// f32 kernels widen the weights (two instructions per 16) and then multiply-add 16 at a time.
// llama.cpp's BF16 rows round their activations so too, as a bf16 model's own matmuls do.
// res[r * NT + t] = dot(w[r], x[t]) for R rows.
template <int R, int NT>
static void dot_bf16_rows(const uint16_t* const* w, int64_t K, const Act* a, float* res) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t vec = K / 32 * 32;
  for (int64_t k = 0; k < vec; k += 32) {
    __m512bh v[R];
    for (int r = 0; r < R; ++r) {
      prefetch_weights(w[r] + k);
      v[r] = (__m512bh)V::load_w(w[r] + k);
    }
    for (int t = 0; t < NT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(a[t].xb + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], v[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = _mm512_reduce_add_ps(acc[r][t]);
      for (int64_t j = vec; j < K; ++j) s += bf16_to_float(w[r][j]) * bf16_to_float(a[t].xb[j]);
      res[r * NT + t] = s;
    }
}

// x [K] -> out: bf16, rounded to nearest even (as torch's .bfloat16()), 16 at a time.
static void to_bf16(const float* x, int64_t K, uint16_t* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
  for (; k < K; ++k) out[k] = c10::BFloat16(x[k]).x;  // c10 rounds to nearest even too
}
#endif

// dot(fp16 a, f32 b) over n: the int4 minimum term, sum over groups of min_g * sum(x_g).
static inline float dot_f16(const uint16_t* a, const float* b, int64_t n) {
  T acc = V::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = V::fma(V::load_f16(a + i), V::load(b + i), acc);
  float r = V::sum(acc);
  for (; i < n; ++i) r += half_to_float(a[i]) * b[i];
  return r;
}

// e^x, Cephes' expf as in avx_mathfun: x clamped to [-88.38, 88.38], e^x = 2^n e^r with
// |r| <= ln 2 / 2 (ln 2 in two parts) and e^r a degree-7 polynomial; within 2 ulp of std::exp.
static inline T vexp(T x) {
  x = V::min(V::max(x, V::set1(-88.3762626647949f)), V::set1(88.3762626647949f));
  const T n = V::floor(V::fma(x, V::set1(1.44269504088896341f), V::set1(0.5f)));
  T r = V::fma(n, V::set1(-0.693359375f), x);
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  T y = V::set1(1.9875691500e-4f);
  y = V::fma(y, r, V::set1(1.3981999507e-3f));
  y = V::fma(y, r, V::set1(8.3334519073e-3f));
  y = V::fma(y, r, V::set1(4.1665795894e-2f));
  y = V::fma(y, r, V::set1(1.6666665459e-1f));
  y = V::fma(y, r, V::set1(5.0000001201e-1f));
  y = V::fma(y, V::mul(r, r), V::add(r, V::set1(1.f)));
  return V::mul(y, V::pow2(n));
}

// out[i] = silu(g[i]) * u[i]: the experts' activation, W at a time (a scalar std::exp per
// element costs as much as streaming a gate_up row pair of K = 1024 from RAM).
static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const T gv = V::load(g + i);
    const T silu = V::div(gv, V::add(V::set1(1.f), vexp(V::sub(V::zero(), gv))));
    V::store(out + i, V::mul(silu, V::load(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

constexpr int kSuper = V::kSuper;
// Weights per activation Q8 scale for int8 and int4 rows. The AVX2 kernels sum whole 256-blocks
// in int32 (int8 rows: see dot_int8; int4 rows with integer group scales: dot_int4_iscaled), so
// one activation scale must cover them (as llama.cpp's Q8_K does for its K-quants): on cores
// without vpdpbusd the conversion and FMA per 32 or 64 weights cost as much as the products.
// AVX-512 (vpdpbusd): 32, as Q8_0.
constexpr int64_t kActBlock = TANDEM_WIDE ? 32 : 256;

// Activations quantized as llama.cpp's Q8_0: int8 per 32-block with an f32 scale d; one scale
// covers kActBlock weights (the last run shorter), repeated in d for each 32-block.
// For int4 rows (kind kInt4) q is in superblock order (see V::dot_i4_q8), blocks past the last
// full superblock in natural order, and xs gets per-group sums (for the minimum term). For int8
// rows q is in natural order, and on AVX-512 dexp holds each block scale once per int32 lane of
// V::dot_i8_q8's result, and *c the correction 128 * sum(d * x) over the vector part.
static void quantize_act(const float* x, int64_t K, int64_t group, int64_t kind, int8_t* q, float* d, float* xs,
                         float* dexp, float* c) {
  const int64_t blocks = K / 32, full = kind == kInt4 ? blocks / kSuper * kSuper : 0;
  const int64_t per_group = group / 32, vec_blocks = (K / V::kI8) * (V::kI8 / 32);
  const int64_t run = kActBlock / 32;  // 32-blocks a scale covers
  if (kind == kInt8) *c = 0.f;
  float amax = 0.f, inv = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % run == 0) {
      amax = 0.f;
      for (int64_t j = b; j < std::min(blocks, b + run); ++j) amax = std::max(amax, V::absmax32(x + j * 32));
      inv = amax > 0.f ? 127.f / amax : 0.f;
    }
    d[b] = amax / 127.f;
    // superblock order for int4 (see V::dot_i4_q8): a block's halves go kSuper * 16 apart
    int8_t* lo = b < full ? q + (b / kSuper) * kSuper * 32 + (b % kSuper) * 16 : q + b * 32;
    const int32_t sum = V::quant32(x + b * 32, inv, lo, lo + (b < full ? kSuper * 16 : 16));
    if (kind == kInt4) {
      if (b % per_group == 0) xs[b / per_group] = 0.f;
      xs[b / per_group] += d[b] * static_cast<float>(sum);
    } else if (b < vec_blocks) {
      if (V::kI8 == 64) *c += 128.f * d[b] * static_cast<float>(sum);
      if (TANDEM_WIDE) _mm256_storeu_ps(dexp + b * 8, _mm256_set1_ps(d[b]));  // 8 int32 lanes per block
    }
  }
}

// r plus, for the 32-blocks b in [b0, K / 32) (those past the last vector step), d_b times
// int8 row w's block b dotted with a's Q8 block b.
static inline float int8_tail(float r, const int8_t* w, int64_t b0, int64_t K, const Act& a) {
  for (int64_t b = b0; b < K / 32; ++b) {
    int32_t dot = 0;
    for (int j = 0; j < 32; ++j) dot += w[b * 32 + j] * a.q[b * 32 + j];
    r += a.d[b] * static_cast<float>(dot);
  }
  return r;
}

#if !TANDEM_WIDE
// The AVX2 int8 kernels' sums: acc[r][t] += d_t * (row r's int32 products over steps [s0, s1)),
// a run of one activation scale (kActBlock weights), each row's |w| made once for all NT tokens.
// |lanes| stay below 8 x 2 x 2 x 127 x 127 per run.
template <int R, int NT>
static inline void int8_run(const int8_t* const* w, int64_t s0, int64_t s1, const Act* a, T (&acc)[R][NT]) {
  __m256i sum[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) sum[r][t] = _mm256_setzero_si256();
  for (int64_t i = s0; i < s1; ++i)
    for (int r = 0; r < R; ++r) {
      prefetch_weights(w[r] + i * V::kI8);
      const V::I8 u = V::unpack_i8(w[r] + i * V::kI8);
      for (int t = 0; t < NT; ++t) sum[r][t] = _mm256_add_epi32(sum[r][t], V::dot_i8(u, a[t].q + i * V::kI8));
    }
  for (int t = 0; t < NT; ++t) {
    const T dv = V::set1(a[t].d[s0 * V::kI8 / 32]);
    for (int r = 0; r < R; ++r) acc[r][t] = V::fma(V::cvt(sum[r][t]), dv, acc[r][t]);
  }
}
constexpr int64_t kRun8 = kActBlock / V::kI8;  // steps an activation scale covers
#endif

// int8 row x Q8 activations: sum_b d_b sum_j w_bj xq_bj (times the row scale, by the caller).
template <int NT>
static void dot_int8(const int8_t* w, int64_t K, const Act* a, float* res) {
  const int64_t steps = K / V::kI8;
#if TANDEM_WIDE
  T acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = V::zero();
  for (int64_t i = 0; i < steps; ++i) {
    prefetch_weights(w + i * V::kI8);
    for (int t = 0; t < NT; ++t) {
      const T dot = V::cvt(V::dot_i8_q8(w + i * V::kI8, a[t].q + i * V::kI8));
      acc[t] = V::fma(dot, V::load(a[t].dexp + i * W), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = int8_tail(V::sum(acc[t]) - a[t].c, w, steps * V::kI8 / 32, K, a[t]);
#else
  T acc[1][NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = V::zero();
  for (int64_t s0 = 0; s0 < steps; s0 += kRun8) int8_run<1, NT>(&w, s0, std::min(steps, s0 + kRun8), a, acc);
  for (int t = 0; t < NT; ++t) res[t] = int8_tail(V::sum(acc[0][t]) - a[t].c, w, steps * V::kI8 / 32, K, a[t]);
#endif
}

// The group scales of superblock sb's kSuper blocks as floats (lanes past kSuper unused), for
// groups of 32 << S weights: one vector load and conversion, no branch. S is a template argument
// (the kernels are instantiated per group size): tested per superblock and row, it cost the
// cache-resident int4 loop ~9% (benchmarks/RESULTS.md, round thirty-five). Scalar conversions
// stored to an array and reloaded stall on store forwarding.
template <int S>
static inline __m128 superblock_scales(const uint16_t* scale, int64_t sb) {
  const uint16_t* s = scale + ((sb * kSuper) >> S);
  __m128i h;
  if constexpr (S == 0) {  // one scale per block
    int64_t bits = 0;
    std::memcpy(&bits, s, kSuper * sizeof(uint16_t));
    h = _mm_cvtsi64_si128(bits);
  } else if constexpr (S == 1 && kSuper == 4) {  // each scale covers two blocks: a a b b
    int32_t bits;
    std::memcpy(&bits, s, sizeof bits);
    const __m128i v = _mm_cvtsi32_si128(bits);
    h = _mm_unpacklo_epi16(v, v);
  } else {  // one scale covers the superblock
    h = _mm_set1_epi16(static_cast<int16_t>(s[0]));
  }
  return _mm_cvtph_ps(h);
}

// Calls f(std::integral_constant<int, S>) for groups of 32 << S weights (S = 0, 1 or 2).
template <class F>
static inline void with_group_shift(int64_t group, const F& f) {
  switch (group / 32) {
    case 1: f(std::integral_constant<int, 0>{}); break;
    case 2: f(std::integral_constant<int, 1>{}); break;
    default: f(std::integral_constant<int, 2>{}); break;
  }
}

// r plus, for the blocks b in [b0, blocks) (those past the last superblock, in natural order),
// s_g(b) d_b times int4 row w's block b dotted with a's Q8 block b.
static inline float int4_tail(float r, const uint8_t* w, const uint16_t* scale, int64_t b0, int64_t blocks,
                              int64_t per_group, const Act& a) {
  for (int64_t b = b0; b < blocks; ++b)
    r += half_to_float(scale[b / per_group]) * a.d[b] * static_cast<float>(int4_block_dot(w, b, a.q));
  return r;
}

// int4 row x Q8 activations: sum_b s_g(b) d_b sum_j q_bj xq_bj + sum_g min_g xs_g, for groups of
// 32 << S weights: a shift, not a division, per block (an integer divide costs more than the
// block's whole dot product).
template <int S, int NT>
static void dot_int4(const uint8_t* w, const uint16_t* scale, const uint16_t* mn, int64_t K, const Act* a,
                     float* res) {
  constexpr int64_t group = 32 << S, per_group = 1 << S;
  const int64_t blocks = K / 32, supers = blocks / kSuper;
  T acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = V::zero();
  for (int64_t sb = 0; sb < supers; ++sb) {
    prefetch_weights(w + sb * kSuper * 16);
    const __m128 sv = superblock_scales<S>(scale, sb);
    for (int t = 0; t < NT; ++t) {
      const __m128 sd = _mm_mul_ps(sv, _mm_loadu_ps(a[t].d + sb * kSuper));  // reads 4 floats; see Act
      const T dot = V::cvt(V::dot_i4_q8(w + sb * kSuper * 16, a[t].q + sb * kSuper * 32));
      acc[t] = V::fma(dot, V::expand_blocks(sd), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    res[t] = int4_tail(V::sum(acc[t]), w, scale, supers * kSuper, blocks, per_group, a[t]) +
             dot_f16(mn, a[t].xs, K / group);
  }
}

#if !TANDEM_WIDE
// ---- int4 rows with integer group scales (AVX2) ----
//
// Zen 1 to 3 have no vpdpbusd: a superblock's integer dot product is two vpmaddubsw and a
// vpmaddwd, and with float group scales each row and token then also needs a conversion, a
// scale product and an FMA per superblock, as much work again. With the group scales as int16
// (Mat::iscale: a row's scales over a float factor of the row), the vpmaddwd multiplies by the
// scales itself and the products add up in int32 over a whole activation scale's 256 weights:
// one conversion and FMA per 256 weights, not per 64. |lanes| stay below 2^31: a 256-block adds
// 4 superblocks of 2 * 7620 * 16383 at most (see quant.INT4_ISCALE_MAX).

// The int16 scales of superblock sb's two blocks (groups of 32 << S weights): block 0's in int16
// lanes 0..7, block 1's in 8..15.
template <int S>
static inline __m256i superblock_iscales(const int16_t* isc, int64_t sb) {
  const uint32_t lo = static_cast<uint16_t>(isc[(sb * 2) >> S]);
  const uint32_t hi = static_cast<uint16_t>(isc[(sb * 2 + 1) >> S]);
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  return _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(lo | (hi << 16))), spread);
}

// res[r * NT + t] = int4 row w[r] (integer scales isc[r] of groups of 32 << S weights, minimums
// mn[r]) times Q8 activations a[t], for R rows: f * (sum over 256-blocks of d * sum_b isc_g(b)
// q_b . xq_b) + sum_g min_g xs_g. The group size is a template argument, as dot_int4's.
template <int S, int R, int NT>
static void dot_int4_iscaled(const uint8_t* const* w, const int16_t* const* isc, const uint16_t* const* mn,
                             int64_t K, const Act* a, float* res) {
  static_assert(kSuper == 2 && kActBlock == 256, "the AVX2 layout");
  constexpr int64_t kRun = kActBlock / (32 * kSuper);  // superblocks an activation scale covers
  constexpr int64_t group = 32 << S, per_group = 1 << S;
  const int64_t blocks = K / 32, supers = blocks / kSuper, groups = K / group;
  T acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = V::zero();
  for (int64_t s0 = 0; s0 < supers; s0 += kRun) {
    const int64_t s1 = std::min(supers, s0 + kRun);
    __m256i sum[R][NT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) sum[r][t] = _mm256_setzero_si256();
    for (int64_t sb = s0; sb < s1; ++sb)
      for (int r = 0; r < R; ++r) {
        prefetch_weights(w[r] + sb * kSuper * 16);
        const __m256i sv = superblock_iscales<S>(isc[r], sb);
        const V::I4 u = V::unpack_i4(w[r] + sb * kSuper * 16);
        for (int t = 0; t < NT; ++t)
          sum[r][t] = _mm256_add_epi32(sum[r][t], _mm256_madd_epi16(V::sum_i4(u, a[t].q + sb * kSuper * 32), sv));
      }
    for (int t = 0; t < NT; ++t) {
      const T dv = V::set1(a[t].d[s0 * kSuper]);  // one scale for the run's blocks
      for (int r = 0; r < R; ++r) acc[r][t] = V::fma(V::cvt(sum[r][t]), dv, acc[r][t]);
    }
  }
  // Into real units (times each row's factor), then the minimum term, sum_g min_g xs_g, into the
  // same accumulators as dot_int4_4 does: one reduction per row and token.
  float f[R];
  for (int r = 0; r < R; ++r) {
    f[r] = int4_row_factor(isc[r], groups);
    for (int t = 0; t < NT; ++t) acc[r][t] = V::mul(acc[r][t], V::set1(f[r]));
  }
  const int64_t gv = groups / W * W;
  for (int64_t i = 0; i < gv; i += W)
    for (int t = 0; t < NT; ++t) {
      const T xs = V::load(a[t].xs + i);
      for (int r = 0; r < R; ++r) acc[r][t] = V::fma(V::load_f16(mn[r] + i), xs, acc[r][t]);
    }
  for (int t = 0; t < NT; ++t) {
    float s[4];
    if constexpr (R == 4) {
      _mm_storeu_ps(s, V::sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
    } else {
      for (int r = 0; r < R; ++r) s[r] = V::sum(acc[r][t]);
    }
    for (int r = 0; r < R; ++r) {
      for (int64_t g = gv; g < groups; ++g) s[r] += half_to_float(mn[r][g]) * a[t].xs[g];
      float tail = 0.f;  // the block past the last superblock, if any, in scale units
      for (int64_t b = supers * kSuper; b < blocks; ++b)
        tail += static_cast<float>(isc[r][b / per_group]) * a[t].d[b] *
                static_cast<float>(int4_block_dot(w[r], b, a[t].q));
      res[r * NT + t] = s[r] + f[r] * tail;
    }
  }
}
#endif

template <int NT>
static void row_tile(const Mat& m, int64_t e, int64_t row, const Act* a, float* res) {
  const int64_t r = e * m.rows + row;
  const float* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = a[t].x;
  switch (m.kind) {
    case kF32:
      dot_dense<LoadF32, NT>(static_cast<const float*>(m.data) + r * m.K, m.K, x, res);
      break;
    case kBF16: {
      const uint16_t* w = static_cast<const uint16_t*>(m.data) + r * m.K;
#if TANDEM_BF16DOT
      if (a[0].xb) {
        dot_bf16_rows<1, NT>(&w, m.K, a, res);
        break;
      }
#endif
      dot_dense<LoadBF16, NT>(w, m.K, x, res);
      break;
    }
    case kInt8: {
      if (a[0].q)  // activations quantized: integer dot products
        dot_int8<NT>(static_cast<const int8_t*>(m.data) + r * m.K, m.K, a, res);
      else
        dot_dense<LoadI8, NT>(static_cast<const int8_t*>(m.data) + r * m.K, m.K, x, res);
      break;  // unscaled: see Mat::scale
    }
    case kInt4: {
      const int64_t groups = m.K / m.group;
      const uint8_t* w = static_cast<const uint8_t*>(m.data) + r * (m.K / 2);
      const uint16_t* mn = m.min16 + r * groups;
#if !TANDEM_WIDE
      if (m.iscale) {
        const int16_t* isc = m.iscale + r * (groups + 2);
        with_group_shift(m.group, [&](auto s) {
          dot_int4_iscaled<decltype(s)::value, 1, NT>(&w, &isc, &mn, m.K, a, res);
        });
        break;
      }
#endif
      with_group_shift(m.group, [&](auto s) {
        dot_int4<decltype(s)::value, NT>(w, m.scale16 + r * groups, mn, m.K, a, res);
      });
      break;
    }
  }
}

// res[t] = row `row` of expert `e` times x[t], for n tokens (any n; tiles of kTile).
static void row_dot(const Mat& m, int64_t e, int64_t row, const Act* a, int64_t n, float* res) {
  int64_t t = 0;
  for (; t + kTile <= n; t += kTile) row_tile<kTile>(m, e, row, a + t, res + t);
  switch (n - t) {
    case 1: row_tile<1>(m, e, row, a + t, res + t); break;
    case 2: row_tile<2>(m, e, row, a + t, res + t); break;
    case 3: row_tile<3>(m, e, row, a + t, res + t); break;
    default: break;
  }
}

template <int NT>
static void row_tile2(const Mat& m, int64_t e, int64_t row0, int64_t row1, const Act* a, float* res0, float* res1) {
  const int64_t r0 = e * m.rows + row0, r1 = e * m.rows + row1;
  const float* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = a[t].x;
  switch (m.kind) {
    case kF32: {
      const float* w = static_cast<const float*>(m.data);
      dot_dense2<LoadF32, NT>(w + r0 * m.K, w + r1 * m.K, m.K, x, res0, res1);
      break;
    }
    case kBF16: {
      const uint16_t* w = static_cast<const uint16_t*>(m.data);
#if TANDEM_BF16DOT
      if (a[0].xb) {
        const uint16_t* rows[2] = {w + r0 * m.K, w + r1 * m.K};
        float both[2 * NT];
        dot_bf16_rows<2, NT>(rows, m.K, a, both);
        for (int t = 0; t < NT; ++t) {
          res0[t] = both[t];
          res1[t] = both[NT + t];
        }
        break;
      }
#endif
      dot_dense2<LoadBF16, NT>(w + r0 * m.K, w + r1 * m.K, m.K, x, res0, res1);
      break;
    }
    case kInt8: {
      const int8_t* w = static_cast<const int8_t*>(m.data);
      if (a[0].q) {
        dot_int8<NT>(w + r0 * m.K, m.K, a, res0);
        dot_int8<NT>(w + r1 * m.K, m.K, a, res1);
      } else {
        dot_dense2<LoadI8, NT>(w + r0 * m.K, w + r1 * m.K, m.K, x, res0, res1);
      }
      break;  // unscaled: see Mat::scale
    }
    default:  // int4: one row at a time (dot_int4_4 is the one that shares the activations)
      row_tile<NT>(m, e, row0, a, res0);
      row_tile<NT>(m, e, row1, a, res1);
  }
}

// Rows row0 and row1 of expert `e` times x[t], for n tokens, into res0 and res1.
static void row_dot2(const Mat& m, int64_t e, int64_t row0, int64_t row1, const Act* a, int64_t n, float* res0,
                     float* res1) {
  int64_t t = 0;
  for (; t + kTile <= n; t += kTile) row_tile2<kTile>(m, e, row0, row1, a + t, res0 + t, res1 + t);
  switch (n - t) {
    case 1: row_tile2<1>(m, e, row0, row1, a + t, res0 + t, res1 + t); break;
    case 2: row_tile2<2>(m, e, row0, row1, a + t, res0 + t, res1 + t); break;
    case 3: row_tile2<3>(m, e, row0, row1, a + t, res0 + t, res1 + t); break;
    default: break;
  }
}

// ---- Four rows at a time, from four places in memory ----
//
// The kernels above stream one or two rows at a time, and a thread walking its rows in order
// keeps one run of pages open: one hardware-prefetch stream. On a Sapphire Rapids VM (2 threads,
// rows of 1 KiB) a GEMV reads 17.3 GB/s from one stream per thread, 21.8 from two, 23.9 from
// four and 26.4 from four prefetched ahead (benchmarks/read_streams.cpp); torch's `sum` reads
// 18-20 there. So the callers give these kernels four rows from four different parts of their
// range (each a page or more apart) and walk the parts in lockstep: four streams in flight,
// each prefetched ahead (prefetch_weights), each activation load shared by the four rows.

// Token tile of the four-row kernels: 4 rows x kTile4 tokens of accumulators fit the registers
// (32 zmm; 16 ymm leave room for 4 x 2 and the operands).
constexpr int kTile4 = TANDEM_WIDE ? 4 : 2;

// res[r * NT + t] = dot(w[r], x[t]) for 4 rows.
template <class L, int NT>
static void dot_dense4(const typename L::E* const* w, int64_t K, const float* const* x, float* res) {
  T acc[4][NT];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = V::zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    T v[4];
    for (int r = 0; r < 4; ++r) {
      prefetch_weights(w[r] + k);
      v[r] = L::load(w[r] + k);
    }
    for (int t = 0; t < NT; ++t) {
      const T xv = V::load(x[t] + k);
      for (int r = 0; r < 4; ++r) acc[r][t] = V::fma(v[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    float s[4];
    _mm_storeu_ps(s, V::sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
    for (int r = 0; r < 4; ++r) {
      for (int64_t j = k; j < K; ++j) s[r] += L::scalar(w[r][j]) * x[t][j];
      res[r * NT + t] = s[r];
    }
  }
}

// res[r * NT + t] = int8 row w[r] times Q8 activations a[t] (see dot_int8), for 4 rows.
template <int NT>
static void dot_int8_4(const int8_t* const* w, int64_t K, const Act* a, float* res) {
  const int64_t steps = K / V::kI8;
  T acc[4][NT];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = V::zero();
#if TANDEM_WIDE
  for (int64_t i = 0; i < steps; ++i) {
    for (int r = 0; r < 4; ++r)
      prefetch_weights(w[r] + i * V::kI8);
    // Row by row, each row's |w| (or w + 128) made once for all NT tokens (not once per token).
    for (int r = 0; r < 4; ++r) {
      const V::I8 u = V::unpack_i8(w[r] + i * V::kI8);
      for (int t = 0; t < NT; ++t)
        acc[r][t] = V::fma(V::cvt(V::dot_i8(u, a[t].q + i * V::kI8)), V::load(a[t].dexp + i * W), acc[r][t]);
    }
  }
#else
  for (int64_t s0 = 0; s0 < steps; s0 += kRun8) int8_run<4, NT>(w, s0, std::min(steps, s0 + kRun8), a, acc);
#endif
  for (int t = 0; t < NT; ++t) {
    float s[4];
    _mm_storeu_ps(s, V::sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
    for (int r = 0; r < 4; ++r) res[r * NT + t] = int8_tail(s[r] - a[t].c, w[r], steps * V::kI8 / 32, K, a[t]);
  }
}

// res[r * NT + t] = int4 row w[r] (group scales scale[r], minimums mn[r]) times Q8 activations
// a[t] (see dot_int4), for 4 rows: the activations' loads and block scales are shared by four
// weight streams.
template <int S, int NT>
static void dot_int4_4(const uint8_t* const* w, const uint16_t* const* scale, const uint16_t* const* mn, int64_t K,
                       const Act* a, float* res) {
  constexpr int64_t group = 32 << S, per_group = 1 << S;
  const int64_t blocks = K / 32, supers = blocks / kSuper;
  T acc[4][NT];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = V::zero();
  for (int64_t sb = 0; sb < supers; ++sb) {
    __m128 d[NT];
    for (int t = 0; t < NT; ++t) d[t] = _mm_loadu_ps(a[t].d + sb * kSuper);  // reads 4 floats; see Act
    // Row by row, each row's nibbles unpacked once for all NT tokens (not once per token).
    for (int r = 0; r < 4; ++r) {
      prefetch_weights(w[r] + sb * kSuper * 16);
      const __m128 sv = superblock_scales<S>(scale[r], sb);
      const V::I4 u = V::unpack_i4(w[r] + sb * kSuper * 16);
      for (int t = 0; t < NT; ++t) {
        const T dot = V::cvt(V::dot_i4(u, a[t].q + sb * kSuper * 32));
        acc[r][t] = V::fma(dot, V::expand_blocks(_mm_mul_ps(sv, d[t])), acc[r][t]);
      }
    }
  }
  // The minimum term, sum_g min_g xs_g, goes into the same accumulators: one reduction per row.
  const int64_t groups = K / group, gv = groups / W * W;
  for (int64_t i = 0; i < gv; i += W)
    for (int t = 0; t < NT; ++t) {
      const T xs = V::load(a[t].xs + i);
      for (int r = 0; r < 4; ++r) acc[r][t] = V::fma(V::load_f16(mn[r] + i), xs, acc[r][t]);
    }
  for (int t = 0; t < NT; ++t) {
    float s[4];
    _mm_storeu_ps(s, V::sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
    for (int r = 0; r < 4; ++r) {
      for (int64_t g = gv; g < groups; ++g) s[r] += half_to_float(mn[r][g]) * a[t].xs[g];
      res[r * NT + t] = int4_tail(s[r], w[r], scale[r], supers * kSuper, blocks, per_group, a[t]);
    }
  }
}

// w[r] = the weights of row refs[r], `stride` elements of E a row (int4: K / 2 bytes).
template <class E>
static inline void row_ptrs(const RowRef* refs, int64_t stride, const E* (&w)[4]) {
  for (int r = 0; r < 4; ++r) w[r] = static_cast<const E*>(refs[r].m->data) + refs[r].index() * stride;
}

// p[r] + i * stride for the 4 rows of a quad: row i of a run (rows are stored back to back).
template <class E>
static inline void advance(const E* const (&p)[4], int64_t i, int64_t stride, const E* (&out)[4]) {
  for (int r = 0; r < 4; ++r) out[r] = p[r] + i * stride;
}

// res[r][(t + j) * tstride] = tile[r * nt + j] for 4 rows and nt tokens, in scalar stores:
// vectorized, GCC makes the four rows' stores two vscatterqps, which cost a decode quad more than
// its stores (perf annotate: ~8% of an int4 quad's samples around them, round thirty-five).
__attribute__((noinline, optimize("no-tree-vectorize"))) static void put_tile(float* const* res, int64_t t,
                                                                                const float* tile, int nt,
                                                                                int64_t tstride) {
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < nt; ++j) res[r][(t + j) * tstride] = tile[r * nt + j];
}

template <int NT>
using Tokens = std::integral_constant<int, NT>;

// tile(Tokens<NT>{}, i, t, out) for row i of a run of `count` quads and each tile of tokens
// [t, t + NT), the results out[r * NT + j] going to res[r][i * stride + (t + j) * tstride].
template <class F>
static inline void each_tile(int64_t count, int64_t n, float* const* res, int64_t stride, int64_t tstride,
                             const F& tile) {
  float out[4 * kTile4];
  for (int64_t i = 0; i < count; ++i) {
    float* const dst[4] = {res[0] + i * stride, res[1] + i * stride, res[2] + i * stride, res[3] + i * stride};
    int64_t t = 0;
    for (; t + kTile4 <= n; t += kTile4) {
      tile(Tokens<kTile4>{}, i, t, out);
      put_tile(dst, t, out, kTile4, tstride);
    }
    switch (n - t) {
      case 1: tile(Tokens<1>{}, i, t, out); put_tile(dst, t, out, 1, tstride); break;
      case 2: tile(Tokens<2>{}, i, t, out); put_tile(dst, t, out, 2, tstride); break;
      case 3: tile(Tokens<3>{}, i, t, out); put_tile(dst, t, out, 3, tstride); break;
      default: break;
    }
  }
}

// row_run4's rows read by dot_dense4 with loader L on float activations: f32 and bf16 rows, and
// int8 ones where the activations are not quantized.
template <class L, class E>
static void dense_run4(const E* const (&w)[4], int64_t K, int64_t count, const Act* a, int64_t n, float* const* res,
                       int64_t stride, int64_t tstride) {
  each_tile(count, n, res, stride, tstride, [&](auto nt, int64_t i, int64_t t, float* out) {
    constexpr int NT = decltype(nt)::value;
    const E* wi[4];
    const float* x[NT];
    advance(w, i, K, wi);
    for (int j = 0; j < NT; ++j) x[j] = a[t + j].x;
    dot_dense4<L, NT>(wi, K, x, out);
  });
}

// res[r][i * stride + t * tstride] = row refs[r].row + i times x[t], for a run of `count` quads of
// rows (4 rows of one storage kind and K; any Mats: Q, K and V rows mix; row + i stays in its Mat)
// and n tokens. Dense layers keep a row's tokens together (tstride 1); moe_forward keeps a token's
// rows together (stride 1), as its SiLU and its adds into out read them (round forty-two). One call
// walks the run's rows in order with the kind, group size and pointers settled once. Reached a
// quad at a time through a call, a kind switch and the pointers' arithmetic, the kernels read ~10%
// slower from memory in fast spells than called directly in a loop (round thirty-five);
// single-stream decode in slow spells did not move either way (round forty: benchmarks/RESULTS.md).
static void row_run4(const RowRef* refs, int64_t count, const Act* a, int64_t n, float* const* res, int64_t stride,
                     int64_t tstride) {
  const Mat& m = *refs[0].m;
  const int64_t K = m.K;
  switch (m.kind) {
    case kF32: {
      const float* w[4];
      row_ptrs(refs, K, w);
      dense_run4<LoadF32>(w, K, count, a, n, res, stride, tstride);
      break;
    }
    case kBF16: {
      const uint16_t* w[4];
      row_ptrs(refs, K, w);
#if TANDEM_BF16DOT
      if (a[0].xb) {
        each_tile(count, n, res, stride, tstride, [&](auto nt, int64_t i, int64_t t, float* out) {
          const uint16_t* wi[4];
          advance(w, i, K, wi);
          dot_bf16_rows<4, decltype(nt)::value>(wi, K, a + t, out);
        });
        break;
      }
#endif
      dense_run4<LoadBF16>(w, K, count, a, n, res, stride, tstride);
      break;
    }
    case kInt8: {
      const int8_t* w[4];
      row_ptrs(refs, K, w);
      if (!a[0].q) {  // the call's activations are quantized all or none (ActRows::fill)
        dense_run4<LoadI8>(w, K, count, a, n, res, stride, tstride);
        break;
      }
      each_tile(count, n, res, stride, tstride, [&](auto nt, int64_t i, int64_t t, float* out) {
        const int8_t* wi[4];
        advance(w, i, K, wi);
        dot_int8_4<decltype(nt)::value>(wi, K, a + t, out);
      });
      break;  // unscaled: see Mat::scale
    }
    case kInt4: {
      const int64_t groups = K / m.group;
      const uint8_t* w[4];
      const uint16_t* mn[4];
      row_ptrs(refs, K / 2, w);
      for (int r = 0; r < 4; ++r) mn[r] = refs[r].m->min16 + refs[r].index() * groups;
#if !TANDEM_WIDE
      if (m.iscale) {  // the Mats of one call all store their scales one way (make_mat)
        const int16_t* isc[4];
        for (int r = 0; r < 4; ++r) isc[r] = refs[r].m->iscale + refs[r].index() * (groups + 2);
        with_group_shift(m.group, [&](auto s) {
          each_tile(count, n, res, stride, tstride, [&](auto nt, int64_t i, int64_t t, float* out) {
            const uint8_t* wi[4];
            const int16_t* isci[4];
            const uint16_t* mni[4];
            advance(w, i, K / 2, wi);
            advance(isc, i, groups + 2, isci);
            advance(mn, i, groups, mni);
            dot_int4_iscaled<decltype(s)::value, 4, decltype(nt)::value>(wi, isci, mni, K, a + t, out);
          });
        });
        break;
      }
#endif
      const uint16_t* sc[4];
      for (int r = 0; r < 4; ++r) sc[r] = refs[r].m->scale16 + refs[r].index() * groups;
      with_group_shift(m.group, [&](auto s) {
        each_tile(count, n, res, stride, tstride, [&](auto nt, int64_t i, int64_t t, float* out) {
          const uint8_t* wi[4];
          const uint16_t* sci[4];
          const uint16_t* mni[4];
          advance(w, i, K / 2, wi);
          advance(sc, i, groups, sci);
          advance(mn, i, groups, mni);
          dot_int4_4<decltype(s)::value, decltype(nt)::value>(wi, sci, mni, K, a + t, out);
        });
      });
      break;
    }
  }
}
