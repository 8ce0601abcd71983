// Paged decode attention on the CPU: one query token per sequence, K and V read in place from
// the block-paged cache (no gather copy), a softmax per chunk in float32.
//
// This is the attention of CPU decode: sequences whose KV lives on the CPU tier (long contexts,
// in the experts process or in process) and every decode step when the compute device is the
// CPU. Decode attention streams each sequence's KV once, so like the expert GEMVs it is bound
// by memory bandwidth; gathering the blocks into a contiguous copy first (what the torch path
// does) reads and writes it all twice more.
//
// Layouts (any strides, last dim contiguous): q [B, H, D]; k_cache [blocks, block_size, Hkv, D];
// v_cache [blocks, block_size, Hkv, Dv] (Dv may be smaller than D and v a view into k: MLA's
// latent cache, whose first Dv numbers are the value); block_tables [B, max_blocks] int64;
// seq_lens [B] int64. Query head h reads KV head h / (H / Hkv). Registered as the torch op
// tandem::paged_decode_attention.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kMaxGroup = 1024;  // query heads per KV head (MLA: every head shares one)

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// The hot loops, compiled for AVX-512, AVX2 and baseline x86-64; the loader picks one at run
// time. They vectorize without -ffast-math: GCC vector types for the dot products, `omp simd`
// for the rest.

// q . k over D numbers. With D a multiple of 16 (every head size in use), in GCC vector types
// (one zmm, two ymm or four xmm, by the clone) reduced pairwise at the end: a plain `omp simd
// reduction` ends each dot in 15 dependent scalar adds through memory, which took most of this
// kernel's time at a head size of 64.
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline float dot(const float* __restrict q, const float* __restrict k, int64_t D) {
  if (D % 16 == 0) {
    v16f acc = {};
    for (int64_t i = 0; i < D; i += 16) {
      v16f a, b;
      std::memcpy(&a, q + i, sizeof a);
      std::memcpy(&b, k + i, sizeof b);
      acc += a * b;
    }
    const v8f h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4f h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < D; ++i) sum += q[i] * k[i];
  return sum;
}

// Calls fn(t, h, row) for each of a block's tokens t < n and each query head h < Hkv * g, `row`
// being the KV row (t, h / g): rows + t * row_stride + (h / g) * kv_stride. A token's row holds
// every KV head, so the block is read in address order; `next`, when set, is the same row of the
// next block, asked for (row_bytes of it) a row at a time while this block is computed (the
// pool's blocks sit anywhere, so the hardware prefetchers stop at each block's end). Inlined,
// with fn, into each clone of its callers.
template <class Fn>
__attribute__((always_inline)) inline void each_row(const float* rows, int64_t row_stride, int64_t kv_stride,
                                                    int64_t Hkv, int64_t g, int64_t n, const char* next,
                                                    int64_t row_bytes, Fn&& fn) {
  for (int64_t t = 0; t < n; ++t) {
    if (next)
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + t * row_stride * sizeof(float) + off);
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const float* row = rows + t * row_stride + kvh * kv_stride;
      for (int64_t j = 0; j < g; ++j) fn(t, kvh * g + j, row);
    }
  }
}

// One block's scores: s[h * s_stride + t] = q_h . k_(t, h / g) for every query head h < Hkv * g
// and the block's t < n tokens, the block walked by each_row.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void block_scores(const float* q, int64_t Hkv, int64_t g, int64_t D, const float* k, int64_t k_stride,
                  int64_t kv_stride, int64_t n, const char* next, int64_t row_bytes, float* s, int64_t s_stride) {
  each_row(k, k_stride, kv_stride, Hkv, g, n, next, row_bytes,
           [&](int64_t t, int64_t h, const float* kt) __attribute__((always_inline)) {
             s[h * s_stride + t] = dot(q + h * D, kt, D);
           });
}

// s[t] = exp(s[t] - m) for t < n, returning their sum. exp is Cephes' expf (range reduction by
// ln 2 in two parts, a degree-5 polynomial, the power of two built in the exponent bits): within
// 2 ulp of libm for the arguments softmax gives it (<= 0), and it vectorizes where a call to
// libm's scalar expf per score does not.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
float exp_shifted(float* s, int64_t n, float m) {
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

// One block's values: acc_h += sum_t p[h * p_stride + t] * v_(t, h / g) for every query head h
// (acc_h at acc + h * Dv), the block walked by each_row as in block_scores.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void block_values(float* acc, int64_t Hkv, int64_t g, int64_t Dv, const float* v, int64_t v_stride,
                  int64_t kv_stride, int64_t n, const char* next, int64_t row_bytes, const float* p,
                  int64_t p_stride) {
  each_row(v, v_stride, kv_stride, Hkv, g, n, next, row_bytes,
           [&](int64_t t, int64_t h, const float* vt) __attribute__((always_inline)) {
             float* a = acc + h * Dv;
             const float w = p[h * p_stride + t];
#pragma omp simd
             for (int64_t i = 0; i < Dv; ++i) a[i] += w * vt[i];
           });
}

