// One decoder layer's decode step on the CPU in a single call: RMSNorm, Q/K/V, (Q/K norm),
// RoPE, the KV write, paged attention, the output projection, RMSNorm, the router's softmax
// top-k and the routed experts, with both residual adds.
//
// Why: on a CPU decode step the weights are the memory traffic, and every big read (an
// expert, a projection) flushes the caches. The ~150 small torch ops a layer ran between
// those reads then each ran cold: a 1024-wide RMSNorm took 90 us after a 16 MB read against
// 25 us warm, and a step of the benchmark Mixtral spent ~4 ms of its 13 in them. Here the
// glue is a few loops over the token's vectors and the big reads are the same kernels
// (linear_forward, moe_forward, the paged decode attention) the Python path calls.
//
// Scope: grouped-query attention with rotate-half RoPE, then routed experts (Mixtral, Qwen3-MoE),
// routed experts beside a sigmoid-gated shared expert (Qwen2-MoE), or a dense SwiGLU MLP (Llama,
// Qwen2-MoE's dense layers); float32 activations, a float32, bfloat16 or fp8 (e4m3, with the layer's
// k_scale and v_scale: tandem.kv.fp8) KV cache, dense weights f32, bf16 or int8, experts in any kind
// moe_forward takes. A bf16 model's residual stream is float32
// here, as llama.cpp keeps it: its weights and KV cache stay bf16, the arithmetic is float32.
// Experts that live in the split deployment's experts process are either called from here over
// the data plane (`decode_layers` with a connection), or `attention` stops at the router and the
// caller sends its outputs to them.
// tandem/model/native_decode.py decides when a step qualifies and otherwise the model runs its
// torch path.

#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <tuple>
#include <vector>

#include "ops.h"

namespace tandem {
namespace {

// A dense projection: weight [N, K] in f32 (kind 0), bf16 (kind 1) or int8 rows with f32 scales
// (kind 2), optional bias [N]. Inputs and outputs are f32.
struct Dense {
  int64_t kind = kF32;
  at::Tensor weight, scale, bias;

  int64_t out_features() const { return weight.size(0); }

  void check(const char* name, int64_t in_features) const {
    TORCH_CHECK(weight.defined() && weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == in_features,
                name, ": weight must be contiguous [N, ", in_features, "]");
    TORCH_CHECK((kind == kF32 && weight.scalar_type() == at::kFloat) ||
                    (kind == kBF16 && weight.scalar_type() == at::kBFloat16) ||
                    (kind == kInt8 && weight.scalar_type() == at::kChar && scale.defined() &&
                     scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0)),
                name, ": weight must be f32 (kind 0), bf16 (kind 1) or int8 with f32 row scales (kind 2)");
    TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == weight.size(0)), name,
                ": bias must be f32 [N]");
  }

  // out [T, N] = x [T, K] W^T + bias
  void operator()(const at::Tensor& x, at::Tensor& out) const {
    linear_forward(x, kind, weight, kind == kInt8 ? scale : at::Tensor(), out);
    add_bias(out);
  }

  void add_bias(at::Tensor& out) const {
    if (!bias.defined()) return;
    const float* b = bias.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const int64_t T = out.size(0), N = out.size(1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) o[t * N + n] += b[n];
  }
};

// outs = x times each of `ds` (same input); one parallel region when they share a storage kind.
void project(const at::Tensor& x, std::initializer_list<const Dense*> ds, std::vector<at::Tensor>& outs) {
  const int64_t kind = (*ds.begin())->kind;
  bool same = true;
  for (const Dense* d : ds) same = same && d->kind == kind;
  size_t i = 0;
  if (!same) {
    for (const Dense* d : ds) (*d)(x, outs[i++]);
    return;
  }
  std::vector<at::Tensor> ws, scales;
  for (const Dense* d : ds) {
    ws.push_back(d->weight);
    if (kind == kInt8) scales.push_back(d->scale);
  }
  linear_forward_multi(x, kind, ws, scales, outs);
  for (const Dense* d : ds) d->add_bias(outs[i++]);
}

// out[r] = w * (x[r] / rms(x[r])) for `rows` rows of width n, as transformers' RMSNorm in float32:
// the mean of squares, rsqrt(mean + eps), the product, then the weight.
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0.0;  // torch reduces pairwise in float; a double sum is as close to exact
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.f / std::sqrt(static_cast<float>(ss / n) + eps);
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

