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
//
// An fp8 cache (float8 e4m3, tandem.kv.fp8: --kv-cache-dtype fp8) holds K / k_scale and V / v_scale,
// with a query of any float dtype. Its numbers are widened to float as bf16 ones are, in the kernels'
// registers, and the scales folded: the query is multiplied by scale * k_scale, the output by v_scale.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_blocks.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using tandem::attention::block_scores;
using tandem::attention::block_values;
using tandem::attention::softmax_rows;

constexpr int kMaxGroup = 1024;  // query heads per KV head (MLA: every head shares one)

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// A cache's element type as the kernels read it (attention_blocks.h): the same bits.
template <typename T>
struct Element {
  using type = float;
};
template <>
struct Element<at::BFloat16> {
  using type = tandem::attention::bf16;
};
template <>
struct Element<at::Half> {
  using type = tandem::attention::fp16;
};
template <>
struct Element<at::Float8_e4m3fn> {
  using type = tandem::attention::fp8_e4m3;
};
template <typename T>
const typename Element<T>::type* elements(const T* p) {
  static_assert(sizeof(T) == sizeof(typename Element<T>::type));
  return reinterpret_cast<const typename Element<T>::type*>(p);
}

// Where the next block of the range [pos, hi) starts (row `slot` 0), to prefetch while this one is
// computed; nullptr when there is none.
template <typename T>
inline const char* next_block(const T* base, int64_t block_stride, const int64_t* table, int64_t pos, int64_t hi,
                              int64_t bs) {
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

// Scratch of at least `size` floats that outlives the call, one per thread and slot (0: the
// caller's partials, 1: a worker's buffers): decode attention runs for every layer at every step
// with buffers of the same sizes.
float* scratch(int slot, int64_t size) {
  static thread_local std::vector<float> buffers[2];
  std::vector<float>& buf = buffers[slot];
  if (static_cast<int64_t>(buf.size()) < size) buf.resize(size);
  return buf.data();
}

// Q: the query's and output's element type; T: the caches' (float32 queries over a bf16 cache
// are the native decode layer's, tandem::paged_decode_attention_f32; any query over an fp8 one).
// k_scale and v_scale: an fp8 cache's (1 for others).
template <typename Q, typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                      const at::Tensor& lens, double scale, int64_t window, double k_scale, double v_scale,
                      at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  const int64_t group = H / Hkv;
  const Q* qp = q.data_ptr<Q>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  Q* op = out.data_ptr<Q>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ts0 = tables.stride(0), os0 = out.stride(0), os1 = out.stride(1);
  // The kernels load an fp8 cache's numbers in units of 2^-8 (tandem::attention::kUnit): the scales carry it.
  constexpr float unit = tandem::attention::kUnit<typename Element<T>::type>;
  const float fscale = static_cast<float>(scale * k_scale) * unit, vscale = static_cast<float>(v_scale) * unit;
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
  const Partials part{chunks > 1 ? scratch(0, B * chunks * H * (Dv + 2)) : nullptr, chunks, H, Dv + 2};

  at::parallel_for(0, B * chunks, 1, [&](int64_t w0, int64_t w1) {
    const int64_t widened_size = bs * std::max(D, Dv);
    float* const qf = scratch(1, H * D + H * chunk_tokens + widened_size + H * Dv + 2 * H);
    float* const s = qf + H * D;
    float* const widened = s + H * chunk_tokens;  // a block's rows of one KV head as floats (fp8, groups over 8)
    float* const acc = widened + widened_size;
    float* const m = acc + H * Dv;
    float* const l = m + H;
    // [lo, hi): the tokens of item w, its chunk of its sequence within the window (empty: lo >= hi)
    const auto range = [&](int64_t w) {
      const int64_t b = w / chunks, c = w % chunks, len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      return std::pair{std::max(first, c * chunk_tokens), std::min(len, (c + 1) * chunk_tokens)};
    };
    // Token pos of sequence b in a cache (block stride s0, row stride s1): its row.
    const auto row_of = [&](const T* base, int64_t s0, int64_t s1, int64_t b, int64_t pos) {
      return base + tp[b * ts0 + pos / bs] * s0 + pos % bs * s1;
    };
    // Where item w's first row sits in a cache, for the prefetch; nullptr past this thread's items
    // or for an empty item.
    const auto first_row = [&](const T* base, int64_t s0, int64_t s1, int64_t w) -> const char* {
      if (w >= w1) return nullptr;
      const auto [lo, hi] = range(w);
      if (lo >= hi) return nullptr;
      return reinterpret_cast<const char*>(row_of(base, s0, s1, w / chunks, lo));
    };
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / chunks, c = w % chunks;
      const std::pair<int64_t, int64_t> item = range(w);
      const int64_t lo = item.first, hi = item.second;  // named: the lambdas below capture them
      const int64_t n = std::max<int64_t>(0, hi - lo);
      std::fill_n(acc, H * Dv, 0.f);
      for (int64_t h = 0; h < H; ++h) {
        const Q* src = qp + b * qs0 + h * qs1;
        for (int64_t i = 0; i < D; ++i) qf[h * D + i] = to_float(src[i]) * fscale;
      }
      // f(x, rows, next, offset) for each block of [lo, hi) of one cache: its first row (x), the
      // next block to prefetch (as many rows as this one has: past a chunk's end none are needed;
      // `after` for the last block) and the block's first token's offset from lo.
      const auto each_block = [&](const T* base, int64_t s0, int64_t s1, const char* after, const auto& f) {
        for (int64_t pos = lo; pos < hi;) {
          const int64_t rows = std::min(bs - pos % bs, hi - pos);
          const char* next = next_block(base, s0, tp + b * ts0, pos, hi, bs);
          f(elements(row_of(base, s0, s1, b, pos)), rows, next ? next : after, pos - lo);
          pos += rows;
        }
      };
      // The last K block asks for the first V block, the last V block for the first K block of
      // this thread's next item: each pass would otherwise start on a miss, half the blocks of a
      // short context (cut into chunks of 2 blocks). On the Zen 4 development VM, float32 calls
      // over 128 tokens of KV in RAM went from 31.0 to 26.5 us (benchmarks/RESULTS.md, round
      // thirty-seven).
      each_block(kp, ks0, ks1, first_row(vp, vs0, vs1, w), [&](const auto* kb, int64_t rows, const char* next,
                                                               int64_t off) {
        block_scores(qf, Hkv, group, D, kb, ks1, ks2, rows, next, widened, s + off, chunk_tokens);  // s[h, token - lo]
      });
      if (n > 0) {
        softmax_rows(s, H, chunk_tokens, n, m, l);
      } else {
        std::fill_n(m, H, neg_inf);
        std::fill_n(l, H, 0.f);
      }
      each_block(vp, vs0, vs1, first_row(kp, ks0, ks1, w + 1), [&](const auto* vb, int64_t rows, const char* next,
                                                                   int64_t off) {
        block_values(acc, Hkv, group, Dv, vb, vs1, vs2, rows, next, widened, s + off, chunk_tokens);
      });
      for (int64_t h = 0; h < H; ++h) {
        if (chunks == 1) {  // the whole sequence: normalise into out
          Q* dst = op + b * os0 + h * os1;
          const float inv = l[h] > 0.f ? vscale / l[h] : 0.f;
          for (int64_t i = 0; i < Dv; ++i) dst[i] = static_cast<Q>(acc[h * Dv + i] * inv);
        } else {  // empty chunks (m = -inf, past the end or before the window) merge to nothing
          float* ph = part.at(b, c, h);
          std::copy_n(acc + h * Dv, Dv, ph);
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
    float* const acc = scratch(1, Dv);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H, h = w % H;
      float m = neg_inf, l = 0.f;
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part.at(b, c, h)[Dv]);
      std::fill_n(acc, Dv, 0.f);
      if (m > neg_inf) {
        for (int64_t c = 0; c < chunks; ++c) {
          const float* ph = part.at(b, c, h);
          if (ph[Dv] == neg_inf) continue;
          const float f = std::exp(ph[Dv] - m);
          l += ph[Dv + 1] * f;
          for (int64_t i = 0; i < Dv; ++i) acc[i] += ph[i] * f;
        }
      }
      Q* dst = op + b * os0 + h * os1;
      const float inv = l > 0.f ? vscale / l : 0.f;
      for (int64_t i = 0; i < Dv; ++i) dst[i] = static_cast<Q>(acc[i] * inv);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, double k_scale, double v_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode_attention: q [B, H, D], "
              "k_cache [blocks, block_size, Hkv, D], v_cache [blocks, block_size, Hkv, Dv]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 ? v_cache.scalar_type() == at::kFloat8_e4m3fn
                  : q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype, or both caches be float8_e4m3fn");
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              "paged_decode_attention: k_scale and v_scale must be finite and > 0");
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
    } else if (fp8) {
      decode_attention<scalar_t, at::Float8_e4m3fn>(q, k_cache, v_cache, tables, lens, scale, sliding_window, k_scale,
                                                    v_scale, out);
    } else {
      decode_attention<scalar_t, scalar_t>(q, k_cache, v_cache, tables, lens, scale, sliding_window, 1.0, 1.0, out);
    }
  });
  return out;
}