// A block's rows [n] of `heads` vectors of `width` (row stride `stride`, head stride
// `head_stride` elements) as float32: in place for float caches (strides unchanged), else
// converted into buf [n, heads, width] (bf16/fp16 caches).
template <typename T>
inline const float* rows_as_float(const T* src, int64_t stride, int64_t head_stride, int64_t n, int64_t heads,
                                  int64_t width, float* buf, int64_t* out_stride, int64_t* out_head_stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < width; ++i) buf[(t * heads + h) * width + i] = to_float(src[t * stride + h * head_stride + i]);
  *out_stride = heads * width;
  *out_head_stride = width;
  return buf;
}
template <>
inline const float* rows_as_float<float>(const float* src, int64_t stride, int64_t head_stride, int64_t, int64_t,
                                         int64_t, float*, int64_t* out_stride, int64_t* out_head_stride) {
  *out_stride = stride;
  *out_head_stride = head_stride;
  return src;
}

// Where the next block of the range [pos, hi) starts in a float cache (row `slot` 0), to
// prefetch while this one is computed; nullptr when there is none or the cache is not float
// (bf16/fp16 blocks go through a conversion buffer).
template <typename T>
inline const char* next_block(const T* base, int64_t block_stride, const int64_t* table, int64_t pos, int64_t hi,
                              int64_t bs) {
  if constexpr (!std::is_same_v<T, float>) return nullptr;
  const int64_t next = (pos / bs + 1) * bs;
  if (next >= hi) return nullptr;
  return reinterpret_cast<const char*>(base + table[next / bs] * block_stride);
}

