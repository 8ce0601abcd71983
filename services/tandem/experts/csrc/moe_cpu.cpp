// Fused routed-expert forward on the CPU: for the experts a token batch touches,
// gate_up row pairs -> silu(gate) * up, then down rows, with weights read once per step.
//
// As in llama.cpp and KTransformers, the work is split over output rows (in chunks that torch's
// threads take as they come free: parallel_chunks) and each row is streamed once for every token
// routed to its expert. The SIMD width is chosen at run time (__builtin_cpu_supports): AVX-512 where
// present (with AVX512_BF16: bf16 rows by vdpbf16ps), else AVX2 + FMA + F16C, else plain C++.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace tandem {

constexpr int kTile = 4;  // tokens multiplied per weight-row read

// Chunks a parallel region's work is cut into, per thread: the threads take them in turn as
// they finish, so a thread that runs slower (a vCPU its hypervisor shares, a core further from
// the memory) takes fewer, where cutting one range a thread left the others waiting at the
// region's end for it (a decode step at 8 streams waited ~1/5 of one thread's time so). 1 is
// that one range a thread; set_chunks_per_thread changes it (benchmarks/work_chunks.py).
static std::atomic<int64_t> g_chunks_per_thread{8};

static void set_chunks_per_thread(int64_t chunks) {
  TORCH_CHECK(chunks >= 1 && chunks <= 64, "chunks per thread must be in 1..64, got ", chunks);
  g_chunks_per_thread.store(chunks, std::memory_order_relaxed);
}

static int64_t chunks_per_thread() { return g_chunks_per_thread.load(std::memory_order_relaxed); }

// The fewest bytes of weights a chunk reads (4 MiB; fewer chunks where that leaves fewer). Each
// chunk starts its four weight streams anew, and decode's matrices are small: on the Zen 4
// development VM, cutting a single-stream step's regions 16 ways (1 to 12 MB each) against 2 made
// steps 1.06-1.11x as long (int4, int8) in its fast memory spells; a floor of 1 MiB won back a
// third of that, 4 MiB all of it, and 8-stream decode and prefill did not move
// (benchmarks/RESULTS.md, round thirty-six). Larger models' matrices keep their chunks.
// set_chunk_bytes changes it.
static std::atomic<int64_t> g_chunk_bytes{4 << 20};

static void set_chunk_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (int64_t{1} << 30), "chunk bytes must be in 0..2^30, got ", bytes);
  g_chunk_bytes.store(bytes, std::memory_order_relaxed);
}

static int64_t chunk_bytes() { return g_chunk_bytes.load(std::memory_order_relaxed); }

// Bytes ahead of each weight stream the kernels prefetch in software (prefetch_weights; 0: none,
// the hardware prefetchers alone). 1 KiB took four streams of 1 KiB rows from 23.9 to 26.4 GB/s
// on round seven's Sapphire Rapids VM. On AMD cores with AVX-512 (Zen 4 and later) the default is
// none: on the Zen 4 development VM the prefetches held the streams back. Without them int8
// decode ran 1.12-1.27x as fast, bf16 0.97-1.22x, int4 1.02-1.13x, f32 0.99-1.12x, steps
// alternating in one process (benchmarks/RESULTS.md, round thirty-three).
// Read by the kernels as they run: set it between calls (set_weight_prefetch), not during one.
static int64_t default_weight_prefetch() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f") ? 0 : 1024;
}
static int64_t g_weight_prefetch = default_weight_prefetch();

static void set_weight_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= 8192 && bytes % 64 == 0,
              "weight prefetch must be 0..8192 bytes, a multiple of 64 (a cache line), got ", bytes);
  g_weight_prefetch = bytes;
}

// fn(c) for c in [0, chunks), chunk by chunk to the threads as they come free (chunk order
// within a thread is ascending). On one thread, or inside a parallel region, in order here.
template <class F>
static void parallel_chunks(int64_t chunks, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) fn(c);
  });
}

// Chunk c of n, of [0, size), its bounds on multiples of `align` (the last takes the rest).
static inline std::pair<int64_t, int64_t> chunk_bounds(int64_t c, int64_t n, int64_t size, int64_t align) {
  const auto at = [&](int64_t i) { return i >= n ? size : std::min(size, size * i / n / align * align); };
  return {at(c), at(c + 1)};
}

// n chunks rounded down to a multiple of the threads: 5 chunks of a region on 2 threads left one
// thread a fifth of the work alone (8-stream decode steps 1.02-1.07x as long as in 8 or 2 chunks).
static inline int64_t round_to_threads(int64_t n) {
  const int64_t threads = at::get_num_threads();
  return n > threads ? n / threads * threads : n;
}

