// A pre-norm decoder layer's one-token decode step in one call (the Llama family's and GPT-2's): the norm, the
// stacked q/k/v projection, the rotation (where the layer has one), the cache's write and the decode kernel
// (headwise::decode_step), the output projection and the residual, the norm, the MLP (SwiGLU, or GELU between two
// projections), the residual. Each step is the op the Python step (headwise.models.flat_step) calls, in its order, on
// the same tensors, so the bits are the same; what goes is the Python between them. Built with headwise's other ops
// by headwise.native; the schema lives in headwise.models.native_layer, which decides where it runs (every projection
// on the panels GEMM, torch's linear or oneDNN's, RMSNorm on headwise's op, the attention on the decode kernel).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

using Maybe = std::optional<at::Tensor>;

// The block's norm: RMSNorm.forward's native rows (float32 x and weight in one op, else the weight times the rows
// rounded back) without a bias, nn.LayerNorm's F.layer_norm with one.
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, const Maybe& bias, double eps, bool layer_norm) {
  static const auto rms = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("headwise::rms_norm", "")
                              .typed<at::Tensor(const at::Tensor&, const Maybe&, double)>();
  if (layer_norm) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
  if (x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat) return rms.call(x, weight, eps);
  return weight * rms.call(x, std::nullopt, eps);
}

// oneDNN's inner product over its packed weight (headwise.linear.onednn): `attr` "none", or "gelu" with GELU's
// approximation applied by the GEMM to its sums.
at::Tensor onednn(const at::Tensor& x, const at::Tensor& weight, const Maybe& bias, const std::string& attr,
                  const std::string& approximate) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, attr, c10::List<std::optional<c10::Scalar>>(), approximate};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// A kept projection call (headwise.linear.projection.Ready): x made contiguous, then its function with its arguments.
// kind 0: panels_linear(x, panels, bias, n); 1: panels_int8_scaled and 2: panels_int8_rows_scaled(x, panels, scales,
// bias, n), `weight` holding the panels; 3: F.linear(x, weight, bias); 4: oneDNN's inner_product(x, packed, bias);
// 5: its inner_product_gelu with GELU's `approximate` inside; 6: panels_linear_gelu(x, panels, bias, n, approximate).
at::Tensor project(const at::Tensor& x, int64_t kind, const at::Tensor& weight, const Maybe& scales, const Maybe& bias,
                   int64_t n, const std::string& approximate) {
  using Plain = at::Tensor(const at::Tensor&, const at::Tensor&, const Maybe&, int64_t);
  using Scaled = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Maybe&, int64_t);
  using Gelu = at::Tensor(const at::Tensor&, const at::Tensor&, const Maybe&, int64_t, c10::string_view);
  static const auto plain = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::panels_linear", "").typed<Plain>();
  static const auto int8 = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::panels_int8_scaled", "").typed<Scaled>();
  static const auto rows = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::panels_int8_rows_scaled", "").typed<Scaled>();
  static const auto gelu = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::panels_linear_gelu", "").typed<Gelu>();
  const at::Tensor xc = x.contiguous();
  if (kind == 3) return at::linear(xc, weight, bias);
  if (kind == 4) return onednn(xc, weight, bias, "none", "");
  if (kind == 5) return onednn(xc, weight, bias, "gelu", approximate);
  if (kind == 0) return plain.call(xc, weight, bias, n);
  if (kind == 6) return gelu.call(xc, weight, bias, n, approximate);
  return (kind == 1 ? int8 : rows).call(xc, weight, *scales, bias, n);
}

// x + y, written over y (a projection's own output) where that gives x + y's tensor: the same sums (a + b is b + a)
at::Tensor residual(const at::Tensor& x, at::Tensor y) {
  return y.scalar_type() == x.scalar_type() && y.sizes() == x.sizes() ? y.add_(x) : x + y;
}

