// The per-block kernels of paged decode attention (paged_attention.cpp): one block's scores
// q_h . k_t, the softmax numerators of a chunk's scores, and one block's weighted values, for
// every query head of one sequence. K and V rows are float32 here, read in place from the cache
// (or from a bf16/fp16 block's conversion buffer).
//
// Each kernel is built three times and the loader picks one by the CPU (GCC function
// multiversioning): AVX-512 on GCC vectors of 16 floats, AVX2 + FMA on 8, baseline x86-64 on 4.
// One vector type per build, as wide as its registers: GCC lowers a wider one element by element
// through the stack (16-float vectors ran the AVX2 build 4-5x slower than the AVX-512 one). No
// -ffast-math: the sums are vector trees, and `omp simd` would end each dot in dependent scalar
// adds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

// The helpers below take and return vectors wider than baseline x86-64's registers; they are all
// inlined into the builds, so no vector crosses a call and GCC's ABI notes do not apply. (Not
// popped: GCC instantiates the templates at the end of the including file.)
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tandem::attention {

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

template <class V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);

// Bytes and unsigned 32-bit integers as many as a vector's lanes (fp8 conversion).
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint8_t v4b __attribute__((vector_size(4)));
typedef uint32_t v4u __attribute__((vector_size(16)));

#define TANDEM_INLINE __attribute__((always_inline)) inline

template <class V>
TANDEM_INLINE V load(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <class V>
TANDEM_INLINE void store(float* p, V x) {
  std::memcpy(p, &x, sizeof x);
}
// p[0, lanes) where n >= lanes, else p[0, n) and `fill` after.
template <class V>
TANDEM_INLINE V load_or(const float* p, int64_t n, float fill) {
  if (n >= kLanes<V>) return load<V>(p);
  V x;
  for (int64_t i = 0; i < kLanes<V>; ++i) x[i] = i < n ? p[i] : fill;
  return x;
}
template <class V>
TANDEM_INLINE V max(V a, V b) {
  return a > b ? a : b;
}

// A vector's halves.
TANDEM_INLINE v8f lo(v16f x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7); }
TANDEM_INLINE v8f hi(v16f x) { return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }
TANDEM_INLINE v4f lo(v8f x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3); }
TANDEM_INLINE v4f hi(v8f x) { return __builtin_shufflevector(x, x, 4, 5, 6, 7); }

// The sum and the max of a vector's lanes, as trees.
TANDEM_INLINE float hsum(v4f x) { return (x[0] + x[2]) + (x[1] + x[3]); }
template <class V>
TANDEM_INLINE float hsum(V x) {
  return hsum(lo(x) + hi(x));
}
TANDEM_INLINE float hmax(v4f x) { return std::max(std::max(x[0], x[1]), std::max(x[2], x[3])); }
template <class V>
TANDEM_INLINE float hmax(V x) {
  return hmax(max(lo(x), hi(x)));
}

// The lane sums of a, b, c and d, reduced together: each step adds two vectors' halves into one.
TANDEM_INLINE v4f sum4(v4f a, v4f b, v4f c, v4f d) {
  const v4f ab = __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
  const v4f cd = __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
  return __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
}
TANDEM_INLINE v4f sum4(v8f a, v8f b, v8f c, v8f d) {
  const v8f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f x = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(x, x, 0, 2, 4, 6) + __builtin_shufflevector(x, x, 1, 3, 5, 7);
}
TANDEM_INLINE v4f sum4(v16f a, v16f b, v16f c, v16f d) {
  const v16f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  return sum4(lo(ab), hi(ab), lo(cd), hi(cd));
}

// s[t] = q . k_t over D numbers for the 4 rows k_t = k + t * stride: q's vectors loaded once for
// the four, the four sums reduced together. A head size not a multiple of the lanes ends in scalars.
template <class V>
TANDEM_INLINE void dot4(const float* q, const float* k, int64_t stride, int64_t D, float* s) {
  const int64_t Dvec = D - D % kLanes<V>;
  V a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t i = 0; i < Dvec; i += kLanes<V>) {
    const V x = load<V>(q + i);
    a0 += x * load<V>(k + i);
    a1 += x * load<V>(k + stride + i);
    a2 += x * load<V>(k + 2 * stride + i);
    a3 += x * load<V>(k + 3 * stride + i);
  }
  v4f r = sum4(a0, a1, a2, a3);
  for (int64_t i = Dvec; i < D; ++i)
    for (int t = 0; t < 4; ++t) r[t] += q[i] * k[t * stride + i];
  std::memcpy(s, &r, sizeof r);
}