// Chunks for `size` weight rows of `row_bytes` bytes that each multiply `tokens` activation rows:
// chunks_per_thread() a thread where each chunk keeps at least 8 x tokens rows (at least 16), since
// every chunk reads all the activations again (a prefill's 64 tokens an expert are ~0.2 MB of Q8
// activations at down's 2,816 columns), and chunk_bytes() of weights; else as many as that leaves,
// down to one a thread (16 rows at least).
static inline int64_t num_chunks(int64_t size, int64_t tokens, int64_t row_bytes) {
  const int64_t threads = at::get_num_threads();
  const int64_t rows = std::max<int64_t>({16, 8 * tokens, chunk_bytes() / std::max<int64_t>(1, row_bytes)});
  const int64_t wanted = round_to_threads(std::min(threads * chunks_per_thread(), size / rows));
  return std::max<int64_t>({1, std::min(threads, size / 16), wanted});
}

// One projection's stacked weights [E, rows, K] in one storage format.
struct Mat {
  const void* data;
  // int8: [E, rows], applied by the kernels' callers, not the kernels, which return a row's unscaled
  // sums: a caller scales its results in row order when it uses them. Read beside the weights, a
  // thread's four rows' scales are four more streams, which cost a dense layer's GEMV 13-20% in
  // this VM's fast memory spells (benchmarks/RESULTS.md, round thirty-six).
  const float* scale;
  const uint16_t* scale16;  // int4: [E, rows, K / group] fp16
  const uint16_t* min16;    // int4: [E, rows, K / group] fp16
  const int16_t* iscale;    // int4 with integer scales instead: [E, rows, K / group + 2] (see quant.py)
  int64_t rows, K, group;
  int64_t kind;
};

// One token's activations as the kernels read them: f32, and for int4 rows also Q8 (int8 per
// 32-block in the ISA's superblock order, block scales d padded by 4 floats, group sums xs).
struct Act {
  const float* x;
  const int8_t* q;  // nullptr: the kernels use x
  const float* d;
  const float* xs;    // int4: per-group sums
  const float* dexp;  // int8: block scales per int32 lane
  float c;            // int8: correction (see quantize_act)
  const uint16_t* xb = nullptr;  // bf16 rows on AVX512_BF16: x rounded to bf16 (nullptr: the kernels use x)
};

// Bytes of one of m's rows (int4: its codes, scales and minimums).
static int64_t row_bytes(const Mat& m) {
  switch (m.kind) {
    case kF32: return 4 * m.K;
    case kBF16: return 2 * m.K;
    case kInt8: return m.K;
    default: return m.K / 2 + 4 * (m.K / m.group);
  }
}

// One weight row for the four-row kernels: row `row` of expert `e` of *m.
struct RowRef {
  const Mat* m;
  int64_t e, row;
  int64_t index() const { return e * m->rows + row; }  // among the Mat's E x rows rows
};

static inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// An int4 row with integer scales (Mat::iscale): its float factor, the f32 stored in the two int16
// after its `groups` scales.
static inline float int4_row_factor(const int16_t* isc, int64_t groups) {
  float f;
  std::memcpy(&f, isc + groups, sizeof f);
  return f;
}

// int4 row w's 32-block b dotted with Q8 block b of q (natural order: weight j and j + 16 in byte j).
static inline int32_t int4_block_dot(const uint8_t* w, int64_t b, const int8_t* q) {
  int32_t dot = 0;
  for (int j = 0; j < 16; ++j)
    dot += (w[b * 16 + j] & 0x0F) * q[b * 32 + j] + (w[b * 16 + j] >> 4) * q[b * 32 + 16 + j];
  return dot;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
static inline float half_to_float(uint16_t v) { return _cvtsh_ss(v); }
#define TANDEM_WIDE 0
#include "kernels_impl.h"
#undef TANDEM_WIDE
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace avx512 {
static inline float half_to_float(uint16_t v) { return _cvtsh_ss(v); }
#define TANDEM_WIDE 1
#include "kernels_impl.h"
#undef TANDEM_WIDE
}  // namespace avx512
#pragma GCC pop_options

// AVX-512 with AVX512_BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids): as avx512, and bf16
// rows multiply bf16-rounded activations with vdpbf16ps.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
static inline float half_to_float(uint16_t v) { return _cvtsh_ss(v); }
#define TANDEM_WIDE 1
#define TANDEM_BF16DOT 1
#include "kernels_impl.h"
#undef TANDEM_BF16DOT
#undef TANDEM_WIDE
}  // namespace avx512bf16
#pragma GCC pop_options

