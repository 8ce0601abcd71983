// The per-block kernels of paged decode attention (paged_attention.cpp): one block's scores
// q_h . k_t, the softmax numerators of a chunk's scores, and one block's weighted values, for
// every query head of one sequence. K and V rows are read in place from the cache, float32,
// bfloat16, float16 or float8 e4m3, and widened to float32 in registers as they are used.
//
// Each kernel is built three times and the loader picks one by the CPU (GCC function
// multiversioning): AVX-512 on GCC vectors of 16 floats, AVX2 + FMA on 8, baseline x86-64 on 4.
// One vector type per build, as wide as its registers: GCC lowers a wider one element by element
// through the stack (16-float vectors ran the AVX2 build 4-5x slower than the AVX-512 one). No
// -ffast-math: the sums are vector trees, and `omp simd` would end each dot in dependent scalar
// adds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_vectors.h"

namespace tandem::attention {

// Asks for the next block's rows [0, n) (row_bytes of each, row_stride bytes apart; none where
// next is nullptr) while this one is computed, a few cache lines at each of `steps` calls to
// step(), spread over the block's arithmetic: the pool's blocks sit anywhere, so the hardware
// prefetchers stop at each block's end. With the KV in RAM, as in serving, this took 5-10% off a
// call at 8 KV heads of 64 (32 KB blocks) and 20-30% at one (4 KB blocks); KV already in cache
// pays for the instructions. The lines go to L2 (prefetcht1), not L1: a 32 KB block asked into
// a 32 KB L1 evicts the block being computed, and each line held an L1 miss buffer until it came.
// On the Zen 4 development VM, L2 against L1 took float32 calls over 512 and 4,096 tokens of KV
// in RAM from 103 to 84 and from 757 to 578 us (benchmarks/RESULTS.md, round thirty-seven).
class Prefetch {
 public:
  Prefetch(const char* next, int64_t row_stride, int64_t row_bytes, int64_t n, int64_t steps)
      : at_(next), row_end_(next ? next + row_bytes : next), stride_(row_stride), row_bytes_(row_bytes),
        rows_(next ? n : 0), per_step_((n * ((row_bytes + 63) / 64) + steps - 1) / std::max<int64_t>(steps, 1)) {}
  TANDEM_INLINE void step() {
    for (int64_t left = per_step_; left > 0 && rows_ > 0;) {
      const int64_t lines = std::min(left, (row_end_ - at_ + 63) / 64);
      for (int64_t i = 0; i < lines; ++i) __builtin_prefetch(at_ + 64 * i, 0, 2);  // prefetcht1
      at_ += 64 * lines;
      left -= lines;
      if (at_ >= row_end_) row_end_ += stride_, at_ = row_end_ - row_bytes_, --rows_;
    }
  }

