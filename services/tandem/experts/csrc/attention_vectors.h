// The vectors and loaders of paged decode attention's kernels (attention_blocks.h): GCC vector
// types of 4, 8 and 16 floats with their loads, stores and lane reductions, the caches' element
// types (float32, bfloat16, float16, float8 e4m3) and their widening to floats, a vector's lanes at
// a time (load_row) or one element (element).
//
// The loaders for AVX2 and AVX-512 are written with intrinsics for their targets; the baseline
// x86-64 ones with generic vector code. See attention_blocks.h for how the builds pick them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// Bytes and 16-bit unsigned integers as many as a vector's lanes (the caches' elements), and 4
// 32-bit ones.
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint8_t v4b __attribute__((vector_size(4)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));
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
template <class To, class From>
TANDEM_INLINE To bit_cast(From x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
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

// The caches' element types as the kernels read them: the bits of c10's BFloat16, Half and
// Float8_e4m3fn.
struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e4m3_finite {  // fp8 numbers checked for NaN first (nan_free below): widened without the check
  uint8_t bits;
};

// What a loaded element is worth in floats: an fp8 number loads as its value times 2^-8 (the unit
// of the float16 it passes through, below), and the caller's scales carry the 2^8. Powers of two:
// the products and sums round as the numbers' own would.
template <class E>
constexpr float kUnit = 1.f;
template <>
constexpr float kUnit<fp8_e4m3> = 256.f;
template <>
constexpr float kUnit<fp8_e4m3_finite> = 256.f;

// One element as a float (in kUnit): the tails of rows not a multiple of the lanes.
TANDEM_INLINE float element(const float* p) { return *p; }
TANDEM_INLINE float element(const bf16* p) { return bit_cast<float>(uint32_t{p->bits} << 16); }
TANDEM_INLINE float element(const fp16* p) {
  const uint32_t h = p->bits, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return bit_cast<float>(bit_cast<uint32_t>(m * 0x1p-24f) | sign);  // subnormal (or 0)
  return bit_cast<float>(sign | (e == 0x1f ? 0x7f800000u : (e + 112) << 23) | m << 13);  // inf, NaN; normal
}
TANDEM_INLINE float element(const fp8_e4m3* p) {
  const uint32_t x = p->bits, sign = (x & 0x80u) << 24, mag = x & 0x7f;
  if (mag == 0x7f) return bit_cast<float>(sign | 0x7fc00000u);                           // NaN
  if (mag < 8) return bit_cast<float>(bit_cast<uint32_t>(mag * 0x1p-17f) | sign);       // subnormal (or 0)
  return bit_cast<float>(sign | ((mag >> 3) + 112) << 23 | (mag & 7) << 20);             // normal
}
TANDEM_INLINE float element(const fp8_e4m3_finite* p) { return element(reinterpret_cast<const fp8_e4m3*>(p)); }

// load_row(p, As<V>{}): V's lanes of a cache row from p, as floats in kUnit.
//
// e4m3 bytes (float8_e4m3fn: an fp8 KV cache's numbers) and float16 as floats, exactly as c10
// converts them.
//
// With F16C (every AVX2 and AVX-512 CPU): the byte's sign, exponent and mantissa moved into a
// float16's, which then holds the value times 2^-8 (float16's exponent bias is 15, e4m3's 7; e4m3's
// subnormals land on float16's), widened by vcvtph2ps; 0x7f NaN. Seven instructions for 8 numbers
// at AVX2. Round twenty-five measured this way of converting at 0.20 ns a number on Zen 1 against
// 0.49 for a 256-entry table and 0.65 for building the float's bits with integer operations, which
// the baseline build does (a normal number's exponent rebiased, a subnormal's mantissa scaled).
//
// The F16C loaders are `inline`, not always_inline: GCC refuses to inline a function built for a
// target into one that is not (the kernel templates), and the builds below are `flatten`, which
// inlines them once the template is inside a build of the same target.
template <class V>
struct As {};  // which vector a loader returns

// x: e4m3 bytes sign-extended to 16 bits and shifted left by 7, which puts the sign in bits 14 and
// 15 and the exponent and mantissa in float16's bits 7-13.
template <class VH>
TANDEM_INLINE VH fp8_half_bits(VH x) {
  return (x & 0x3f80) == 0x3f80 ? VH{} + 0x7e00 : x & 0xbf80;
}
__attribute__((target("avx512f"))) inline v16f widen_halves(v16h h) {
  return bit_cast<v16f>(_mm512_cvtph_ps(bit_cast<__m256i>(h)));
}
__attribute__((target("avx2,fma,f16c"))) inline v8f widen_halves(v8h h) {
  return bit_cast<v8f>(_mm256_cvtph_ps(bit_cast<__m128i>(h)));
}
__attribute__((target("avx512f"))) inline v16f load_row(const fp8_e4m3* p, As<v16f>) {
  const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)), 7);
  return widen_halves(fp8_half_bits(bit_cast<v16h>(x)));
}
__attribute__((target("avx2,fma,f16c"))) inline v8f load_row(const fp8_e4m3* p, As<v8f>) {
  const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p)), 7);
  return widen_halves(fp8_half_bits(bit_cast<v8h>(x)));
}
// Without NaN: four instructions for 8 numbers at AVX2 (the baseline build has no cheaper way).
__attribute__((target("avx512f"))) inline v16f load_row(const fp8_e4m3_finite* p, As<v16f>) {
  const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)), 7);
  return widen_halves(bit_cast<v16h>(x) & 0xbf80);
}
__attribute__((target("avx2,fma,f16c"))) inline v8f load_row(const fp8_e4m3_finite* p, As<v8f>) {
  const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p)), 7);
  return widen_halves(bit_cast<v8h>(x) & 0xbf80);
}
TANDEM_INLINE v4f load_row(const fp8_e4m3* p, As<v4f>);
TANDEM_INLINE v4f load_row(const fp8_e4m3_finite* p, As<v4f>) {
  return load_row(reinterpret_cast<const fp8_e4m3*>(p), As<v4f>{});
}
TANDEM_INLINE v4f load_row(const fp8_e4m3* p, As<v4f>) {
  v4b b;
  std::memcpy(&b, p, sizeof b);
  const v4u x = __builtin_convertvector(b, v4u), mag = x & 0x7f;
  const v4u normal = (mag << 20) + (112u << 23);
  const v4u sub = bit_cast<v4u>(__builtin_convertvector(mag, v4f) * 0x1p-17f);
  const v4u bits = (mag == 0x7f ? v4u{} + 0x7fc00000u : mag < 8 ? sub : normal) | ((x & 0x80) << 24);
  return bit_cast<v4f>(bits);
}
__attribute__((target("avx512f"))) inline v16f load_row(const fp16* p, As<v16f>) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  return widen_halves(h);
}
__attribute__((target("avx2,fma,f16c"))) inline v8f load_row(const fp16* p, As<v8f>) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  return widen_halves(h);
}
TANDEM_INLINE v4f load_row(const fp16* p, As<v4f>) {
  v4h h;
  std::memcpy(&h, p, sizeof h);
  const v4u x = __builtin_convertvector(h, v4u), e = (x >> 10) & 0x1f, m = x & 0x3ff;
  const v4u sub = bit_cast<v4u>(__builtin_convertvector(m, v4f) * 0x1p-24f);
  const v4u bits = (e == 0 ? sub : (e == 0x1f ? v4u{} + 0x7f800000u : (e + 112) << 23) | m << 13) |
                   ((x & 0x8000) << 16);
  return bit_cast<v4f>(bits);
}
// bfloat16 is a float's upper half: widened 16 bits to 32 and shifted, one instruction each (GCC
// lowers the generic vector code for AVX2 in five).
__attribute__((target("avx512f"))) inline v16f load_row(const bf16* p, As<v16f>) {
  return bit_cast<v16f>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
__attribute__((target("avx2,fma,f16c"))) inline v8f load_row(const bf16* p, As<v8f>) {
  return bit_cast<v8f>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
TANDEM_INLINE v4f load_row(const bf16* p, As<v4f>) {
  v4h h;
  std::memcpy(&h, p, sizeof h);
  return bit_cast<v4f>(__builtin_convertvector(h, v4u) << 16);
}
template <class V>
TANDEM_INLINE V load_row(const float* p, As<V>) {
  return load<V>(p);
}

}  // namespace tandem::attention