namespace scalar {
static float weight(const Mat& m, int64_t r, int64_t k) {
  switch (m.kind) {
    case kF32: return static_cast<const float*>(m.data)[r * m.K + k];
    case kBF16: return bf16_to_float(static_cast<const uint16_t*>(m.data)[r * m.K + k]);
    case kInt8: return static_cast<const int8_t*>(m.data)[r * m.K + k];  // unscaled: see Mat::scale
    default: {
      const uint8_t byte = static_cast<const uint8_t*>(m.data)[r * (m.K / 2) + (k / 32) * 16 + (k % 16)];
      const int q = (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
      const int64_t groups = m.K / m.group, g = r * groups + k / m.group;
      c10::Half s, mn;
      mn.x = m.min16[g];
      if (m.iscale) {  // the group's int16 scale times the row's factor, as quant.py dequantizes
        const int16_t* row = m.iscale + r * (groups + 2);
        return q * (static_cast<float>(row[k / m.group]) * int4_row_factor(row, groups)) + static_cast<float>(mn);
      }
      s.x = m.scale16[g];
      return q * static_cast<float>(s) + static_cast<float>(mn);
    }
  }
}

static void row_dot(const Mat& m, int64_t e, int64_t row, const Act* a, int64_t n, float* res) {
  const int64_t r = e * m.rows + row;
  for (int64_t t = 0; t < n; ++t) {
    float acc = 0.f;
    for (int64_t k = 0; k < m.K; ++k) acc += weight(m, r, k) * a[t].x[k];
    res[t] = acc;
  }
}

static void row_dot2(const Mat& m, int64_t e, int64_t row0, int64_t row1, const Act* a, int64_t n, float* res0,
                     float* res1) {
  row_dot(m, e, row0, a, n, res0);
  row_dot(m, e, row1, a, n, res1);
}

static void row_run4(const RowRef* refs, int64_t count, const Act* a, int64_t n, float* const* res, int64_t stride,
                     int64_t tstride) {
  std::vector<float> row(n);
  for (int64_t i = 0; i < count; ++i)
    for (int r = 0; r < 4; ++r) {
      row_dot(*refs[r].m, refs[r].e, refs[r].row + i, a, n, row.data());
      for (int64_t t = 0; t < n; ++t) res[r][i * stride + t * tstride] = row[t];
    }
}

static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}
}  // namespace scalar

using RowDot = void (*)(const Mat&, int64_t, int64_t, const Act*, int64_t, float*);
using RowDot2 = void (*)(const Mat&, int64_t, int64_t, int64_t, const Act*, int64_t, float*, float*);
using RowRun4 = void (*)(const RowRef*, int64_t, const Act*, int64_t, float* const*, int64_t, int64_t);

// The rows a row_run4 call takes from each of its four streams at most, and a buffer for their
// results: kRun rows of `width` tokens a stream, res[r] the start of stream r's.
constexpr int64_t kRun = 16;
struct RunResults {
  std::vector<float> buf;
  float* res[4];
  explicit RunResults(int64_t width) : buf(4 * kRun * width) {
    for (int r = 0; r < 4; ++r) res[r] = buf.data() + r * kRun * width;
  }
};
using SiluMul = void (*)(const float*, const float*, float*, int64_t);
using QuantizeAct = void (*)(const float*, int64_t, int64_t, int64_t, int8_t*, float*, float*, float*, float*);

using ToBF16 = void (*)(const float*, int64_t, uint16_t*);

static std::string detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return __builtin_cpu_supports("avx512bf16") ? "avx512bf16" : "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return "avx2";
  return "scalar";
}

static std::string g_isa = detect_isa();

static std::vector<std::string> supported_isas() {
  std::vector<std::string> out{"scalar"};
  const std::string best = detect_isa();
  if (best != "scalar") out.push_back("avx2");
  if (best == "avx512" || best == "avx512bf16") out.push_back("avx512");
  if (best == "avx512bf16") out.push_back("avx512bf16");
  return out;
}

static void set_isa(const std::string& isa) {
  for (const auto& s : supported_isas())
    if (s == isa) {
      g_isa = isa;
      return;
    }
  TORCH_CHECK(false, "instruction set '", isa, "' is not supported on this CPU (", detect_isa(), " is the best)");
}

// The kernels of the instruction set in use (g_isa). quantize: nullptr for the scalar kernels,
// which compute int4 rows on the f32 activations; to_bf16: the bf16 rounding of activations for
// bf16 rows, only where vdpbf16ps multiplies them (nullptr elsewhere).
struct Kernels {
  RowDot row_dot;
  RowDot2 row_dot2;
  RowRun4 row_run4;
  SiluMul silu_mul;
  QuantizeAct quantize;
  ToBF16 to_bf16;
};

static Kernels kernels() {
  if (g_isa == "avx512bf16")
    return {avx512bf16::row_dot, avx512bf16::row_dot2, avx512bf16::row_run4, avx512bf16::silu_mul,
            avx512bf16::quantize_act, avx512bf16::to_bf16};
  if (g_isa == "avx512")
    return {avx512::row_dot, avx512::row_dot2, avx512::row_run4, avx512::silu_mul, avx512::quantize_act, nullptr};
  if (g_isa == "avx2")
    return {avx2::row_dot, avx2::row_dot2, avx2::row_run4, avx2::silu_mul, avx2::quantize_act, nullptr};
  return {scalar::row_dot, scalar::row_dot2, scalar::row_run4, scalar::silu_mul, nullptr, nullptr};
}