// Rotate-half RoPE in place on x [T, heads, D]; cos/sin [T, D] (each half repeated, as the model builds them).
void rope(float* x, int64_t T, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

constexpr float kFp8Max = 448.f;  // e4m3's largest finite number

// One number as the cache stores it: a bf16 cache rounds to nearest even, as torch's
// `.to(torch.bfloat16)`; an fp8 one stores x times 1 / scale saturated at +-448, then rounded, as
// tandem.kv.fp8.quantize (NaN stays NaN).
template <typename C>
inline C stored(float x, float) {
  return static_cast<C>(x);
}
template <>
inline at::Float8_e4m3fn stored<at::Float8_e4m3fn>(float x, float inv_scale) {
  const float y = x * inv_scale;
  return at::Float8_e4m3fn(y > kFp8Max ? kFp8Max : y < -kFp8Max ? -kFp8Max : y);
}

// Rows [T, heads * D] into cache [blocks, block_size, heads, D] (any strides, last dim
// contiguous) at slots[t] = block * block_size + offset, as `stored` makes them.
template <typename C>
void write_cache_as(const float* rows, int64_t T, int64_t heads, int64_t D, at::Tensor& cache, const int64_t* slots,
                    float inv_scale) {
  const int64_t bs = cache.size(1), s0 = cache.stride(0), s1 = cache.stride(1), s2 = cache.stride(2);
  C* base = cache.data_ptr<C>();
  for (int64_t t = 0; t < T; ++t) {
    C* dst = base + (slots[t] / bs) * s0 + (slots[t] % bs) * s1;
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = rows + (t * heads + h) * D;
      for (int64_t i = 0; i < D; ++i) dst[h * s2 + i] = stored<C>(src[i], inv_scale);
    }
  }
}

// scale: an fp8 cache's (others ignore it).
void write_cache(const float* rows, int64_t T, int64_t heads, int64_t D, at::Tensor& cache, const int64_t* slots,
                 double scale) {
  const float inv_scale = static_cast<float>(1.0 / scale);  // as Python's 1.0 / scale, then float32
  if (cache.scalar_type() == at::kFloat)
    write_cache_as<float>(rows, T, heads, D, cache, slots, inv_scale);
  else if (cache.scalar_type() == at::kBFloat16)
    write_cache_as<at::BFloat16>(rows, T, heads, D, cache, slots, inv_scale);
  else
    write_cache_as<at::Float8_e4m3fn>(rows, T, heads, D, cache, slots, inv_scale);
}

// Row `row` of a float32 or bfloat16 matrix [rows, n] (an embedding) into out [n] as float32.
void copy_row(const at::Tensor& m, int64_t row, float* out) {
  const int64_t n = m.size(1);
  if (m.scalar_type() == at::kFloat) {
    std::copy_n(m.data_ptr<float>() + row * n, n, out);
  } else {
    const at::BFloat16* src = m.data_ptr<at::BFloat16>() + row * n;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
  }
}

// Softmax over E router logits, the top k (descending), optionally renormalised to sum 1. A token
// whose logits hold a NaN (its hidden state went bad) still gets k distinct experts in range, with
// NaN weights: its output stays NaN, which ends that sequence alone (its logits reach the sampler
// as NaN), where an id of -1 would index out of the experts.
void route(const float* logits, int64_t T, int64_t E, int64_t k, bool normalize, int64_t* ids, float* wts) {
  std::vector<float> p(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    const float m = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - m));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    float chosen = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
      if (best < 0)  // only NaNs left: the first expert not taken yet (k <= E, so there is one)
        for (int64_t e = 0; e < E && best < 0; ++e)
          if (p[e] != -1.f) best = e;
      ids[t * k + j] = best;
      wts[t * k + j] = p[best];
      chosen += p[best];
      p[best] = -1.f;  // taken
    }
    if (normalize)
      for (int64_t j = 0; j < k; ++j) wts[t * k + j] /= chosen;
  }
}

// Wall-clock time per phase of the decode layer, summed over calls while on (set_profile): what
// benchmarks/step_profile.py reports. Off, each phase mark is one relaxed load.
// The last two are decode_greedy's, once a step: the LM head with its argmax, and the engine's
// callback (which takes the GIL).
enum Phase { kInputNorm, kQKV, kRopeCache, kAttend, kOProj, kRouter, kExperts, kHead, kOnStep, kPhases };
constexpr const char* kPhaseNames[kPhases] = {"input_norm", "qkv", "qk_norm_rope_kv_write", "attention",
                                              "o_proj_residual", "post_norm_router", "experts", "head_argmax",
                                              "on_step"};