 private:
  const char *at_, *row_end_;  // the next line to ask for, the end of its row
  int64_t stride_, row_bytes_, rows_, per_step_;
};

// Tiles: a kernel's inner loop works on HT query heads of one KV head's group (4 at a time where
// the group has 4) and TT tokens (scores) or NV vectors of the value (values), so each K or V vector
// it loads and widens serves HT heads, each query vector TT tokens, and the sums stay in registers:
// 4 x 2 for AVX2's 16 registers, 4 x 4 for AVX-512's 32; more tokens or vectors where fewer heads
// share a KV head.
template <class V, int HT>
constexpr int kTileTokens = HT < 4 || kLanes<V> == 16 ? 4 : 2;
template <class V, int HT>
constexpr int kTileVectors = std::min(8, (kLanes<V> == 16 ? 16 : 8) / HT);

// A group's heads in tiles of 4, then one of 2 and one of 1 as the rest needs: f(HT) for each, h
// its first head.
#define TANDEM_HEAD_TILES(h0, g, f)          \
  {                                          \
    int64_t h = h0;                          \
    for (; h + 4 <= (h0) + (g); h += 4) f(4); \
    if (h + 2 <= (h0) + (g)) {               \
      f(2);                                  \
      h += 2;                                \
    }                                        \
    if (h < (h0) + (g)) f(1);                \
  }

// How many tiles cover n tokens (scores: tiles of TT tokens, then single tokens) or the Dv numbers
// of a value (values: tiles of NV vectors, then single vectors), over a group's head tiles.
template <class V>
TANDEM_INLINE int64_t score_tiles(int64_t g, int64_t n) {
  const auto tiles = [n](int64_t tt) { return n / tt + n % tt; };
  return g / 4 * tiles(kTileTokens<V, 4>) + g % 4 / 2 * tiles(kTileTokens<V, 2>) + g % 2 * tiles(kTileTokens<V, 1>);
}
template <class V>
TANDEM_INLINE int64_t value_tiles(int64_t g, int64_t Dv) {
  const int64_t vectors = Dv / kLanes<V>;
  const auto tiles = [vectors](int64_t nv) {  // see head_values: tiles of nv, then one of each half
    int64_t count = vectors / nv;
    for (int64_t rest = vectors % nv, half = nv / 2; half > 0; half /= 2)
      if (rest >= half) ++count, rest -= half;
    return count;
  };
  return g / 4 * tiles(kTileVectors<V, 4>) + g % 4 / 2 * tiles(kTileVectors<V, 2>) + g % 2 * tiles(kTileVectors<V, 1>);
}

// s[h * s_stride + t] = q_h . k_t over D numbers, for the HT heads q_h = q + h * D and the TT rows
// k_t = k + t * k_stride. A head size not a multiple of the lanes ends in scalars.
template <class V, int HT, int TT, class E>
TANDEM_INLINE void scores_tile(const float* q, int64_t D, const E* k, int64_t k_stride, float* s, int64_t s_stride) {
  const int64_t Dvec = D - D % kLanes<V>;
  V a[HT][TT] = {};
  for (int64_t i = 0; i < Dvec; i += kLanes<V>) {
    V x[TT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) x[t] = load_row(k + t * k_stride + i, As<V>{});
#pragma GCC unroll 8
    for (int h = 0; h < HT; ++h) {
      V qh = load<V>(q + h * D + i);
      if constexpr (TT > 1) asm("" : "+v"(qh));  // one load for the TT products: GCC would fold it into each
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) a[h][t] += qh * x[t];
    }
  }
  float r[HT][TT];  // the sums, reduced four at a time where a tile has four heads or four tokens
  if constexpr (HT == 4) {
    for (int t = 0; t < TT; ++t) {
      const v4f sums = sum4(a[0][t], a[1][t], a[2][t], a[3][t]);
      for (int h = 0; h < 4; ++h) r[h][t] = sums[h];
    }
  } else if constexpr (TT == 4) {
    for (int h = 0; h < HT; ++h) {
      const v4f sums = sum4(a[h][0], a[h][1], a[h][2], a[h][3]);
      for (int t = 0; t < 4; ++t) r[h][t] = sums[t];
    }
  } else {
    for (int h = 0; h < HT; ++h)
      for (int t = 0; t < TT; ++t) r[h][t] = hsum(a[h][t]);
  }
  for (int t = 0; t < TT; ++t)
    for (int64_t i = Dvec; i < D; ++i) {
      const float x = element(k + t * k_stride + i);
      for (int h = 0; h < HT; ++h) r[h][t] += q[h * D + i] * x;
    }
  for (int h = 0; h < HT; ++h)
    for (int t = 0; t < TT; ++t) s[h * s_stride + t] = r[h][t];
}

// The scores of the HT heads from q (q_h = q + h * D, s_h = s + h * s_stride) over the n rows
// k_t = k + t * k_stride, a tile of tokens at a time; a prefetch step a tile.
template <class V, int HT, class E>
TANDEM_INLINE void head_scores(const float* q, int64_t D, const E* k, int64_t k_stride, int64_t n, float* s,
                               int64_t s_stride, Prefetch& prefetch) {
  constexpr int TT = kTileTokens<V, HT>;
  int64_t t = 0;
  for (; t + TT <= n; t += TT, prefetch.step())
    scores_tile<V, HT, TT>(q, D, k + t * k_stride, k_stride, s + t, s_stride);
  for (; t < n; ++t, prefetch.step()) scores_tile<V, HT, 1>(q, D, k + t * k_stride, k_stride, s + t, s_stride);
}

// The scores of the g query heads of one KV head (q_h = q + h * D, s_h = s + h * s_stride, h < g).
template <class V, class E>
TANDEM_INLINE void group_scores(const float* q, int64_t g, int64_t D, const E* k, int64_t k_stride, int64_t n,
                                float* s, int64_t s_stride, Prefetch& prefetch) {
#define TANDEM_TILE(HT) head_scores<V, HT>(q + h * D, D, k, k_stride, n, s + h * s_stride, s_stride, prefetch)
  TANDEM_HEAD_TILES(0, g, TANDEM_TILE)
#undef TANDEM_TILE
}