// Activations of n rows x [n, K] for the kernels, quantized (Q8) when the rows are int8 or int4.
struct ActRows {
  std::vector<Act> rows;
  std::vector<int8_t> q;
  std::vector<float> d, xs, dexp, c;
  std::vector<uint16_t> xb;

  // quantize: nullptr leaves the rows f32 (kind is then ignored). to_bf16 (bf16 rows only): the
  // rows also rounded to bf16 for vdpbf16ps.
  void fill(const float* x, const std::vector<int64_t>& row_of, int64_t K, int64_t group, int64_t kind,
            QuantizeAct quantize, ToBF16 to_bf16 = nullptr) {
    const int64_t n = static_cast<int64_t>(row_of.size());
    const int64_t src_rows = *std::max_element(row_of.begin(), row_of.end()) + 1;
    const int64_t blocks = K / 32 + 4, groups = K / group, lanes = K / 4 + 16;  // padding: see the kernels
    rows.resize(n);
    if (quantize) {
      q.resize(src_rows * K);
      d.assign(src_rows * blocks, 0.f);
      xs.resize(src_rows * groups);
      dexp.resize(src_rows * lanes);
      c.resize(src_rows);
      for (int64_t i = 0; i < src_rows; ++i)
        quantize(x + i * K, K, group, kind, q.data() + i * K, d.data() + i * blocks, xs.data() + i * groups,
                 dexp.data() + i * lanes, c.data() + i);
    }
    if (to_bf16) {
      xb.resize(src_rows * K);
      for (int64_t i = 0; i < src_rows; ++i) to_bf16(x + i * K, K, xb.data() + i * K);
    }
    for (int64_t s = 0; s < n; ++s) {
      const int64_t i = row_of[s];
      rows[s] = quantize ? Act{x + i * K, q.data() + i * K, d.data() + i * blocks, xs.data() + i * groups,
                               dexp.data() + i * lanes, c[i]}
                         : Act{x + i * K, nullptr, nullptr, nullptr, nullptr, 0.f};
      if (to_bf16) rows[s].xb = xb.data() + i * K;
    }
  }
};

static Mat make_mat(int64_t kind, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mn, int64_t K,
                    int64_t group) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), "expert weights must be contiguous [E, N, K]");
  Mat m{w.data_ptr(), nullptr, nullptr, nullptr, nullptr, w.size(1), K, group, kind};
  switch (kind) {
    case kF32: TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(2) == K, "f32 weights: bad dtype or K"); break;
    case kBF16: TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(2) == K, "bf16 weights: bad dtype or K"); break;
    case kInt8:
      TORCH_CHECK(w.scalar_type() == at::kChar && w.size(2) == K, "int8 weights: bad dtype or K");
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == w.size(0) * w.size(1),
                  "int8 scales must be contiguous f32 [E, N]");
      m.scale = scale.data_ptr<float>();
      break;
    case kInt4:
      TORCH_CHECK(w.scalar_type() == at::kByte && w.size(2) * 2 == K, "int4 weights: bad dtype or K");
      TORCH_CHECK((group == 32 || group == 64 || group == 128) && K % group == 0,
                  "int4 group size must be 32, 64 or 128 and divide K");
      TORCH_CHECK(mn.scalar_type() == at::kHalf && mn.is_contiguous() &&
                      mn.numel() == w.size(0) * w.size(1) * (K / group),
                  "int4 mins must be contiguous fp16 [E, N, K / group]");
      m.min16 = reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>());
      if (scale.scalar_type() == at::kShort) {
        TORCH_CHECK(scale.is_contiguous() && scale.numel() == w.size(0) * w.size(1) * (K / group + 2),
                    "int4 integer scales must be contiguous int16 [E, N, K / group + 2]");
        TORCH_CHECK(g_isa.rfind("avx512", 0) != 0,
                    "int4 integer scales are for the avx2 and scalar kernels; this call runs ", g_isa, " "
                    "(the executor stores them only where it runs avx2)");
        m.iscale = scale.data_ptr<int16_t>();
      } else {
        TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == mn.numel(),
                    "int4 scales must be contiguous fp16 [E, N, K / group] or int16 [E, N, K / group + 2]");
        m.scale16 = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
      }
      break;
    default: TORCH_CHECK(false, "unknown weight kind ", kind);
  }
  return m;
}