// x (B, 1, C) -> (B, 1, C), or a paged batch's packed row (1, N, C) -> (1, N, C). The norms' weights, biases (LayerNorm's) and eps; `layer_norm` whether they are LayerNorms
// (else RMSNorms). Projections in order q/k/v, o, the MLP's up (gate/up stacked for SwiGLU), down: kinds, weights
// (panels or plain), scales, biases and ns (their output widths), one each; qkv_sizes (H * D, Hkv * D, Hkv * Dv); cos and sin the
// rotation's tables or None; the caches (B, Hkv, L, D) written at slot `start`, `real` (B, L) their padding marks or
// None (headwise::decode_step); or, where `paged` gives a paged batch's (slots, rows, tables, seen_to), the caches
// are its pools and the step headwise::paged_step's (`window`, `block_size`); the attention's terms as those steps take
// them (softcap 0: none; sinks (H,) and ALiBi slopes (1 or B, H) float32, or None); `mlp` "swiglu" (SiLU(gate) * up) or
// GELU's approximation ("tanh" or "none") after the up projection.
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& norm1, const Maybe& norm1_bias, const at::Tensor& norm2,
                        const Maybe& norm2_bias, double eps1, double eps2, bool layer_norm, at::IntArrayRef kinds,
                        at::TensorList weights, const c10::List<Maybe>& scales, const c10::List<Maybe>& biases, at::IntArrayRef ns,
                        at::IntArrayRef qkv_sizes, int64_t head_dim, const Maybe& cos, const Maybe& sin, at::Tensor k_cache,
                        at::Tensor v_cache, const Maybe& real, int64_t start, double scale, c10::string_view mlp,
                        at::TensorList paged, std::optional<int64_t> window, int64_t block_size, double softcap,
                        const Maybe& sinks, const Maybe& alibi) {
  using Step = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Maybe&, const Maybe&, at::Tensor,
                          at::Tensor, const Maybe&, int64_t, double, double, const Maybe&, const Maybe&);
  using Paged = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Maybe&, const Maybe&, at::Tensor,
                           at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           std::optional<int64_t>, int64_t, double, double, const Maybe&, const Maybe&);
  static const auto step = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::decode_step", "").typed<Step>();
  static const auto paged_step = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::paged_step", "").typed<Paged>();
  const std::string approximate(mlp);  // GELU's, where the MLP has one
  const auto proj = [&](const at::Tensor& in, int64_t i) { return project(in, kinds[i], weights[i], scales.get(i), biases.get(i), ns[i], approximate); };
  const int64_t B = x.size(0), T = x.size(1);  // (T = 1, or a paged row's N tokens with B = 1)
  const at::Tensor qkv = proj(norm(x, norm1, norm1_bias, eps1, layer_norm), 0).contiguous();  // (B, T, W = H*D + 2*Hkv*D)
  const int64_t W = qkv.size(-1), start0 = qkv.storage_offset();
  const auto heads = [&](int64_t from, int64_t width) {  // columns from .. from + width as (B, width / D, T, D): one view
    return qkv.as_strided({B, width / head_dim, T, head_dim}, {T * W, head_dim, W, 1}, start0 + from);  // (split, view, transpose)
  };
  const at::Tensor q = heads(0, qkv_sizes[0]);  // (B, H, T, D)
  const at::Tensor k = heads(qkv_sizes[0], qkv_sizes[1]);  // (B, Hkv, T, D)
  const at::Tensor v = heads(qkv_sizes[0] + qkv_sizes[1], qkv_sizes[2]);  // (B, Hkv, T, Dv)
  const at::Tensor context = paged.empty()
                                 ? step.call(q, k, v, cos, sin, k_cache, v_cache, real, start, scale, softcap, sinks, alibi)
                                 : paged_step.call(q, k, v, cos, sin, k_cache, v_cache, paged[0], paged[1], paged[2], paged[3], window,
                                                   block_size, scale, softcap, sinks, alibi);  // (B, T, H*Dv)
  const at::Tensor h = residual(x, proj(context, 1));  // (B, T, C)
  at::Tensor up = proj(norm(h, norm2, norm2_bias, eps2, layer_norm), 2);  // (B, T, 2I) for SwiGLU, else (B, T, I)
  if (mlp == "swiglu") {
    const int64_t I = up.size(-1) / 2;
    at::Tensor gate = up.slice(-1, 0, I);  // (B, T, I) views
    up = at::silu_(gate).mul_(up.slice(-1, I, 2 * I));
  } else if (kinds[2] != 5 && kinds[2] != 6) {  // (kinds 5 and 6 applied it inside the GEMM)
    up = at::gelu_(up, mlp);
  }
  return residual(h, proj(up, 3));  // (B, T, C)
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) { m.impl("decode_layer", &decode_layer); }
// oneDNN's packed weights are MkldnnCPU tensors: a call that holds one dispatches there (the same function).
TORCH_LIBRARY_IMPL(headwise, MkldnnCPU, m) { m.impl("decode_layer", &decode_layer); }