std::atomic<bool> g_profile{false};
double g_phase_seconds[kPhases] = {};
int64_t g_profiled_calls = 0;

// One per layer call: counts the call when profiling is on (decode_greedy's, counted false, is
// once a step), then marks where each phase ends.
struct PhaseClock {
  bool on = g_profile.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point last =
      on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  explicit PhaseClock(bool counted = true) {
    if (on && counted) ++g_profiled_calls;
  }
  void mark(Phase p) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    g_phase_seconds[p] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

}  // namespace

// A connection to the experts process's data plane (tandem.rpc.expert_wire): the socket, how
// long to poll for each answer before sleeping, and the socket's timeout (-1: none).
struct DataPlane {
  int64_t fd = -1, spin_us = 0, timeout_ms = -1;
};

struct DecodeLayer {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6, scale = 1.0;
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm/k_norm undefined: no Q/K norm
  Dense q, k, v, o;
  Dense router;  // [E, hidden]
  // A SwiGLU MLP: a dense layer's MLP (the router undefined: no routed experts), or an MoE layer's
  // shared expert (Qwen2-MoE), gated per token by sigmoid(shared_expert_gate . h) when that is
  // defined. Undefined weights: none.
  Dense mlp_gate, mlp_up, mlp_down, shared_expert_gate;
  int64_t top_k = 0;
  bool normalize = true;
  int64_t expert_kind = 0, group = 32;
  at::Tensor gate_up, gate_up_scale, gate_up_min, down, down_scale, down_min;
  int64_t layer = 0;  // the model's layer index: the data plane's frames name it
  double k_scale = 1.0, v_scale = 1.0;  // an fp8 KV cache's scales (tandem.kv.fp8); others ignore them