// Whether the n rows of width numbers x + t * stride hold no NaN. Only fp8's are looked at: 3
// instructions for 32 bytes, which spare the 3 of NaN's check for every 8 numbers as the tiles widen
// them (without_nan: the same bytes, widened by the loaders without the check); other types keep
// their NaN through the widening.
typedef uint8_t v32b __attribute__((vector_size(32)));
typedef int8_t v32sb __attribute__((vector_size(32)));
template <class E>
TANDEM_INLINE bool nan_free(const E*, int64_t, int64_t, int64_t) {
  return true;
}
TANDEM_INLINE bool nan_free(const fp8_e4m3* x, int64_t stride, int64_t n, int64_t width) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(x);
  const int64_t vec = width - width % 32;
  v32sb nan = {};
  for (int64_t t = 0; t < n; ++t, bytes += stride) {
    for (int64_t i = 0; i < vec; i += 32) {
      v32b b;
      std::memcpy(&b, bytes + i, sizeof b);
      nan |= (b | 0x80) == 0xff;  // 0x7f and 0xff
    }
    for (int64_t i = vec; i < width; ++i)
      if ((bytes[i] | 0x80) == 0xff) return false;
  }
  uint64_t words[4];
  std::memcpy(words, &nan, sizeof words);
  return (words[0] | words[1] | words[2] | words[3]) == 0;
}
template <class E>
TANDEM_INLINE const E* without_nan(const E* x) {
  return x;
}
TANDEM_INLINE const fp8_e4m3_finite* without_nan(const fp8_e4m3* x) {
  return reinterpret_cast<const fp8_e4m3_finite*>(x);
}

// fp8 groups larger than 8 query heads per KV head have a block's rows of each KV head widened to
// floats in a buffer first (in L1 or L2) rather than in registers once per tile of 4 heads: 4
// instructions for 8 numbers (7 with NaN's check), paid g / 4 times, cost more than a pass through
// the buffer beyond 8 heads (Zen 1, one thread, 4,096 tokens, 8 KV heads of 128: 8 query heads
// each, 4.19 ms in registers against 4.39 through the buffer; 16, 8.13 against 7.70; MLA's 128
// heads on one 576-wide KV head, 2,048 tokens, 11.9 against 9.6). bfloat16 and float16 widen in
// one or two instructions: in registers at any group size (MLA in bfloat16: 9.6 ms in registers
// against 11.1 through the buffer).
template <class E>
constexpr int64_t kWidenedGroup = INT64_MAX;
template <>
constexpr int64_t kWidenedGroup<fp8_e4m3> = 8;

// out[t * width + i] = row t of x (x + t * stride) as floats, t < n, i < width.
template <class V, class E>
TANDEM_INLINE void widen_rows(const E* x, int64_t stride, int64_t n, int64_t width, float* out) {
  const int64_t vec = width - width % kLanes<V>;
  for (int64_t t = 0; t < n; ++t, x += stride, out += width) {
    for (int64_t i = 0; i < vec; i += kLanes<V>) store(out + i, load_row(x + i, As<V>{}));
    for (int64_t i = vec; i < width; ++i) out[i] = element(x + i);
  }
}