template <class V>
TANDEM_INLINE float dot(const float* q, const float* k, int64_t D) {
  const int64_t Dvec = D - D % kLanes<V>;
  V acc = {};
  for (int64_t i = 0; i < Dvec; i += kLanes<V>) acc += load<V>(q + i) * load<V>(k + i);
  float sum = hsum(acc);
  for (int64_t i = Dvec; i < D; ++i) sum += q[i] * k[i];
  return sum;
}

// Asks for the next block's rows [0, n) (row_bytes of each; none where next is nullptr) while
// this one is computed, a few cache lines at each of `steps` calls to step(), spread over the
// block's arithmetic: the pool's blocks sit anywhere, so the hardware prefetchers stop at each
// block's end. With the KV in RAM, as in serving, this took 5-10% off a call at 8 KV heads of 64
// (32 KB blocks) and 20-30% at one (4 KB blocks); KV already in cache pays for the instructions.
class Prefetch {
 public:
  Prefetch(const char* next, int64_t row_stride, int64_t row_bytes, int64_t n, int64_t steps)
      : at_(next), row_end_(next ? next + row_bytes : next), stride_(row_stride * sizeof(float)), row_bytes_(row_bytes),
        rows_(next ? n : 0), per_step_((n * ((row_bytes + 63) / 64) + steps - 1) / std::max<int64_t>(steps, 1)) {}
  TANDEM_INLINE void step() {
    for (int64_t left = per_step_; left > 0 && rows_ > 0;) {
      const int64_t lines = std::min(left, (row_end_ - at_ + 63) / 64);
      for (int64_t i = 0; i < lines; ++i) __builtin_prefetch(at_ + 64 * i);
      at_ += 64 * lines;
      left -= lines;
      if (at_ >= row_end_) row_end_ += stride_, at_ = row_end_ - row_bytes_, --rows_;
    }
  }

 private:
  const char *at_, *row_end_;  // the next line to ask for, the end of its row
  int64_t stride_, row_bytes_, rows_, per_step_;
};

// One block's scores: s[h * s_stride + t] = q_h . k_(t, h / g) for every query head h < Hkv * g
// and the block's t < n tokens (row t of KV head kvh at k + t * k_stride + kvh * kv_stride). KV
// head by KV head, so its rows stay in L1 while its g query heads pass over them, four tokens at
// a time.
template <class V>
TANDEM_INLINE void block_scores_v(const float* q, int64_t Hkv, int64_t g, int64_t D, const float* k,
                                  int64_t k_stride, int64_t kv_stride, int64_t n, const char* next, int64_t row_bytes,
                                  float* s, int64_t s_stride) {
  Prefetch prefetch(next, k_stride, row_bytes, n, Hkv * g * (n / 4 + n % 4));
  for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
    const float* kh = k + kvh * kv_stride;
    for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h) {
      float* sh = s + h * s_stride;
      int64_t t = 0;
      for (; t + 4 <= n; t += 4, prefetch.step()) dot4<V>(q + h * D, kh + t * k_stride, k_stride, D, sh + t);
      for (; t < n; ++t, prefetch.step()) sh[t] = dot<V>(q + h * D, kh + t * k_stride, D);
    }
  }
}

// s[t] = exp(s[t] - m) for t < n, returning their sum. exp is Cephes' expf (range reduction by
// ln 2 in two parts, a degree-5 polynomial, the power of two built in the exponent bits): within
// 2 ulp of libm for the arguments softmax gives it (<= 0), and it vectorizes where a call to
// libm's scalar expf per score does not.
TANDEM_INLINE float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    const float x = std::max(s[t] - m, -87.f);  // below, exp underflows; e^-87 ~ 1.6e-38 is as good as 0
    const float k = std::nearbyint(x * 1.44269504088896341f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    s[t] = p * two_k;
    sum += s[t];
  }
  return sum;
}

