// A Llama-family decoder layer's one-token decode step in one call: RMSNorm, the stacked q/k/v projection, the
// rotation, the cache's write and the decode kernel (headwise::decode_step), o_proj and the residual, RMSNorm, the
// stacked gate/up projection, SiLU(gate) * up, down_proj and the residual. Each step is the op the Python step
// (headwise.models.flat_step) calls, in its order, on the same tensors, so the bits are the same; what goes is
// the Python between them. Built with headwise's other ops by headwise.native; the schema lives in
// headwise.models.native_layer, which decides where it runs (every projection on the panels GEMM, the norms on
// headwise's op, the attention on the decode kernel).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using Maybe = std::optional<at::Tensor>;

// RMSNorm.forward's native rows: float32 x and weight in one op, else the weight times the rows rounded back.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("headwise::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const Maybe&, double)>();
  if (x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat) return op.call(x, weight, eps);
  return weight * op.call(x, std::nullopt, eps);
}

// A kept projection call (headwise.linear.projection.Ready): x made contiguous, then its panels op with its arguments.
// kind 0: panels_linear(x, panels, bias, n); 1: panels_int8_scaled and 2: panels_int8_rows_scaled(x, panels, scales,
// bias, n).
at::Tensor project(const at::Tensor& x, int64_t kind, const at::Tensor& panels, const Maybe& scales, const Maybe& bias,
                   int64_t n) {
  using Plain = at::Tensor(const at::Tensor&, const at::Tensor&, const Maybe&, int64_t);
  using Scaled = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Maybe&, int64_t);
  static const auto plain = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::panels_linear", "").typed<Plain>();
  static const auto int8 = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::panels_int8_scaled", "").typed<Scaled>();
  static const auto rows = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::panels_int8_rows_scaled", "").typed<Scaled>();
  const at::Tensor xc = x.contiguous();
  if (kind == 0) return plain.call(xc, panels, bias, n);
  return (kind == 1 ? int8 : rows).call(xc, panels, *scales, bias, n);
}

// x (B, 1, C) -> (B, 1, C). Projections in order q/k/v, o, gate/up, down: kinds, panels, scales, biases and ns (their
// output widths), one each; qkv_sizes (H * D, Hkv * D, Hkv * Dv); cos and sin the rotation's tables or None; the
// caches (B, Hkv, L, D) written at slot `start`, `real` (B, L) their padding marks or None.
at::Tensor llama_decode_layer(const at::Tensor& x, const at::Tensor& norm1, const at::Tensor& norm2, double eps1, double eps2,
                              at::IntArrayRef kinds, at::TensorList panels, const c10::List<Maybe>& scales,
                              const c10::List<Maybe>& biases, at::IntArrayRef ns, at::IntArrayRef qkv_sizes, int64_t head_dim,
                              const Maybe& cos, const Maybe& sin, at::Tensor k_cache, at::Tensor v_cache, const Maybe& real,
                              int64_t start, double scale) {
  using Step = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Maybe&, const Maybe&, at::Tensor,
                          at::Tensor, const Maybe&, int64_t, double);
  static const auto step = c10::Dispatcher::singleton().findSchemaOrThrow("headwise::decode_step", "").typed<Step>();
  const auto proj = [&](const at::Tensor& in, int64_t i) { return project(in, kinds[i], panels[i], scales.get(i), biases.get(i), ns[i]); };
  const int64_t B = x.size(0);
  const std::vector<at::Tensor> qkv = proj(rms_norm(x, norm1, eps1), 0).split_with_sizes(qkv_sizes, -1);  // (B, 1, H*D), (B, 1, Hkv*D) x2
  const at::Tensor q = qkv[0].view({B, 1, -1, head_dim}).transpose(1, 2);  // (B, H, 1, D)
  const at::Tensor k = qkv[1].view({B, 1, -1, head_dim}).transpose(1, 2);  // (B, Hkv, 1, D)
  const at::Tensor v = qkv[2].view({B, 1, -1, head_dim}).transpose(1, 2);  // (B, Hkv, 1, Dv)
  const at::Tensor context = step.call(q, k, v, cos, sin, k_cache, v_cache, real, start, scale);  // (B, 1, H*Dv)
  const at::Tensor h = x + proj(context, 1);  // (B, 1, C)
  const at::Tensor gate_up = proj(rms_norm(h, norm2, eps2), 2);  // (B, 1, 2I)
  const int64_t I = gate_up.size(-1) / 2;
  at::Tensor gate = gate_up.slice(-1, 0, I), up = gate_up.slice(-1, I, 2 * I);  // (B, 1, I) views
  return h + proj(at::silu_(gate).mul_(up), 3);  // (B, 1, C)
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) { m.impl("llama_decode_layer", &llama_decode_layer); }