// One block's scores: s[h * s_stride + t] = q_h . k_(t, h / g) for every query head h < Hkv * g
// and the block's t < n tokens (row t of KV head kvh at k + t * k_stride + kvh * kv_stride). KV
// head by KV head, so its rows stay in L1 while its g query heads pass over them, a tile at a time.
// buf: n * D floats, for groups larger than kWidenedGroup.
template <class V, class E>
TANDEM_INLINE void block_scores_v(const float* q, int64_t Hkv, int64_t g, int64_t D, const E* k, int64_t k_stride,
                                  int64_t kv_stride, int64_t n, const char* next, float* buf, float* s,
                                  int64_t s_stride) {
  Prefetch prefetch(next, k_stride * sizeof(E), Hkv * D * sizeof(E), n, Hkv * score_tiles<V>(g, n));
  for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
    const float* qg = q + kvh * g * D;
    float* sg = s + kvh * g * s_stride;
    const E* kh = k + kvh * kv_stride;
    if (g > kWidenedGroup<E>) {
      widen_rows<V>(kh, k_stride, n, D, buf);
      group_scores<V>(qg, g, D, static_cast<const float*>(buf), D, n, sg, s_stride, prefetch);
    } else if (nan_free(kh, k_stride, n, D)) {
      group_scores<V>(qg, g, D, without_nan(kh), k_stride, n, sg, s_stride, prefetch);
    } else {
      group_scores<V>(qg, g, D, kh, k_stride, n, sg, s_stride, prefetch);
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

// acc_h[0, NV lanes) += sum_t p_h[t] * v_t[0, NV lanes) for the HT heads (acc_h = acc + h * Dv,
// p_h = p + h * p_stride) over the n rows v_t = v + t * stride, the sums held in registers across
// the rows; a prefetch step every 4 rows (a step a row cost up to 15% with the KV in cache; a step a
// tile, bursts of 32 lines, 8-10% with 1 query head a KV head and the KV in RAM).
template <class V, int HT, int NV, class E>
TANDEM_INLINE void values_tile(float* acc, int64_t Dv, const float* p, int64_t p_stride, const E* v, int64_t stride,
                               int64_t n, Prefetch& prefetch) {
  V a[HT][NV];
#pragma GCC unroll 8
  for (int h = 0; h < HT; ++h)
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) a[h][i] = load<V>(acc + h * Dv + i * kLanes<V>);
  for (int64_t t = 0; t < n; ++t) {
    if (t % 4 == 0) prefetch.step();
    V x[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) x[i] = load_row(v + t * stride + i * kLanes<V>, As<V>{});
#pragma GCC unroll 8
    for (int h = 0; h < HT; ++h) {
      const float w = p[h * p_stride + t];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) a[h][i] += w * x[i];
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < HT; ++h)
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) store(acc + h * Dv + i * kLanes<V>, a[h][i]);
}

// The values of the HT heads (acc_h = acc + h * Dv, p_h = p + h * p_stride) over the n rows v_t = v +
// t * v_stride: tiles of NV vectors, then at most one tile each of NV / 2, NV / 4, ... 1 vectors,
// then scalars for a value size not a multiple of the lanes. The halves keep a value narrower than
// a tile (64 numbers: 4 vectors of AVX-512's 16, against tiles of 8 at 2 heads) in registers
// across a block's rows, where single vectors would pass over the rows once per vector.
template <class V, int HT, class E>
TANDEM_INLINE void head_values(float* acc, int64_t Dv, const float* p, int64_t p_stride, const E* v, int64_t v_stride,
                               int64_t n, Prefetch& prefetch) {
  constexpr int NV = kTileVectors<V, HT>;
  static_assert((NV & (NV - 1)) == 0, "tiles of a power of two vectors, halved for the rest");
  const int64_t Dvec = Dv - Dv % kLanes<V>;
  int64_t i = 0;
  for (; i + NV * kLanes<V> <= Dvec; i += NV * kLanes<V>)
    values_tile<V, HT, NV>(acc + i, Dv, p, p_stride, v + i, v_stride, n, prefetch);
  const auto half = [&](auto nv) {
    constexpr int W = decltype(nv)::value;
    if (i + W * kLanes<V> <= Dvec) {
      values_tile<V, HT, W>(acc + i, Dv, p, p_stride, v + i, v_stride, n, prefetch);
      i += W * kLanes<V>;
    }
  };
  if constexpr (NV >= 8) half(std::integral_constant<int, 4>{});
  if constexpr (NV >= 4) half(std::integral_constant<int, 2>{});
  if constexpr (NV >= 2) half(std::integral_constant<int, 1>{});
  for (int64_t t = 0; t < n; ++t)
    for (i = Dvec; i < Dv; ++i) {
      const float x = element(v + t * v_stride + i);
      for (int h = 0; h < HT; ++h) acc[h * Dv + i] += p[h * p_stride + t] * x;
    }
}

// The values of the g query heads of one KV head (acc_h = acc + h * Dv, p_h = p + h * p_stride).
template <class V, class E>
TANDEM_INLINE void group_values(float* acc, int64_t g, int64_t Dv, const float* p, int64_t p_stride, const E* v,
                                int64_t v_stride, int64_t n, Prefetch& prefetch) {
#define TANDEM_TILE(HT) head_values<V, HT>(acc + h * Dv, Dv, p + h * p_stride, p_stride, v, v_stride, n, prefetch)
  TANDEM_HEAD_TILES(0, g, TANDEM_TILE)
#undef TANDEM_TILE
}