// The softmax numerators of H heads' scores s[h * stride + t], t < n (n > 0), in place: each
// head's max m[h] and denominator l[h].
template <class V>
TANDEM_INLINE void softmax_rows_v(float* s, int64_t H, int64_t stride, int64_t n, float* m, float* l) {
  for (int64_t h = 0; h < H; ++h) {
    float* sh = s + h * stride;
    V mv = load_or<V>(sh, n, sh[0]);
    for (int64_t t = kLanes<V>; t < n; t += kLanes<V>) mv = max(mv, load_or<V>(sh + t, n - t, sh[0]));
    m[h] = hmax(mv);
    l[h] = exp_shifted(sh, n, m[h]);
  }
}

// acc[0, NV lanes) += sum_t p[t] * v_t[0, NV lanes) over the n rows v_t = v + t * stride, acc
// held in registers across the rows; a prefetch step a row.
template <class V, int NV>
TANDEM_INLINE void axpy_rows(float* acc, const float* p, const float* v, int64_t stride, int64_t n,
                             Prefetch& prefetch) {
  V a[NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) a[i] = load<V>(acc + i * kLanes<V>);
  for (int64_t t = 0; t < n; ++t) {
    prefetch.step();
    const float w = p[t];
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) a[i] += w * load<V>(v + t * stride + i * kLanes<V>);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) store(acc + i * kLanes<V>, a[i]);
}

// One block's values: acc_h += sum_t p[h * p_stride + t] * v_(t, h / g) for every query head h
// (acc_h at acc + h * Dv), KV head by KV head as in block_scores; each head's accumulator stays
// in registers across the block's tokens, 64 numbers at a time (8 independent sums where the
// vectors are narrower).
template <class V>
TANDEM_INLINE void block_values_v(float* acc, int64_t Hkv, int64_t g, int64_t Dv, const float* v, int64_t v_stride,
                                  int64_t kv_stride, int64_t n, const char* next, int64_t row_bytes, const float* p,
                                  int64_t p_stride) {
  constexpr int kTile = std::min<int64_t>(8, 64 / kLanes<V>);  // vectors of one pass
  constexpr int64_t kTileWidth = kTile * kLanes<V>;
  const int64_t Dvec = Dv - Dv % kLanes<V>;
  const int64_t passes = Dvec / kTileWidth + Dvec % kTileWidth / kLanes<V>;
  Prefetch prefetch(next, v_stride, row_bytes, n, Hkv * g * n * passes);
  for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
    const float* vh = v + kvh * kv_stride;
    for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h) {
      float* a = acc + h * Dv;
      const float* ph = p + h * p_stride;
      int64_t i = 0;
      for (; i + kTileWidth <= Dvec; i += kTileWidth) axpy_rows<V, kTile>(a + i, ph, vh + i, v_stride, n, prefetch);
      for (; i < Dvec; i += kLanes<V>) axpy_rows<V, 1>(a + i, ph, vh + i, v_stride, n, prefetch);
      for (int64_t t = 0; t < n; ++t)  // a value size not a multiple of the lanes
        for (i = Dvec; i < Dv; ++i) a[i] += ph[t] * vh[t * v_stride + i];
    }
  }
}

// e4m3 bytes (float8_e4m3fn: an fp8 KV cache's numbers) as float, exactly as c10 converts them.
//
// With F16C (every AVX2 and AVX-512 CPU): the byte's sign, exponent and mantissa moved into a
// float16's, which then holds the value times 2^-8 (float16's exponent bias is 15, e4m3's 7; e4m3's
// subnormals land on float16's), widened by vcvtph2ps and multiplied by 2^8; 0x7f NaN. On Zen 1 at
// AVX2, 0.20 ns a number against 0.49 for a 256-entry table and 0.65 for building the float's bits
// with integer operations, which the baseline build does: a normal number's exponent rebiased
// (7 -> 127), a subnormal's mantissa times 2^-9.
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

template <class VH>
TANDEM_INLINE VH fp8_half_bits(VH x) {
  const VH mag = x & 0x7f;
  return mag == 0x7f ? VH{} + 0x7e00 : (mag << 7) | ((x & 0x80) << 8);
}