  // Everything the layer holds, checked once (the Python side calls this after filling it in).
  void check() const {
    TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "DecodeLayer: bad head layout");
    TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
                "DecodeLayer: k_scale and v_scale must be finite and > 0");
    for (const at::Tensor* w : {&input_norm, &post_norm})
      TORCH_CHECK(w->defined() && w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == hidden,
                  "DecodeLayer: norm weights must be contiguous f32 [hidden]");
    TORCH_CHECK(q_norm.defined() == k_norm.defined(), "DecodeLayer: Q norm and K norm come together");
    if (q_norm.defined())
      for (const at::Tensor* w : {&q_norm, &k_norm})
        TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == head_dim,
                    "DecodeLayer: Q/K norm weights must be contiguous f32 [head_dim]");
    q.check("q_proj", hidden);
    k.check("k_proj", hidden);
    v.check("v_proj", hidden);
    o.check("o_proj", heads * head_dim);
    TORCH_CHECK(q.out_features() == heads * head_dim && k.out_features() == kv_heads * head_dim &&
                    v.out_features() == kv_heads * head_dim && o.out_features() == hidden,
                "DecodeLayer: projection sizes do not match the head layout");
    TORCH_CHECK(is_moe() || has_mlp(), "DecodeLayer: neither a router nor an MLP");
    if (has_mlp()) {
      mlp_gate.check("mlp gate_proj", hidden);
      mlp_up.check("mlp up_proj", hidden);
      mlp_down.check("mlp down_proj", mlp_gate.out_features());
      TORCH_CHECK(mlp_up.out_features() == mlp_gate.out_features() && mlp_down.out_features() == hidden,
                  "DecodeLayer: the MLP's sizes do not match");
    }
    if (shared_expert_gate.weight.defined()) {
      TORCH_CHECK(is_moe() && has_mlp(), "DecodeLayer: a shared_expert_gate needs a router and a shared expert");
      shared_expert_gate.check("shared_expert_gate", hidden);
      TORCH_CHECK(shared_expert_gate.out_features() == 1, "DecodeLayer: shared_expert_gate must be [1, hidden]");
    }
    if (!is_moe()) return;  // a dense layer: no routed experts
    router.check("router", hidden);
    const int64_t E = router.out_features();
    TORCH_CHECK(top_k > 0 && top_k <= E, "DecodeLayer: top_k must be in [1, E]");
    TORCH_CHECK(gate_up.defined() == down.defined(), "DecodeLayer: gate_up and down come together");
    if (gate_up.defined())  // else the experts are elsewhere: only `attention` runs here
      TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(0) == E && down.dim() == 3 && down.size(0) == E &&
                      down.size(1) == hidden,
                  "DecodeLayer: experts must be gate_up [E, 2I, *] and down [E, hidden, *] for the router's E");
  }

  // The attention half of one decode step of T tokens (one per sequence), up to the router.
  // x [T, hidden] f32 is the residual stream, updated in place (attention output added);
  // cos/sin [T, head_dim]; caches [blocks, block_size, kv_heads, head_dim] f32, bf16 or fp8; slots [T],
  // block_tables [T, max_blocks], seq_lens [T] int64. Returns the experts' input
  // (post-attention RMSNorm of x) [T, hidden], the experts each token goes to, ids [T, top_k]
  // int64, and their weights [T, top_k] f32: what an expert executor takes. A shared expert is
  // then the caller's to add too.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> attention(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                                           at::Tensor& k_cache, at::Tensor& v_cache,
                                                           const at::Tensor& slots, const at::Tensor& block_tables,
                                                           const at::Tensor& seq_lens, int64_t sliding_window) const {
    PhaseClock clock;
    return run_attention(x, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens, sliding_window, clock);
  }

  // The whole decode step with the routed experts in this process (the layer holds them):
  // `attention`, then the experts, added to x. Returns the seconds spent in the experts and
  // the ids [T, top_k] they were called with (for the callers' metrics).
  std::tuple<double, at::Tensor> forward(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                         int64_t sliding_window) const {
    return forward_with(x, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens, sliding_window, nullptr);
  }

  // `forward` with the experts in this process (remote null) or in the experts process, over
  // the data plane (the seconds are then the round trip's).
  std::tuple<double, at::Tensor> forward_with(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                              at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                              int64_t sliding_window, const DataPlane* remote) const {
    TORCH_CHECK(!is_moe() || remote != nullptr || (gate_up.defined() && down.defined()),
                "DecodeLayer.forward: this layer holds no experts");
    PhaseClock clock;
    auto [h, ids, wts] =
        run_attention(x, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens, sliding_window, clock);
    const int64_t T = x.size(0);
    if (T == 0) return {0.0, ids};
    if (!is_moe()) {  // a dense layer: x + mlp(h), as transformers adds it
      add_mlp(h, x);
      clock.mark(kExperts);
      return {0.0, ids};
    }
    at::Tensor out = at::empty_like(h);
    const auto start = std::chrono::steady_clock::now();
    if (remote != nullptr) {
      remote_experts(remote->fd, layer, h, ids, wts, out, remote->spin_us, remote->timeout_ms);
    } else {
      at::Tensor scratch = at::empty({T * top_k * (gate_up.size(1) / 2)}, h.options());
      moe_forward(h, ids, wts, expert_kind, group, gate_up, gate_up_scale, gate_up_min, down, down_scale, down_min,
                  out, scratch);
    }
    const double expert_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (has_mlp()) add_mlp(h, out);  // the shared expert
    add_(x, out);
    clock.mark(kExperts);
    return {expert_seconds, ids};
  }

  bool is_moe() const { return router.weight.defined(); }
  bool has_mlp() const { return mlp_gate.weight.defined(); }

 private:
  std::tuple<at::Tensor, at::Tensor, at::Tensor> run_attention(at::Tensor& x, const at::Tensor& cos,
                                                           const at::Tensor& sin,
                                                           at::Tensor& k_cache, at::Tensor& v_cache,
                                                           const at::Tensor& slots, const at::Tensor& block_tables,
                                                           const at::Tensor& seq_lens, int64_t sliding_window,
                                                           PhaseClock& clock) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "DecodeLayer: x must be contiguous f32 [T, ", hidden, "]");
    const int64_t T = x.size(0);
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == T * head_dim && sin.numel() == T * head_dim,
                "DecodeLayer: cos and sin must be contiguous f32 [T, head_dim]");
    for (const at::Tensor* c : {&k_cache, &v_cache})
      TORCH_CHECK((c->scalar_type() == at::kFloat || c->scalar_type() == at::kBFloat16 ||
                   c->scalar_type() == at::kFloat8_e4m3fn) &&
                      c->scalar_type() == k_cache.scalar_type() && c->dim() == 4 && c->size(2) == kv_heads &&
                      c->size(3) == head_dim && c->stride(3) == 1,
                  "DecodeLayer: caches must be f32, bf16 or float8_e4m3fn (both alike) "
                  "[blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T &&
                    seq_lens.scalar_type() == at::kLong && seq_lens.numel() == T &&
                    block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == T,
                "DecodeLayer: slots [T], seq_lens [T] and block_tables [T, max_blocks] must be int64");
    const auto f32 = x.options();
    at::Tensor h = at::empty({T, hidden}, f32);
    const int64_t chosen = is_moe() ? top_k : 0;  // experts per token
    at::Tensor ids = at::empty({T, chosen}, f32.dtype(at::kLong)), wts = at::empty({T, chosen}, f32);
    if (T == 0) return {h, ids, wts};
    const int64_t capacity = k_cache.size(0) * k_cache.size(1);
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "DecodeLayer: slot ", sp[t], " outside the cache");

    const float epsf = static_cast<float>(eps);
    const int64_t E = is_moe() ? router.out_features() : 0, qw = heads * head_dim, kw = kv_heads * head_dim;
    rms_norm(x.data_ptr<float>(), input_norm.data_ptr<float>(), h.data_ptr<float>(), T, hidden, epsf);
    clock.mark(kInputNorm);
    std::vector<at::Tensor> qkv{at::empty({T, qw}, f32), at::empty({T, kw}, f32), at::empty({T, kw}, f32)};
    project(h, {&q, &k, &v}, qkv);
    clock.mark(kQKV);
    at::Tensor &qb = qkv[0], &kb = qkv[1], &vb = qkv[2];
    if (q_norm.defined()) {
      rms_norm(qb.data_ptr<float>(), q_norm.data_ptr<float>(), qb.data_ptr<float>(), T * heads, head_dim, epsf);
      rms_norm(kb.data_ptr<float>(), k_norm.data_ptr<float>(), kb.data_ptr<float>(), T * kv_heads, head_dim, epsf);
    }
    rope(qb.data_ptr<float>(), T, heads, head_dim, cos.data_ptr<float>(), sin.data_ptr<float>());
    rope(kb.data_ptr<float>(), T, kv_heads, head_dim, cos.data_ptr<float>(), sin.data_ptr<float>());
    write_cache(kb.data_ptr<float>(), T, kv_heads, head_dim, k_cache, sp, k_scale);
    write_cache(vb.data_ptr<float>(), T, kv_heads, head_dim, v_cache, sp, v_scale);
    clock.mark(kRopeCache);
    at::Tensor attn = at::empty({T, heads, head_dim}, f32);
    paged_decode_attention_f32(qb.view({T, heads, head_dim}), k_cache, v_cache, block_tables, seq_lens, scale,
                               sliding_window, k_scale, v_scale, attn);
    clock.mark(kAttend);
    at::Tensor ob = at::empty({T, hidden}, f32);
    o(attn.view({T, qw}), ob);
    add_(x, ob);
    clock.mark(kOProj);

    rms_norm(x.data_ptr<float>(), post_norm.data_ptr<float>(), h.data_ptr<float>(), T, hidden, epsf);
    if (!is_moe()) return {h, ids, wts};  // a dense layer: ids and weights are [T, 0]
    at::Tensor logits = at::empty({T, E}, f32);
    router(h, logits);
    route(logits.data_ptr<float>(), T, E, top_k, normalize, ids.data_ptr<int64_t>(), wts.data_ptr<float>());
    clock.mark(kRouter);
    return {h, ids, wts};
  }

  // out [T, hidden] += g * down(silu(gate(h)) * up(h)), g = sigmoid(shared_expert_gate(h)) or 1: a
  // dense layer's MLP, or the shared expert added to the routed experts' sum as transformers adds it.
  void add_mlp(const at::Tensor& h, at::Tensor& out) const {
    const int64_t T = h.size(0), I = mlp_gate.out_features();
    std::vector<at::Tensor> gu{at::empty({T, I}, h.options()), at::empty({T, I}, h.options())};
    project(h, {&mlp_gate, &mlp_up}, gu);
    float* g = gu[0].data_ptr<float>();
    silu_mul_f32(g, gu[1].data_ptr<float>(), g, T * I);
    at::Tensor d = at::empty({T, hidden}, h.options());
    mlp_down(gu[0], d);
    std::vector<float> gate(T, 1.f);  // x + 1 * d is x + d exactly: an ungated MLP adds d itself
    if (shared_expert_gate.weight.defined()) {
      at::Tensor logit = at::empty({T, 1}, h.options());
      shared_expert_gate(h, logit);
      const float* lp = logit.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) gate[t] = 1.f / (1.f + std::exp(-lp[t]));
    }
    const float* dp = d.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < hidden; ++i) op[t * hidden + i] += gate[t] * dp[t * hidden + i];
  }

  static void add_(at::Tensor& x, const at::Tensor& y) {
    float* xp = x.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) xp[i] += yp[i];
  }
};

