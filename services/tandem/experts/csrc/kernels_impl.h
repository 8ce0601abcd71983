// Row-times-tokens dot products for one SIMD width, included once per instruction set by
// moe_cpu.cpp inside a `#pragma GCC target` region and a namespace (avx2, avx512), so one
// source gives both kernels and the right one is picked at run time.
//
// Every kernel reads one weight row once and multiplies it with up to kTile tokens, so a
// batch whose tokens share an expert streams that expert's weights from RAM once.
// Needs: TANDEM_WIDE (1 for 512-bit vectors), <immintrin.h>, <cstdint>, and Mat from moe_cpu.cpp.

#if TANDEM_WIDE
struct V {
  using T = __m512;
  static constexpr int W = 16;
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T set1(float v) { return _mm512_set1_ps(v); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  static inline float sum(T a) { return _mm512_reduce_add_ps(a); }
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
};
#else
struct V {
  using T = __m256;
  static constexpr int W = 8;
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T set1(float v) { return _mm256_set1_ps(v); }
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
  static inline float sum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
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
};
#endif

using T = V::T;
constexpr int W = V::W;

struct LoadF32 {
  using E = float;
  static inline T load(const E* p) { return V::load(p); }
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

// dot(fp16 a, f32 b) over n: the int4 minimum term, sum over groups of min_g * sum(x_g).
static inline float dot_f16(const uint16_t* a, const float* b, int64_t n) {
  T acc = V::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = V::fma(V::load_f16(a + i), V::load(b + i), acc);
  float r = V::sum(acc);
  for (; i < n; ++i) r += half_to_float(a[i]) * b[i];
  return r;
}

// int4: sum_g scale_g * dot(q_g, x_g) + sum_g min_g * sum(x_g); xs[t] holds sum(x_g) per group.
template <int NT>
static void dot_int4(const uint8_t* w, const uint16_t* scale, const uint16_t* mn, int64_t K, int64_t group,
                     const float* const* x, const float* const* xs, float* res) {
  constexpr int Q = 32 / W;  // vectors per 32-weight block
  T acc[NT][Q];
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < Q; ++i) acc[t][i] = V::zero();
  const int64_t blocks_per_group = group / 32, groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    const T s = V::set1(half_to_float(scale[g]));
    for (int64_t b = 0; b < blocks_per_group; ++b) {
      const int64_t block = g * blocks_per_group + b;
      T q[Q];
      V::load_i4(w + block * 16, q);
      for (int i = 0; i < Q; ++i) {
        const T qs = V::mul(q[i], s);
        for (int t = 0; t < NT; ++t) acc[t][i] = V::fma(qs, V::load(x[t] + block * 32 + i * W), acc[t][i]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    T a = acc[t][0];
    for (int i = 1; i < Q; ++i) a = V::add(a, acc[t][i]);
    res[t] = V::sum(a) + dot_f16(mn, xs[t], groups);
  }
}

template <int NT>
static void row_tile(const Mat& m, int64_t e, int64_t row, const float* const* x, const float* const* xs,
                     float* res) {
  const int64_t r = e * m.rows + row;
  switch (m.kind) {
    case kF32:
      dot_dense<LoadF32, NT>(static_cast<const float*>(m.data) + r * m.K, m.K, x, res);
      break;
    case kBF16:
      dot_dense<LoadBF16, NT>(static_cast<const uint16_t*>(m.data) + r * m.K, m.K, x, res);
      break;
    case kInt8: {
      dot_dense<LoadI8, NT>(static_cast<const int8_t*>(m.data) + r * m.K, m.K, x, res);
      const float s = m.scale[r];
      for (int t = 0; t < NT; ++t) res[t] *= s;
      break;
    }
    case kInt4: {
      const int64_t groups = m.K / m.group;
      dot_int4<NT>(static_cast<const uint8_t*>(m.data) + r * (m.K / 2), m.scale16 + r * groups,
                   m.min16 + r * groups, m.K, m.group, x, xs, res);
      break;
    }
  }
}

// res[t] = row `row` of expert `e` times x[t], for n tokens (any n; tiles of kTile).
static void row_dot(const Mat& m, int64_t e, int64_t row, const float* const* x, const float* const* xs, int64_t n,
                    float* res) {
  int64_t t = 0;
  for (; t + kTile <= n; t += kTile) row_tile<kTile>(m, e, row, x + t, xs + t, res + t);
  switch (n - t) {
    case 1: row_tile<1>(m, e, row, x + t, xs + t, res + t); break;
    case 2: row_tile<2>(m, e, row, x + t, xs + t, res + t); break;
    case 3: row_tile<3>(m, e, row, x + t, xs + t, res + t); break;
    default: break;
  }
}