__attribute__((target("avx512f"), always_inline)) inline v16f fp8_vector(const uint8_t* p, v16f) {
  v16b b;
  std::memcpy(&b, p, sizeof b);
  const v16h h = fp8_half_bits(__builtin_convertvector(b, v16h));
  __m256i hi;
  std::memcpy(&hi, &h, sizeof hi);
  const __m512 f = _mm512_cvtph_ps(hi);
  v16f out;
  std::memcpy(&out, &f, sizeof out);
  return out * 256.f;
}
__attribute__((target("avx2,fma,f16c"), always_inline)) inline v8f fp8_vector(const uint8_t* p, v8f) {
  v8b b;
  std::memcpy(&b, p, sizeof b);
  const v8h h = fp8_half_bits(__builtin_convertvector(b, v8h));
  __m128i hi;
  std::memcpy(&hi, &h, sizeof hi);
  const __m256 f = _mm256_cvtph_ps(hi);
  v8f out;
  std::memcpy(&out, &f, sizeof out);
  return out * 256.f;
}
TANDEM_INLINE v4f fp8_vector(const uint8_t* p, v4f) {
  v4b b;
  std::memcpy(&b, p, sizeof b);
  const v4u x = __builtin_convertvector(b, v4u);
  const v4u mag = x & 0x7f;
  const v4u normal = (mag << 20) + (120u << 23);
  const v4f sub_value = __builtin_convertvector(x & 7, v4f) * (1.f / 512);
  v4u sub;
  std::memcpy(&sub, &sub_value, sizeof sub);
  const v4u bits = (mag == 0x7f ? v4u{} + 0x7fc00000u : (mag >> 3) == 0 ? sub : normal) | ((x & 0x80) << 24);
  v4f out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// The three builds of each kernel (see the top of this file).
#define TANDEM_BUILDS(name, params, args)                                         \
  __attribute__((target("avx512f"))) void name params { name##_v<v16f> args; }  \
  __attribute__((target("avx2,fma,f16c"))) void name params { name##_v<v8f> args; } \
  __attribute__((target("default"))) void name params { name##_v<v4f> args; }

TANDEM_BUILDS(block_scores,
              (const float* q, int64_t Hkv, int64_t g, int64_t D, const float* k, int64_t k_stride, int64_t kv_stride,
               int64_t n, const char* next, int64_t row_bytes, float* s, int64_t s_stride),
              (q, Hkv, g, D, k, k_stride, kv_stride, n, next, row_bytes, s, s_stride))
TANDEM_BUILDS(softmax_rows, (float* s, int64_t H, int64_t stride, int64_t n, float* m, float* l),
              (s, H, stride, n, m, l))
TANDEM_BUILDS(block_values,
              (float* acc, int64_t Hkv, int64_t g, int64_t Dv, const float* v, int64_t v_stride, int64_t kv_stride,
               int64_t n, const char* next, int64_t row_bytes, const float* p, int64_t p_stride),
              (acc, Hkv, g, Dv, v, v_stride, kv_stride, n, next, row_bytes, p, p_stride))

// dst[i] = the float of the e4m3 byte src[i], i < n, a vector at a time. Its builds are written out:
// each inlines its own target's fp8_vector, which a template compiled for no target could not.
#define TANDEM_FP8_TO_FLOAT(V)                                           \
  {                                                                      \
    constexpr int64_t L = kLanes<V>;                                     \
    int64_t i = 0;                                                       \
    for (; i + L <= n; i += L) store(dst + i, fp8_vector(src + i, V{})); \
    if (i < n) { /* the tail, through one vector */                      \
      uint8_t tail[L] = {};                                              \
      std::memcpy(tail, src + i, n - i);                                 \
      const V x = fp8_vector(tail, V{});                                 \
      std::memcpy(dst + i, &x, (n - i) * sizeof(float));                 \
    }                                                                    \
  }
__attribute__((target("avx512f"))) void fp8_to_float(const uint8_t* src, int64_t n, float* dst)
    TANDEM_FP8_TO_FLOAT(v16f)
__attribute__((target("avx2,fma,f16c"))) void fp8_to_float(const uint8_t* src, int64_t n, float* dst)
    TANDEM_FP8_TO_FLOAT(v8f)
__attribute__((target("default"))) void fp8_to_float(const uint8_t* src, int64_t n, float* dst)
    TANDEM_FP8_TO_FLOAT(v4f)
#undef TANDEM_FP8_TO_FLOAT

#undef TANDEM_BUILDS
#undef TANDEM_INLINE

}  // namespace tandem::attention