// out [T, n] = RMSNorm of x [T, n] with weight [n] (the model's final norm after the native layers).
at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be contiguous f32 [T, n]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: weight must be contiguous f32 [n]");
  at::Tensor out = at::empty_like(x);
  rms_norm(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
           static_cast<float>(eps));
  return out;
}

// One decode step through all the layers, in one call from Python: each layer's `forward` in
// turn, then the final RMSNorm. A step's Python between the layers (argument tuples, one pybind
// call and its GIL round trip per layer) runs on caches the weights have just flushed. The
// experts are in this process (data_fd -1: every layer holds its own) or in the experts process,
// called over the data plane connection data_fd (the split deployment). caches: layer i's K and
// V. Returns the final hidden states [T, hidden] and, per layer, the experts' seconds and ids
// (for the callers' metrics).
std::tuple<at::Tensor, std::vector<double>, std::vector<at::Tensor>> decode_layers(
    const std::vector<const DecodeLayer*>& layers, at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
    std::vector<at::Tensor>& k_caches, std::vector<at::Tensor>& v_caches, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t sliding_window, const at::Tensor& final_norm,
    double final_eps, int64_t data_fd, int64_t spin_us, int64_t timeout_ms) {
  const DataPlane plane{data_fd, spin_us, timeout_ms};
  const DataPlane* remote = data_fd >= 0 ? &plane : nullptr;
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "decode_layers: ", layers.size(), " layers but ", k_caches.size(), " K and ", v_caches.size(),
              " V caches");
  std::vector<double> seconds;
  std::vector<at::Tensor> ids;
  seconds.reserve(layers.size());
  ids.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(layers[i] != nullptr, "decode_layers: layer ", i, " is None");
    auto [s, layer_ids] =
        layers[i]->forward_with(x, cos, sin, k_caches[i], v_caches[i], slots, block_tables, seq_lens, sliding_window,
                                remote);
    seconds.push_back(s);
    ids.push_back(std::move(layer_ids));
  }
  return {rms_norm_f32(x, final_norm, final_eps), std::move(seconds), std::move(ids)};
}