// Where to cut the active experts' gate_up rows (tokens.size() * I of them, in (expert, row) order)
// into at most `parts` ranges of about equal work, the chunks the threads take (parallel_chunks):
// a row of an expert with c tokens costs c products, or its stream from memory where that takes
// longer (the products overlap the stream: a row of 1024 int8 weights streams in ~90 ns on one of
// two cores sharing ~23 GB/s, the time of ~3 tokens' products), so decode's few tokens an expert
// still cut by rows. Cut by rows alone, expert after expert, routing that favours some experts
// left one thread most of a prefill's products (3/4 of them at 256 tokens with expert e drawn as
// 1 / (e + 1)). Returns the bounds.
constexpr double kRowStream = 3.0;
static std::vector<int64_t> gate_up_ranges(const std::vector<int64_t>& tokens, int64_t I, int64_t parts) {
  const int64_t na = static_cast<int64_t>(tokens.size()), rows = na * I;
  parts = std::max<int64_t>(1, std::min<int64_t>(parts, rows / 16));  // at least ~16 rows a range
  const auto row_cost = [](int64_t c) { return std::max(static_cast<double>(c), kRowStream); };
  double total = 0.0;
  for (const int64_t c : tokens) total += row_cost(c) * static_cast<double>(I);
  std::vector<int64_t> cuts{0};
  double before = 0.0;  // the work of the experts before expert a
  for (int64_t a = 0; a < na; ++a) {
    const double per_row = row_cost(tokens[a]), here = per_row * static_cast<double>(I);
    for (int64_t p = static_cast<int64_t>(cuts.size()); p < parts; ++p) {
      const double target = total * static_cast<double>(p) / static_cast<double>(parts);
      if (target >= before + here) break;  // that cut falls in a later expert
      const int64_t row = a * I + static_cast<int64_t>((target - before) / per_row);
      if (row > cuts.back() && row < rows) cuts.push_back(row);
    }
    before += here;
  }
  cuts.push_back(rows);
  return cuts;
}

