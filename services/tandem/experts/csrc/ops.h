// The kernels one translation unit calls from another: the routed experts and dense layers
// (moe_cpu.cpp), paged decode attention (paged_attention.cpp), and the fused decode layer
// (decode_layer.cpp) that strings them together, and the data plane's frames (data_plane.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace tandem {

// How a weight matrix is stored (tandem.experts.native.KIND_* on the Python side).
enum Kind : int64_t { kF32 = 0, kBF16 = 1, kInt8 = 2, kInt4 = 3 };

void moe_forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, int64_t kind, int64_t group,
                 const at::Tensor& gu, const at::Tensor& gu_scale, const at::Tensor& gu_min, const at::Tensor& dn,
                 const at::Tensor& dn_scale, const at::Tensor& dn_min, at::Tensor& out, at::Tensor& scratch);

void linear_forward(const at::Tensor& x, int64_t kind, const at::Tensor& w, const at::Tensor& scale, at::Tensor& out);

// out[i] = silu(g[i]) * u[i] for n floats (out may be g): the routed experts' SwiGLU activation, on
// the instruction set in use.
void silu_mul_f32(const float* g, const float* u, float* out, int64_t n);

void linear_forward_multi(const at::Tensor& x, int64_t kind, const std::vector<at::Tensor>& ws,
                          const std::vector<at::Tensor>& scales, std::vector<at::Tensor>& outs);

// out [B, H, Dv] = paged decode attention of q [B, H, D] (see paged_attention.cpp): q and out
// float32, the caches float32, bfloat16 or float8_e4m3fn (holding K / k_scale and V / v_scale).
void paged_decode_attention_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                int64_t sliding_window, double k_scale, double v_scale, at::Tensor& out);

// The routed experts of one MoE layer computed by the experts process over the data plane's
// connection fd (data_plane.cpp): sends hidden [T, H] f32, ids [T, k] int64 and weights [T, k]
// f32 as one request frame and reads the answer into out [T, H]. Throws the `wire` module's
// exceptions: Refused (the peer answered with an error status), Closed, TimedOut, SocketError,
// BadFrame (the connection is then out of step).
void remote_experts(int fd, int64_t layer, const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                    at::Tensor& out, int64_t spin_us, int64_t timeout_ms);

// Registers the DecodeLayer class on the extension module.
void bind_decode_layer(pybind11::module& m);

// Registers the `wire` submodule: the experts data plane's frames (data_plane.cpp).
void bind_data_plane(pybind11::module& m);

}  // namespace tandem