// The index of the largest of n logits (the first of equal maxima, as torch.argmax), or kNoToken
// (tandem.engine.sampling_params.NO_TOKEN) when the row holds a NaN or its largest is not finite
// (+inf, or all -inf): the model went wrong for that sequence, which the scheduler then finishes
// with "error", as the Python sampler's rows.
constexpr int64_t kNoToken = -1;
int64_t argmax_row(const float* l, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(l[i])) return kNoToken;
    if (l[i] > l[best]) best = i;
  }
  return std::isfinite(l[best]) ? best : kNoToken;
}

// Greedy decode steps in a row, in one call: a multi-step decode run (tandem.engine's
// --num-scheduler-steps) of sequences that all sample greedily. Step s looks up the embeddings of
// the tokens ids (step 0) or of step s - 1's argmax tokens, and the RoPE rows of their positions,
// runs decode_layers (experts in this process, or in the experts process over the data plane
// connection data_fd), the LM head (`head`, no bias: what CausalLM.compute_logits computes) and
// the argmax. Between the steps nothing returns to Python, whose per-token glue (the embedding,
// the RoPE lookup, the argument lists, the head's and the sampler's dispatch) is otherwise a
// tenth of a token's time on a CPU.
// embed [V, hidden] f32 or bf16; rope [2, P, head_dim] f32 (cos, then sin, of positions [0, P));
// ids [B] int64; positions and slots [S, B] int64 (step s writes its K and V at slots[s] and
// attends to positions[s] + 1 tokens); block_tables cover every step. Each step's tokens go to
// column s of tokens [B, S] int64 as it ends, so when a step throws (the experts process lost)
// the columns before it hold the steps done. on_step (None, or a Python callable) is called with
// the GIL held as on_step(s) after column s is written: the engine streams that step's tokens
// out, and a false return ends the run there (the later columns stay as they were). Returns, per
// step done, what decode_layers returns per layer (expert seconds and ids).
std::tuple<std::vector<std::vector<double>>, std::vector<std::vector<at::Tensor>>> decode_greedy(
    const std::vector<const DecodeLayer*>& layers, const at::Tensor& embed, const at::Tensor& rope,
    const at::Tensor& ids, std::vector<at::Tensor>& k_caches, std::vector<at::Tensor>& v_caches,
    const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& block_tables, int64_t sliding_window,
    const at::Tensor& final_norm, double final_eps, const Dense& head, at::Tensor& tokens, int64_t data_fd,
    int64_t spin_us, int64_t timeout_ms, const pybind11::object& on_step) {
  TORCH_CHECK(!layers.empty() && layers[0] != nullptr, "decode_greedy: no layers");
  const int64_t hidden = layers[0]->hidden, D = layers[0]->head_dim;
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == hidden &&
                  (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16) && embed.is_contiguous(),
              "decode_greedy: embed must be contiguous f32 or bf16 [vocab, ", hidden, "]");
  TORCH_CHECK(rope.dim() == 3 && rope.size(0) == 2 && rope.size(2) == D && rope.scalar_type() == at::kFloat &&
                  rope.is_contiguous(),
              "decode_greedy: rope must be contiguous f32 [2, positions, ", D, "]");
  head.check("decode_greedy: head", hidden);
  TORCH_CHECK(!head.bias.defined(), "decode_greedy: the head takes no bias");
  const int64_t V = embed.size(0), P = rope.size(1), B = ids.numel();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 1,
              "decode_greedy: ids must be contiguous int64 [B]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.dim() == 2 &&
                  positions.is_contiguous() && slots.is_contiguous() && positions.sizes() == slots.sizes() &&
                  positions.size(1) == B,
              "decode_greedy: positions and slots must be contiguous int64 [steps, B]");
  const int64_t S = positions.size(0), N = head.out_features();
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.dim() == 2 &&
                  tokens.size(0) == B && tokens.size(1) == S,
              "decode_greedy: tokens must be contiguous int64 [B, steps]");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * B; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < P, "decode_greedy: position ", pp[i], " outside the RoPE table [0, ", P, ")");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(ip[b] >= 0 && ip[b] < V, "decode_greedy: token ", ip[b], " outside the vocabulary [0, ", V, ")");
  TORCH_CHECK(N <= V, "decode_greedy: the head's ", N, " logits index past the embedding's ", V, " rows");

  const auto f32 = embed.options().dtype(at::kFloat);
  int64_t* tp = tokens.data_ptr<int64_t>();
  std::vector<int64_t> current(ip, ip + B);
  std::vector<std::vector<double>> seconds;
  std::vector<std::vector<at::Tensor>> expert_ids;
  at::Tensor x = at::empty({B, hidden}, f32), cos = at::empty({B, D}, f32), sin = at::empty({B, D}, f32);
  at::Tensor logits = at::empty({B, N}, f32);
  const float* rp = rope.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      copy_row(embed, current[b], x.data_ptr<float>() + b * hidden);
      const int64_t pos = pp[s * B + b];
      std::copy_n(rp + pos * D, D, cos.data_ptr<float>() + b * D);
      std::copy_n(rp + (P + pos) * D, D, sin.data_ptr<float>() + b * D);
    }
    const at::Tensor step_positions = positions.select(0, s);
    auto [h, layer_seconds, layer_ids] =
        decode_layers(layers, x, cos, sin, k_caches, v_caches, slots.select(0, s), block_tables, step_positions + 1,
                      sliding_window, final_norm, final_eps, data_fd, spin_us, timeout_ms);
    PhaseClock clock(false);
    head(h, logits);
    for (int64_t b = 0; b < B; ++b) {
      tp[b * S + s] = argmax_row(logits.data_ptr<float>() + b * N, N);
      current[b] = std::max<int64_t>(tp[b * S + s], 0);  // a sequence ended by kNoToken is fed a real id
    }
    clock.mark(kHead);
    seconds.push_back(std::move(layer_seconds));
    expert_ids.push_back(std::move(layer_ids));
    if (!on_step.is_none()) {
      pybind11::gil_scoped_acquire gil;
      const bool go_on = pybind11::bool_(on_step(s));
      clock.mark(kOnStep);
      if (!go_on) break;
    }
  }
  return {std::move(seconds), std::move(expert_ids)};
}