// One block's values: acc_h += sum_t p[h * p_stride + t] * v_(t, h / g) for every query head h
// (acc_h at acc + h * Dv), KV head by KV head as in block_scores. buf: n * Dv floats, for groups
// larger than kWidenedGroup.
template <class V, class E>
TANDEM_INLINE void block_values_v(float* acc, int64_t Hkv, int64_t g, int64_t Dv, const E* v, int64_t v_stride,
                                  int64_t kv_stride, int64_t n, const char* next, float* buf, const float* p,
                                  int64_t p_stride) {
  const int64_t steps = Hkv * value_tiles<V>(g, Dv) * ((n + 3) / 4);
  Prefetch prefetch(next, v_stride * sizeof(E), Hkv * Dv * sizeof(E), n, steps);
  for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
    float* ag = acc + kvh * g * Dv;
    const float* pg = p + kvh * g * p_stride;
    const E* vh = v + kvh * kv_stride;
    if (g > kWidenedGroup<E>) {
      widen_rows<V>(vh, v_stride, n, Dv, buf);
      group_values<V>(ag, g, Dv, pg, p_stride, static_cast<const float*>(buf), Dv, n, prefetch);
    } else if (nan_free(vh, v_stride, n, Dv)) {
      group_values<V>(ag, g, Dv, pg, p_stride, without_nan(vh), v_stride, n, prefetch);
    } else {
      group_values<V>(ag, g, Dv, pg, p_stride, vh, v_stride, n, prefetch);
    }
  }
}

// The three builds of each kernel (see the top of this file), `flatten` so that each inlines its own
// target's loaders.
#define TANDEM_BUILDS(name, params, args)                                                   \
  __attribute__((target("avx512f"), flatten)) void name params { name##_v<v16f> args; }      \
  __attribute__((target("avx2,fma,f16c"), flatten)) void name params { name##_v<v8f> args; } \
  __attribute__((target("default"), flatten)) void name params { name##_v<v4f> args; }

// Overloads by the cache's element type E.
#define TANDEM_BLOCK_KERNELS(E)                                                                                  \
  TANDEM_BUILDS(block_scores,                                                                                   \
                (const float* q, int64_t Hkv, int64_t g, int64_t D, const E* k, int64_t k_stride,              \
                 int64_t kv_stride, int64_t n, const char* next, float* buf, float* s, int64_t s_stride),      \
                (q, Hkv, g, D, k, k_stride, kv_stride, n, next, buf, s, s_stride))                              \
  TANDEM_BUILDS(block_values,                                                                                   \
                (float* acc, int64_t Hkv, int64_t g, int64_t Dv, const E* v, int64_t v_stride, int64_t kv_stride, \
                 int64_t n, const char* next, float* buf, const float* p, int64_t p_stride),                    \
                (acc, Hkv, g, Dv, v, v_stride, kv_stride, n, next, buf, p, p_stride))
TANDEM_BLOCK_KERNELS(float)
TANDEM_BLOCK_KERNELS(bf16)
TANDEM_BLOCK_KERNELS(fp16)
TANDEM_BLOCK_KERNELS(fp8_e4m3)
#undef TANDEM_BLOCK_KERNELS

TANDEM_BUILDS(softmax_rows, (float* s, int64_t H, int64_t stride, int64_t n, float* m, float* l),
              (s, H, stride, n, m, l))

// dst[i] = the float of the e4m3 byte src[i], i < n: the kernels' own conversion, for their tests.
template <class V>
TANDEM_INLINE void fp8_to_float_v(const uint8_t* src, int64_t n, float* dst) {
  const auto* e = reinterpret_cast<const fp8_e4m3*>(src);
  int64_t i = 0;
  for (; i + kLanes<V> <= n; i += kLanes<V>) store(dst + i, load_row(e + i, As<V>{}) * kUnit<fp8_e4m3>);
  for (; i < n; ++i) dst[i] = element(e + i) * kUnit<fp8_e4m3>;
}
TANDEM_BUILDS(fp8_to_float, (const uint8_t* src, int64_t n, float* dst), (src, n, dst))

#undef TANDEM_BUILDS
#undef TANDEM_HEAD_TILES
#undef TANDEM_INLINE

}  // namespace tandem::attention