// The float of each e4m3 byte of x (any shape), through the kernel's own conversion (its tests
// compare it with torch's).
at::Tensor fp8_e4m3_to_float(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat8_e4m3fn || x.scalar_type() == at::kByte),
              "fp8_e4m3_to_float: a CPU float8_e4m3fn or uint8 tensor");
  const at::Tensor bytes = x.contiguous().view(at::kByte);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  tandem::attention::fp8_to_float(bytes.data_ptr<uint8_t>(), bytes.numel(), out.data_ptr<float>());
  return out;
}

}  // namespace

namespace tandem {

void paged_decode_attention_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                int64_t sliding_window, double k_scale, double v_scale, at::Tensor& out) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && kv == v_cache.scalar_type() &&
                  (kv == at::kFloat || kv == at::kBFloat16 || kv == at::kFloat8_e4m3fn),
              "paged_decode_attention_f32: float32 query and output, float32, bfloat16 or float8_e4m3fn caches");
  if (kv == at::kFloat)
    decode_attention<float, float>(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, 1.0, 1.0, out);
  else if (kv == at::kBFloat16)
    decode_attention<float, at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, 1.0,
                                          1.0, out);
  else
    decode_attention<float, at::Float8_e4m3fn>(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                               k_scale, v_scale, out);
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int sliding_window, float k_scale=1.0, float v_scale=1.0) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("fp8_e4m3_to_float(Tensor x) -> Tensor");
  m.impl("fp8_e4m3_to_float", c10::DispatchKey::CPU, TORCH_FN(fp8_e4m3_to_float));
}