// out [T, H] f32 = sum over each token's k experts of weight * down(silu(gate x) * up x).
// scratch: f32 with at least T*k*I elements (the activations between the two projections).
void moe_forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, int64_t kind, int64_t group,
                 const at::Tensor& gu, const at::Tensor& gu_scale, const at::Tensor& gu_min, const at::Tensor& dn,
                 const at::Tensor& dn_scale, const at::Tensor& dn_min, at::Tensor& out, at::Tensor& scratch) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous f32 [T, H]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == x.size(0),
              "ids must be contiguous int64 [T, k]");
  TORCH_CHECK(wts.scalar_type() == at::kFloat && wts.is_contiguous() && wts.sizes() == ids.sizes(),
              "weights must be contiguous f32 [T, k]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
              "out must be contiguous f32 [T, H]");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), n = T * k;
  const int64_t E = gu.size(0), I = gu.size(1) / 2;
  const bool int4 = kind == kInt4;
  const int64_t g = int4 ? group : 32;  // int4 groups; else only sizes buffers
  const Mat gum = make_mat(kind, gu, gu_scale, gu_min, H, group);
  const Mat dnm = make_mat(kind, dn, dn_scale, dn_min, I, group);
  TORCH_CHECK(dn.size(0) == E && dnm.rows == H, "down must be [E, H, I]");
  // int8 rows are scaled as their results are used, in row order (see Mat::scale): SiLU's inputs,
  // and the down rows' sums into out.
  const float* const gu_row_scale = gum.scale;  // [E, 2I]
  const float* const dn_row_scale = dnm.scale;  // [E, H]
  const int64_t need = n * I;
  TORCH_CHECK(scratch.scalar_type() == at::kFloat && scratch.is_contiguous() && scratch.numel() >= need,
              "scratch too small");

  // group assignments by expert: a counting sort, stable in token order
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = wts.data_ptr<float>();
  std::vector<int64_t> begin(E + 1, 0), slot_token(n);
  std::vector<float> slot_weight(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < E, "expert id ", id[i], " out of range [0, ", E, ")");
    ++begin[id[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) begin[e + 1] += begin[e];
  std::vector<int64_t> cursor(begin.begin(), begin.end() - 1), active;
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = cursor[id[i]]++;
    slot_token[pos] = i / k;
    slot_weight[pos] = wt[i];
  }
  for (int64_t e = 0; e < E; ++e)
    if (begin[e + 1] > begin[e]) {
      active.push_back(e);
      most = std::max(most, begin[e + 1] - begin[e]);
    }

  float* act = scratch.data_ptr<float>();  // [n, I]
  const float* xp = x.data_ptr<float>();
  const Kernels kern = kernels();
  // Quantized activations for int4 always, for int8 when K is whole 32-blocks (else f32 math).
  const QuantizeAct quantize = int4 || kind == kInt8 ? kern.quantize : nullptr;
  const QuantizeAct quantize_x = int4 || H % 32 == 0 ? quantize : nullptr;
  const QuantizeAct quantize_act = int4 || I % 32 == 0 ? quantize : nullptr;
  // Reused across calls (grow-only): decode allocates nothing per step.
  static thread_local ActRows x_rows_buf, act_rows_buf;
  ActRows& x_rows = x_rows_buf;  // the workers must see this thread's buffers, not their own
  ActRows& act_rows = act_rows_buf;
  std::vector<int64_t> identity(n);
  for (int64_t s = 0; s < n; ++s) identity[s] = s;
  const ToBF16 to_bf16 = kind == kBF16 ? kern.to_bf16 : nullptr;
  if (n > 0) x_rows.fill(xp, slot_token, H, g, kind, quantize_x, to_bf16);
  const RowDot row_dot = kern.row_dot;
  const RowDot2 row_dot2 = kern.row_dot2;
  const RowRun4 row_run4 = kern.row_run4;
  const int64_t na = static_cast<int64_t>(active.size());

  // gate_up: rows j and I + j of each active expert give activation j of its tokens. A thread
  // takes its rows one expert at a time and walks the two halves of them in lockstep: four
  // weight streams (see row_run4). The results of kRun row pairs are kept, then go through
  // SiLU together, a vector at a time. The threads' ranges are cut by work, not by rows
  // (gate_up_ranges): a prefill's experts differ in tokens, and so in products a row.
  const SiluMul silu_mul = kern.silu_mul;
  std::vector<int64_t> tokens_of(na);
  for (int64_t ai = 0; ai < na; ++ai) tokens_of[ai] = begin[active[ai] + 1] - begin[active[ai]];
  // Rows [r0, r1) of the active experts' gate_up, in (expert, row) order.
  auto gate_up_range = [&](int64_t r0, int64_t r1) {
    // gate and up of the first half's rows, then of the second half's; token-major (row i, token s
    // of stream p at part[p][s * kRun + i]), so that a token's kRun activations are one vector
    RunResults results(most);
    float* const* part = results.res;
    std::vector<float> g(kRun), u(kRun);
    for (int64_t s0 = r0; s0 < r1;) {
      const int64_t ai = s0 / I, s1 = std::min(r1, (ai + 1) * I);
      const int64_t e = active[ai], b = begin[e], c = begin[e + 1] - b;
      const Act* rows = x_rows.rows.data() + b;
      const int64_t j0 = s0 - ai * I, len = s1 - s0, half = (len + 1) / 2;
      // activations j .. j + m of every token from kept rows 0 .. m of part[p] (gate), part[p + 1] (up)
      auto finish = [&](int p, int64_t j, int64_t m) {
        const float* gs = gu_row_scale ? gu_row_scale + e * 2 * I + j : nullptr;  // int8: gate's, then up's
        for (int64_t s = 0; s < c; ++s) {
          const float* gp = part[p] + s * kRun;
          const float* up = part[p + 1] + s * kRun;
          if (gs) {
            for (int64_t i = 0; i < m; ++i) {
              g[i] = gp[i] * gs[i];
              u[i] = up[i] * gs[I + i];
            }
            gp = g.data();
            up = u.data();
          }
          silu_mul(gp, up, act + (b + s) * I + j, m);
        }
      };
      for (int64_t i = 0; i < len - half; i += kRun) {  // a run of up to kRun row pairs a half
        const int64_t ja = j0 + i, jb = j0 + half + i, run = std::min(kRun, len - half - i);
        const RowRef refs[4] = {{&gum, e, ja}, {&gum, e, I + ja}, {&gum, e, jb}, {&gum, e, I + jb}};
        row_run4(refs, run, rows, c, part, 1, kRun);
        finish(0, ja, run);
        finish(2, jb, run);
      }
      if (len % 2) {  // the first half's last row has no partner
        const int64_t j = j0 + half - 1;
        std::vector<float> odd_gate(c), odd_up(c);  // a range's last row at most: not on every run's path
        row_dot2(gum, e, j, I + j, rows, c, odd_gate.data(), odd_up.data());
        for (int64_t s = 0; s < c; ++s) {
          part[0][s * kRun] = odd_gate[s];
          part[1][s * kRun] = odd_up[s];
        }
        finish(0, j, 1);
      }
      s0 = s1;
    }
  };
  // chunks_per_thread() ranges a thread, fewer where a range would read less than chunk_bytes()
  const int64_t threads = at::get_num_threads(), most_parts = threads * chunks_per_thread();
  const int64_t min_bytes = chunk_bytes(), gate_up_bytes = na * I * 2 * row_bytes(gum);
  const int64_t parts =
      round_to_threads(min_bytes ? std::min(most_parts, std::max(threads, gate_up_bytes / min_bytes)) : most_parts);
  const std::vector<int64_t> cuts = gate_up_ranges(tokens_of, I, parts);
  parallel_chunks(static_cast<int64_t>(cuts.size()) - 1, [&](int64_t p) { gate_up_range(cuts[p], cuts[p + 1]); });
  if (n > 0) act_rows.fill(act, identity, I, g, kind, quantize_act, to_bf16);

  // down: each chunk is a range of output columns, so accumulation needs no atomics; a thread
  // walks the four quarters of its chunk in lockstep, expert by expert.
  float* o = out.data_ptr<float>();
  std::memset(o, 0, sizeof(float) * T * H);
  const int64_t down_chunks = num_chunks(H, most, na * row_bytes(dnm));  // a row of each active expert
  parallel_chunks(down_chunks, [&](int64_t chunk) {
    const auto [h0, h1] = chunk_bounds(chunk, down_chunks, H, 16);
    // one expert's results, token-major (token s, row h at s * width + h - h0): a token's adds into
    // out are then one run of columns, a vector at a time
    const int64_t width = h1 - h0;
    std::vector<float> buf(width * most);
    const int64_t q = width / 4;
    for (int64_t e : active) {
      const int64_t b = begin[e], c = begin[e + 1] - b;
      const Act* rows = act_rows.rows.data() + b;
      if (q > 0) {
        const RowRef refs[4] = {{&dnm, e, h0}, {&dnm, e, h0 + q}, {&dnm, e, h0 + 2 * q}, {&dnm, e, h0 + 3 * q}};
        float* const res[4] = {buf.data(), buf.data() + q, buf.data() + 2 * q, buf.data() + 3 * q};
        row_run4(refs, q, rows, c, res, 1, width);
      }
      if (h0 + 4 * q < h1) {  // rows past the last whole quarter: chunks are cut at multiples of 16, so
        // only the last chunk has any, where H is not a multiple of 4
        std::vector<float> tail0(c), tail1(c);
        auto put = [&](int64_t h, const std::vector<float>& v) {
          for (int64_t s = 0; s < c; ++s) buf[s * width + h - h0] = v[s];
        };
        int64_t h = h0 + 4 * q;
        for (; h + 1 < h1; h += 2) {
          row_dot2(dnm, e, h, h + 1, rows, c, tail0.data(), tail1.data());
          put(h, tail0);
          put(h + 1, tail1);
        }
        if (h < h1) {
          row_dot(dnm, e, h, rows, c, tail0.data());
          put(h, tail0);
        }
      }
      // into out, token by token: out[token, h] += weight * (int8: scale[h] *) result
      const float* sc = dn_row_scale ? dn_row_scale + e * H + h0 : nullptr;
      for (int64_t s = 0; s < c; ++s) {
        float* const dst = o + slot_token[b + s] * H + h0;
        const float* d = buf.data() + s * width;
        const float w = slot_weight[b + s];
        if (sc)
          for (int64_t i = 0; i < width; ++i) dst[i] += w * (d[i] * sc[i]);
        else
          for (int64_t i = 0; i < width; ++i) dst[i] += w * d[i];
      }
    }
  });
}