void bind_decode_layer(pybind11::module& m) {
  namespace py = pybind11;
  m.def(
      "set_decode_profile",
      [](bool on) {
        g_profile.store(on);
        std::fill(std::begin(g_phase_seconds), std::end(g_phase_seconds), 0.0);
        g_profiled_calls = 0;
      },
      "time DecodeLayer's phases from now on (on) or stop; either way the sums restart at zero", py::arg("on"));
  m.def(
      "decode_profile",
      [] {
        py::dict out;
        for (int p = 0; p < kPhases; ++p) out[kPhaseNames[p]] = g_phase_seconds[p];
        out["calls"] = g_profiled_calls;
        return out;
      },
      "seconds per DecodeLayer phase summed over the calls since set_decode_profile(True), and the call count");
  m.def("rms_norm", &rms_norm_f32, "RMSNorm of contiguous f32 rows, as transformers computes it in float32",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("decode_layers", &decode_layers,
        "one decode step through every layer (DecodeLayer.forward in turn) and the final RMSNorm: "
        "(hidden [T, hidden], expert seconds per layer, expert ids per layer)",
        py::arg("layers"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"),
        py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("sliding_window"),
        py::arg("final_norm"), py::arg("final_eps"), py::arg("data_fd") = -1, py::arg("spin_us") = 0,
        py::arg("timeout_ms") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("decode_greedy", &decode_greedy,
        "greedy decode steps in a row, each step's argmax the next one's input, written to tokens [B, steps] "
        "step by step: (expert seconds per step and layer, expert ids per step and layer)",
        py::arg("layers"), py::arg("embed"), py::arg("rope"), py::arg("ids"), py::arg("k_caches"),
        py::arg("v_caches"), py::arg("positions"), py::arg("slots"), py::arg("block_tables"),
        py::arg("sliding_window"), py::arg("final_norm"), py::arg("final_eps"), py::arg("head"), py::arg("tokens"),
        py::arg("data_fd") = -1, py::arg("spin_us") = 0, py::arg("timeout_ms") = -1, py::arg("on_step") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  py::class_<Dense>(m, "Dense", "a dense projection for DecodeLayer: kind 0 f32, kind 1 bf16, kind 2 int8 rows")
      .def(py::init<>())
      .def_readwrite("kind", &Dense::kind)
      .def_readwrite("weight", &Dense::weight)
      .def_readwrite("scale", &Dense::scale)
      .def_readwrite("bias", &Dense::bias);
  py::class_<DecodeLayer>(m, "DecodeLayer", "one GQA + routed-MoE decoder layer's CPU decode step in one call")
      .def(py::init<>())
      .def_readwrite("hidden", &DecodeLayer::hidden)
      .def_readwrite("heads", &DecodeLayer::heads)
      .def_readwrite("kv_heads", &DecodeLayer::kv_heads)
      .def_readwrite("head_dim", &DecodeLayer::head_dim)
      .def_readwrite("eps", &DecodeLayer::eps)
      .def_readwrite("scale", &DecodeLayer::scale)
      .def_readwrite("input_norm", &DecodeLayer::input_norm)
      .def_readwrite("post_norm", &DecodeLayer::post_norm)
      .def_readwrite("q_norm", &DecodeLayer::q_norm)
      .def_readwrite("k_norm", &DecodeLayer::k_norm)
      .def_readwrite("q", &DecodeLayer::q)
      .def_readwrite("k", &DecodeLayer::k)
      .def_readwrite("v", &DecodeLayer::v)
      .def_readwrite("o", &DecodeLayer::o)
      .def_readwrite("router", &DecodeLayer::router)
      .def_readwrite("mlp_gate", &DecodeLayer::mlp_gate)
      .def_readwrite("mlp_up", &DecodeLayer::mlp_up)
      .def_readwrite("mlp_down", &DecodeLayer::mlp_down)
      .def_readwrite("shared_expert_gate", &DecodeLayer::shared_expert_gate)
      .def_readwrite("top_k", &DecodeLayer::top_k)
      .def_readwrite("normalize", &DecodeLayer::normalize)
      .def_readwrite("expert_kind", &DecodeLayer::expert_kind)
      .def_readwrite("group", &DecodeLayer::group)
      .def_readwrite("gate_up", &DecodeLayer::gate_up)
      .def_readwrite("gate_up_scale", &DecodeLayer::gate_up_scale)
      .def_readwrite("gate_up_min", &DecodeLayer::gate_up_min)
      .def_readwrite("down", &DecodeLayer::down)
      .def_readwrite("down_scale", &DecodeLayer::down_scale)
      .def_readwrite("down_min", &DecodeLayer::down_min)
      .def_readwrite("layer", &DecodeLayer::layer)
      .def_readwrite("k_scale", &DecodeLayer::k_scale)
      .def_readwrite("v_scale", &DecodeLayer::v_scale)
      .def("check", &DecodeLayer::check)
      .def("attention", &DecodeLayer::attention, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("sliding_window"), py::call_guard<py::gil_scoped_release>())
      .def("forward", &DecodeLayer::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("sliding_window"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace tandem