// Partial attention of one query head over one chunk of a sequence's tokens: its max score m,
// softmax denominator l and the unnormalised weighted value sum acc [Dv] (flash-decoding).
struct Partials {
  float* data;
  int64_t chunks, heads, width;  // width = Dv + 2: acc, then m, then l
  float* at(int64_t b, int64_t c, int64_t h) const { return data + ((b * chunks + c) * heads + h) * width; }
};

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                      const at::Tensor& lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  const int64_t group = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ts0 = tables.stride(0), os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Work items are (sequence, chunk of its blocks). A thread scores a chunk block by block for
  // every query head (a block's rows hold all KV heads, so each block is read whole while it is
  // in cache: per-KV-head items would read 256 bytes in every 2 KB, which no prefetcher follows
  // across pages), then one softmax per head and one more pass over the blocks for V. Chunks
  // split long sequences so that every core has work for one sequence, and bound the scores
  // buffer (heads x chunk tokens).
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lp[b]);
  const int64_t max_blocks = std::max<int64_t>(1, (max_len + bs - 1) / bs);
  const int64_t threads = at::get_num_threads();
  const int64_t want_chunks = (2 * threads + B - 1) / B;
  int64_t chunk_blocks = std::max<int64_t>(2, (max_blocks + want_chunks - 1) / want_chunks);
  chunk_blocks = std::min(chunk_blocks, std::max<int64_t>(1, 65536 / (H * bs)));
  const int64_t chunks = (max_blocks + chunk_blocks - 1) / chunk_blocks, chunk_tokens = chunk_blocks * bs;
  // One chunk: each item finishes its heads. Several: partials, merged below.
  std::vector<float> storage(chunks > 1 ? B * chunks * H * (Dv + 2) : 0);
  const Partials part{storage.data(), chunks, H, Dv + 2};

  at::parallel_for(0, B * chunks, 1, [&](int64_t w0, int64_t w1) {
    constexpr bool in_place = std::is_same_v<T, float>;  // float blocks are read where they lie
    std::vector<float> qf(H * D), s(H * chunk_tokens), kbuf(in_place ? 0 : bs * Hkv * D),
        vbuf(in_place ? 0 : bs * Hkv * Dv);
    std::vector<float> acc(H * Dv), m(H), l(H);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / chunks, c = w % chunks, len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t lo = std::max(first, c * chunk_tokens), hi = std::min(len, (c + 1) * chunk_tokens);
      const int64_t n = std::max<int64_t>(0, hi - lo);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t h = 0; h < H; ++h) {
        const T* src = qp + b * qs0 + h * qs1;
        for (int64_t i = 0; i < D; ++i) qf[h * D + i] = to_float(src[i]) * fscale;
      }
      // f(x, row_stride, head_stride, rows, next, offset) for each block of [lo, hi) of one cache:
      // its rows as float (x), the next block to prefetch (as many rows as this one has: past a
      // chunk's end none are needed) and the block's first token's offset from lo.
      const auto each_block = [&](const T* base, int64_t s0, int64_t s1, int64_t s2, int64_t width, float* buf,
                                  const auto& f) {
        for (int64_t pos = lo; pos < hi;) {
          const int64_t block = tp[b * ts0 + pos / bs], slot = pos % bs, rows = std::min(bs - slot, hi - pos);
          int64_t row_stride, head_stride;
          const float* x = rows_as_float(base + block * s0 + slot * s1, s1, s2, rows, Hkv, width, buf, &row_stride,
                                         &head_stride);
          f(x, row_stride, head_stride, rows, next_block(base, s0, tp + b * ts0, pos, hi, bs), pos - lo);
          pos += rows;
        }
      };
      each_block(kp, ks0, ks1, ks2, D, kbuf.data(),  // scores: s[h * chunk_tokens + (token - lo)]
                 [&](const float* kf, int64_t rs, int64_t hs, int64_t rows, const char* next, int64_t off) {
                   block_scores(qf.data(), Hkv, group, D, kf, rs, hs, rows, next, Hkv * D * sizeof(float),
                                s.data() + off, chunk_tokens);
                 });
      for (int64_t h = 0; h < H; ++h) {
        float* sh = s.data() + h * chunk_tokens;
        m[h] = n > 0 ? *std::max_element(sh, sh + n) : neg_inf;
        l[h] = n > 0 ? exp_shifted(sh, n, m[h]) : 0.f;
      }
      each_block(vp, vs0, vs1, vs2, Dv, vbuf.data(),
                 [&](const float* vf, int64_t rs, int64_t hs, int64_t rows, const char* next, int64_t off) {
                   block_values(acc.data(), Hkv, group, Dv, vf, rs, hs, rows, next, Hkv * Dv * sizeof(float),
                                s.data() + off, chunk_tokens);
                 });
      for (int64_t h = 0; h < H; ++h) {
        if (chunks == 1) {  // the whole sequence: normalise into out
          T* dst = op + b * os0 + h * os1;
          const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
          for (int64_t i = 0; i < Dv; ++i) dst[i] = static_cast<T>(acc[h * Dv + i] * inv);
        } else {  // empty chunks (m = -inf, past the end or before the window) merge to nothing
          float* ph = part.at(b, c, h);
          std::copy_n(acc.data() + h * Dv, Dv, ph);
          ph[Dv] = m[h];
          ph[Dv + 1] = l[h];
        }
      }
    }
  });
  if (chunks == 1) return;

  // Merge each head's chunk partials: rescale to the common max, sum, normalise. A few heads
  // (short-context decode) are a few microseconds' work: done inline rather than waking a worker.
  const int64_t merge_grain = std::max<int64_t>(16, 16384 / (chunks * (Dv + 2)));
  at::parallel_for(0, B * H, merge_grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> acc(Dv);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H, h = w % H;
      float m = neg_inf, l = 0.f;
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part.at(b, c, h)[Dv]);
      std::fill(acc.begin(), acc.end(), 0.f);
      if (m > neg_inf) {
        for (int64_t c = 0; c < chunks; ++c) {
          const float* ph = part.at(b, c, h);
          if (ph[Dv] == neg_inf) continue;
          const float f = std::exp(ph[Dv] - m);
          l += ph[Dv + 1] * f;
          for (int64_t i = 0; i < Dv; ++i) acc[i] += ph[i] * f;
        }
      }
      T* dst = op + b * os0 + h * os1;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t i = 0; i < Dv; ++i) dst[i] = static_cast<T>(acc[i] * inv);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode_attention: q [B, H, D], "
              "k_cache [blocks, block_size, Hkv, D], v_cache [blocks, block_size, Hkv, Dv]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode_attention: the last dimension must be contiguous");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && v_cache.size(2) == k_cache.size(2) &&
              v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
              "paged_decode_attention: cache shapes do not match the query");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "paged_decode_attention: query heads must be a multiple of KV heads (at most ", kMaxGroup, " each)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "paged_decode_attention: block_tables [B, max_blocks] and seq_lens [B] int64");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty({q.size(0), heads, v_cache.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "paged_decode_attention: float64 is not supported");
    } else {
      decode_attention<scalar_t>(q, k_cache, v_cache, tables, lens, scale, sliding_window, out);
    }
  });
  return out;
}

}  // namespace

namespace tandem {

void paged_decode_attention_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                int64_t sliding_window, at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention_f32: float32 tensors only");
  decode_attention<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out);
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int sliding_window) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