// outs[i] [T, N_i] f32 = x [T, K] times the rows of ws[i] [N_i, K], all in one storage kind:
// dense layers (attention projections, dense MLP, LM head) in f32, bf16 or int8 (per-row f32
// scale) storage. Each row is read once for all T tokens, two rows at a time, as for the experts;
// int8 rows take Q8 activations when K is whole 32-blocks. Several matrices that read the same x
// (Q, K and V) are one parallel region over all their rows, with x quantized once.
void linear_forward_multi(const at::Tensor& x, int64_t kind, const std::vector<at::Tensor>& ws,
                          const std::vector<at::Tensor>& scales, std::vector<at::Tensor>& outs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous f32 [T, K]");
  TORCH_CHECK(kind == kF32 || kind == kBF16 || kind == kInt8, "dense weights must be f32, bf16 or int8");
  TORCH_CHECK(ws.size() == outs.size() && (scales.empty() || scales.size() == ws.size()),
              "one output (and scale, for int8) per weight");
  const int64_t T = x.size(0), K = x.size(1), S = static_cast<int64_t>(ws.size());
  std::vector<Mat> mats;
  mats.reserve(S);  // RowRefs point into it
  std::vector<float*> o(S);
  std::vector<int64_t> first_row(S + 1, 0);  // work items: rows, segment by segment
  for (int64_t i = 0; i < S; ++i) {
    const at::Tensor& w = ws[i];
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == K, "w must be contiguous [N, K]");
    const int64_t N = w.size(0);
    at::Tensor& out = outs[i];
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == T &&
                    out.size(1) == N,
                "out must be contiguous f32 [T, N]");
    const at::Tensor scale = scales.empty() ? at::Tensor() : scales[i];
    mats.push_back(make_mat(kind, w.view({1, N, K}), scale, scale, K, 32));
    o[i] = out.data_ptr<float>();
    first_row[i + 1] = first_row[i] + N;
  }
  if (T == 0 || first_row[S] == 0) return;
  const Kernels kern = kernels();
  const QuantizeAct quantize = kind == kInt8 && K % 32 == 0 ? kern.quantize : nullptr;
  static thread_local ActRows rows_buf;
  ActRows& rows = rows_buf;  // the workers must see this thread's buffers, not their own
  std::vector<int64_t> identity(T);
  for (int64_t t = 0; t < T; ++t) identity[t] = t;
  rows.fill(x.data_ptr<float>(), identity, K, 32, kind, quantize, kind == kBF16 ? kern.to_bf16 : nullptr);
  const RowDot row_dot = kern.row_dot;
  const RowRun4 row_run4 = kern.row_run4;
  // row g over all segments -> its segment
  auto segment = [&](int64_t g) {
    return std::upper_bound(first_row.begin(), first_row.end(), g) - first_row.begin() - 1;
  };
  auto store = [&](int64_t seg, int64_t row, const float* v) {
    const int64_t N = mats[seg].rows;
    for (int64_t t = 0; t < T; ++t) o[seg][t * N + row] = v[t];
  };
  // A thread walks the four quarters of its chunk's rows in lockstep (four weight streams; see
  // row_run4), in runs of up to kRun rows that no quarter takes past the end of its matrix.
  const int64_t chunks = num_chunks(first_row[S], T, row_bytes(mats[0]));
  parallel_chunks(chunks, [&](int64_t chunk) {
    const auto [g0, g1] = chunk_bounds(chunk, chunks, first_row[S], 16);
    RunResults results(T);
    float* const* res = results.res;
    const int64_t q = (g1 - g0) / 4;
    for (int64_t i = 0; i < q;) {
      int64_t seg[4], run = std::min(kRun, q - i);
      RowRef refs[4];
      for (int r = 0; r < 4; ++r) {
        const int64_t g = g0 + r * q + i;
        seg[r] = segment(g);
        refs[r] = RowRef{&mats[seg[r]], 0, g - first_row[seg[r]]};
        run = std::min(run, first_row[seg[r] + 1] - g);
      }
      row_run4(refs, run, rows.rows.data(), T, res, T, 1);
      for (int r = 0; r < 4; ++r)
        for (int64_t j = 0; j < run; ++j) store(seg[r], refs[r].row + j, res[r] + j * T);
      i += run;
    }
    for (int64_t g = g0 + 4 * q; g < g1; ++g) {  // the rows past the last whole quarter
      const int64_t sg = segment(g), row = g - first_row[sg];
      row_dot(mats[sg], 0, row, rows.rows.data(), T, res[0]);
      store(sg, row, res[0]);
    }
    if (kind == kInt8)  // the chunk's outputs times their rows' scales (Mat::scale), matrix by matrix
      for (int64_t sg = segment(g0), g = g0; g < g1; ++sg) {
        const int64_t N = mats[sg].rows, r0 = g - first_row[sg];
        const int64_t r1 = std::min(g1, first_row[sg + 1]) - first_row[sg];
        for (int64_t t = 0; t < T; ++t)
          for (int64_t r = r0; r < r1; ++r) o[sg][t * N + r] *= mats[sg].scale[r];
        g = first_row[sg] + r1;
      }
  });
}

void silu_mul_f32(const float* g, const float* u, float* out, int64_t n) { kernels().silu_mul(g, u, out, n); }

// out [T, N] f32 = x [T, K] times the rows of w [N, K] (see linear_forward_multi).
void linear_forward(const at::Tensor& x, int64_t kind, const at::Tensor& w, const at::Tensor& scale, at::Tensor& out) {
  std::vector<at::Tensor> outs{out};
  linear_forward_multi(x, kind, {w}, kind == kInt8 ? std::vector<at::Tensor>{scale} : std::vector<at::Tensor>{},
                       outs);
}

}  // namespace tandem

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Tandem's fused CPU kernel for routed experts";
  // The kernels run without the GIL: the server's other threads (gRPC, health checks, the token
  // streams) go on while a step computes.
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("moe_forward", &tandem::moe_forward, "fused routed-expert forward into out [T, H]", release_gil());
  m.def("linear_forward", &tandem::linear_forward, "dense layer x [T, K] times w [N, K] into out [T, N]",
        release_gil());
  m.def("linear_forward_multi", &tandem::linear_forward_multi,
        "dense layers that read one x [T, K] (Q, K and V) in one parallel region: outs[i] = x times ws[i]",
        release_gil());
  m.def("set_isa", &tandem::set_isa, "force an instruction set: scalar, avx2, avx512 or avx512bf16");
  m.def("isa", [] { return tandem::g_isa; }, "the instruction set in use");
  m.def("supported_isas", &tandem::supported_isas, "instruction sets this CPU can run");
  m.def("set_chunks_per_thread", &tandem::set_chunks_per_thread,
        "chunks a parallel region's work is cut into per thread, taken as threads come free (1..64)");
  m.def("chunks_per_thread", &tandem::chunks_per_thread, "see set_chunks_per_thread");
  m.def("set_chunk_bytes", &tandem::set_chunk_bytes,
        "the fewest bytes of weights a chunk of a parallel region reads (0..2^30; 0: no floor)");
  m.def("chunk_bytes", &tandem::chunk_bytes, "see set_chunk_bytes");
  m.def("set_weight_prefetch", &tandem::set_weight_prefetch,
        "bytes ahead of each weight stream the kernels prefetch (0: none; between calls, not during one)");
  m.def("weight_prefetch", [] { return tandem::g_weight_prefetch; }, "see set_weight_prefetch");
  tandem::bind_decode_layer(m);
  tandem::bind_data_plane(m);
}
