// Fused CPU optimizer steps over fp32 master weights: Adam/AdamW, LAMB, Adagrad, and a fused
// gradient-norm + inf/nan check. One pass per tensor reads the gradient (fp32 or bf16), applies
// the unscale/clip factor, updates the fp32 weight and states, and writes the 16-bit working copy
// (bf16 or fp16) when one is given, so no separate unscale, cast or copy pass is needed.
//
// Vectorisation: each kernel body is compiled three times (AVX-512, AVX2+FMA, generic) through
// target attributes, and the variant is picked at run time from what the CPU supports. Threads:
// OpenMP over fixed blocks; the reductions sum each block in a fixed order and then the blocks in
// order, so results do not depend on the thread count.
#include "op_headers.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 16384;  // elements per OpenMP work item and per reduction block

enum class Isa { kAvx512, kAvx2, kGeneric };

Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kGeneric;
}

const Isa kIsa = detect_isa();

inline float load_float(const float* p, int64_t i) { return p[i]; }

inline float load_float(const c10::BFloat16* p, int64_t i) {  // exact: bf16 is the top half of an fp32
  const uint32_t bits = static_cast<uint32_t>(p[i].x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// fp32 -> bf16 with round-to-nearest-even and torch's NaN (0x7FC0), branch-free so it vectorises
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : rounded;
}

// The 16-bit working copy of a block just updated (still in cache): no extra pass over memory.
template <typename O>
__attribute__((always_inline)) inline void write_copy_body(const float* __restrict p, O* __restrict out, int64_t n) {
  if constexpr (std::is_same_v<O, c10::BFloat16>) {
    uint16_t* bits = reinterpret_cast<uint16_t*>(out);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) bits[i] = bf16_bits(p[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<O>(p[i]);
  }
}

// Constants are computed in double on the host and rounded once, as torch does with Python
// scalars, and the arithmetic follows torch's operation order (built with -ffp-contract=off).
struct AdamArgs {
  float one_minus_beta1, beta2, one_minus_beta2, eps, l2, decay, neg_step_size, inv_bias2_sqrt, inv_grad_scale;
};

// ---- Adam ----------------------------------------------------------------------------------
template <typename G, typename O>
__attribute__((always_inline)) inline void adam_body(float* __restrict p, const G* __restrict g,
                                                     float* __restrict m, float* __restrict v, O* __restrict out,
                                                     int64_t n, const AdamArgs& a) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float grad = load_float(g, i) * a.inv_grad_scale;  // exact when the scale is 1
    float w = p[i];
    grad = grad + a.l2 * w;  // Adam's L2 term (0 in AdamW mode)
    const float mi = m[i] + a.one_minus_beta1 * (grad - m[i]);  // lerp
    const float vi = v[i] * a.beta2 + a.one_minus_beta2 * grad * grad;
    w = w * a.decay;  // AdamW's decoupled decay (1 in Adam mode)
    w = w + a.neg_step_size * (mi / (std::sqrt(vi) * a.inv_bias2_sqrt + a.eps));
    m[i] = mi;
    v[i] = vi;
    p[i] = w;
  }
  if (out != nullptr) write_copy_body(p, out, n);
}

#define MEGAZERO_VARIANTS(NAME, BODY, PARAMS, ARGS)                                                        \
  template <typename G, typename O>                                                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void NAME##_avx512 PARAMS { BODY<G, O> ARGS; } \
  template <typename G, typename O>                                                                        \
  __attribute__((target("avx2,fma"))) void NAME##_avx2 PARAMS { BODY<G, O> ARGS; }                         \
  template <typename G, typename O>                                                                        \
  void NAME##_generic PARAMS { BODY<G, O> ARGS; }                                                          \
  template <typename G, typename O>                                                                        \
  void NAME PARAMS {                                                                                       \
    if (kIsa == Isa::kAvx512) NAME##_avx512<G, O> ARGS;                                                   \
    else if (kIsa == Isa::kAvx2) NAME##_avx2<G, O> ARGS;                                                  \
    else NAME##_generic<G, O> ARGS;                                                                        \
  }

MEGAZERO_VARIANTS(adam_block, adam_body,
                  (float* p, const G* g, float* m, float* v, O* out, int64_t n, const AdamArgs& a),
                  (p, g, m, v, out, n, a))

// Runs fn(begin, length) over fixed blocks of [0, n) on the OpenMP threads.
template <typename Fn>
void for_blocks(int64_t n, Fn fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock;
    fn(begin, std::min(kBlock, n - begin));
  }
}

void check_master(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.numel() == ref.numel(), what, " has ", t.numel(), " elements, the parameter ", ref.numel());
}

// Dispatches on the gradient dtype (fp32 / bf16) and the 16-bit copy's (none / bf16 / fp16).
template <template <typename, typename> class Kernel, typename... Rest>
void dispatch(const at::Tensor& grad, const c10::optional<at::Tensor>& out, Rest&&... rest) {
  const auto gt = grad.scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kBFloat16, "gradients must be float32 or bfloat16, got ", gt);
  const auto ot = out.has_value() ? out->scalar_type() : at::kFloat;
  TORCH_CHECK(!out.has_value() || ot == at::kBFloat16 || ot == at::kHalf,
              "the 16-bit copy must be bfloat16 or float16, got ", ot);
#define MEGAZERO_RUN(GT, OT)                                                                                   \
  Kernel<GT, OT>::run(grad.data_ptr<GT>(), out.has_value() ? out->data_ptr<OT>() : nullptr, std::forward<Rest>(rest)...)
  if (gt == at::kFloat) {
    if (!out.has_value()) MEGAZERO_RUN(float, c10::BFloat16);
    else if (ot == at::kBFloat16) MEGAZERO_RUN(float, c10::BFloat16);
    else MEGAZERO_RUN(float, c10::Half);
  } else {
    if (!out.has_value()) MEGAZERO_RUN(c10::BFloat16, c10::BFloat16);
    else if (ot == at::kBFloat16) MEGAZERO_RUN(c10::BFloat16, c10::BFloat16);
    else MEGAZERO_RUN(c10::BFloat16, c10::Half);
  }
#undef MEGAZERO_RUN
}

template <typename G, typename O>
struct AdamKernel {
  static void run(const G* g, O* out, float* p, float* m, float* v, int64_t n, const AdamArgs& a) {
    for_blocks(n, [&](int64_t begin, int64_t len) {
      adam_block<G, O>(p + begin, g + begin, m + begin, v + begin, out ? out + begin : nullptr, len, a);
    });
  }
};

// ---- LAMB (DeepSpeed's FusedLamb semantics: trust ratio per tensor) ------------------------
struct LambArgs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, bias1, bias2, grad_scale;
};

template <typename G, typename O>
__attribute__((always_inline)) inline void lamb_moments_body(const float* __restrict p, const G* __restrict g,
                                                              float* __restrict m, float* __restrict v,
                                                              O* __restrict, int64_t n, const LambArgs& a,
                                                              double* sums) {
  float w2 = 0.0f, u2 = 0.0f;
#pragma omp simd reduction(+ : w2, u2)
  for (int64_t i = 0; i < n; ++i) {
    const float grad = load_float(g, i) / a.grad_scale;
    const float mi = m[i] * a.beta1 + a.one_minus_beta1 * grad;
    const float vi = v[i] * a.beta2 + a.one_minus_beta2 * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float u = (mi / a.bias1) / (std::sqrt(vi / a.bias2) + a.eps) + a.weight_decay * p[i];
    w2 += p[i] * p[i];
    u2 += u * u;
  }
  sums[0] = w2;
  sums[1] = u2;
}

template <typename G, typename O>
__attribute__((always_inline)) inline void lamb_apply_body(float* __restrict p, const float* __restrict m,
                                                            const float* __restrict v, O* __restrict out, int64_t n,
                                                            const LambArgs& a, float scaled_lr) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float u = (m[i] / a.bias1) / (std::sqrt(v[i] / a.bias2) + a.eps) + a.weight_decay * p[i];
    p[i] = p[i] - scaled_lr * u;
  }
  if (out != nullptr) write_copy_body(p, out, n);
}

MEGAZERO_VARIANTS(lamb_moments, lamb_moments_body,
                  (const float* p, const G* g, float* m, float* v, O* out, int64_t n, const LambArgs& a,
                   double* sums),
                  (p, g, m, v, out, n, a, sums))
MEGAZERO_VARIANTS(lamb_apply, lamb_apply_body,
                  (float* p, const float* m, const float* v, O* out, int64_t n, const LambArgs& a, float lr),
                  (p, m, v, out, n, a, lr))

template <typename G, typename O>
struct LambKernel {
  static void run(const G* g, O* out, float* p, float* m, float* v, int64_t n, const LambArgs& a, float lr,
                  float min_coeff, float max_coeff) {
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    std::vector<double> sums(2 * blocks, 0.0);
    for_blocks(n, [&](int64_t begin, int64_t len) {
      lamb_moments<G, O>(p + begin, g + begin, m + begin, v + begin, nullptr, len, a, &sums[2 * (begin / kBlock)]);
    });
    double w2 = 0.0, u2 = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      w2 += sums[2 * b];
      u2 += sums[2 * b + 1];
    }
    float trust = 1.0f;
    if (w2 > 0.0 && u2 > 0.0) {
      trust = static_cast<float>(std::sqrt(w2) / std::sqrt(u2));
      trust = std::min(std::max(trust, min_coeff), max_coeff);
    }
    const float scaled_lr = lr * trust;
    for_blocks(n, [&](int64_t begin, int64_t len) {
      lamb_apply<G, O>(p + begin, m + begin, v + begin, out ? out + begin : nullptr, len, a, scaled_lr);
    });
  }
};

// ---- Adagrad (torch.optim.Adagrad semantics) -------------------------------------------------
struct AdagradArgs {
  float neg_clr, eps, weight_decay, grad_scale;
};

template <typename G, typename O>
__attribute__((always_inline)) inline void adagrad_body(float* __restrict p, const G* __restrict g,
                                                         float* __restrict s, float* __restrict, O* __restrict out,
                                                         int64_t n, const AdagradArgs& a) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float grad = load_float(g, i) / a.grad_scale;
    float w = p[i];
    grad = grad + a.weight_decay * w;
    const float si = s[i] + grad * grad;
    w = w + a.neg_clr * (grad / (std::sqrt(si) + a.eps));
    s[i] = si;
    p[i] = w;
  }
  if (out != nullptr) write_copy_body(p, out, n);
}

MEGAZERO_VARIANTS(adagrad_block, adagrad_body,
                  (float* p, const G* g, float* s, float* unused, O* out, int64_t n, const AdagradArgs& a),
                  (p, g, s, unused, out, n, a))

template <typename G, typename O>
struct AdagradKernel {
  static void run(const G* g, O* out, float* p, float* s, int64_t n, const AdagradArgs& a) {
    for_blocks(n, [&](int64_t begin, int64_t len) {
      adagrad_block<G, O>(p + begin, g + begin, s + begin, nullptr, out ? out + begin : nullptr, len, a);
    });
  }
};

// ---- gradient norm and overflow ---------------------------------------------------------------
template <typename G, typename O>
__attribute__((always_inline)) inline void sumsq_body(const G* __restrict g, O*, int64_t n, double* out) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const float x = load_float(g, i);
    acc += x * x;
  }
  *out = acc;  // inf or nan propagate
}

MEGAZERO_VARIANTS(sumsq_block, sumsq_body, (const G* g, O* unused, int64_t n, double* out), (g, unused, n, out))

template <typename G>
double sum_of_squares(const G* g, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks, 0.0);
  for_blocks(n, [&](int64_t begin, int64_t len) {
    sumsq_block<G, float>(g + begin, nullptr, len, &sums[begin / kBlock]);
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

}  // namespace

// Checks tensor t of an optimizer step (fp32 contiguous parameter and states, a gradient and an
// optional 16-bit copy of the same size) and returns its copy, if any.
static c10::optional<at::Tensor> checked_copy(size_t t, const std::vector<at::Tensor>& params,
                                       const std::vector<at::Tensor>& grads,
                                       std::initializer_list<std::pair<const at::Tensor*, const char*>> states,
                                       const c10::optional<std::vector<at::Tensor>>& copies) {
  check_master(params[t], "parameter");
  check_like(grads[t], params[t], "gradient");
  for (const auto& [state, name] : states) check_master(*state, name);
  if (!copies.has_value()) return c10::nullopt;
  check_like((*copies)[t], params[t], "16-bit copy");
  return (*copies)[t];
}

void adam_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
               std::vector<at::Tensor> exp_avg_sqs, c10::optional<std::vector<at::Tensor>> copies, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step, bool adamw,
               bool bias_correction, double grad_scale) {
  const double bias1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bias2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  const AdamArgs a{static_cast<float>(1.0 - beta1), static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
                   static_cast<float>(eps), static_cast<float>(adamw ? 0.0 : weight_decay),
                   static_cast<float>(adamw ? 1.0 - lr * weight_decay : 1.0), static_cast<float>(-lr / bias1),
                   static_cast<float>(1.0 / std::sqrt(bias2)), static_cast<float>(1.0 / grad_scale)};
  for (size_t t = 0; t < params.size(); ++t) {
    const auto out = checked_copy(t, params, grads, {{&exp_avgs[t], "exp_avg"}, {&exp_avg_sqs[t], "exp_avg_sq"}},
                                  copies);
    dispatch<AdamKernel>(grads[t], out, params[t].data_ptr<float>(), exp_avgs[t].data_ptr<float>(),
                         exp_avg_sqs[t].data_ptr<float>(), params[t].numel(), a);
  }
}

void lamb_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
               std::vector<at::Tensor> exp_avg_sqs, c10::optional<std::vector<at::Tensor>> copies, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step, bool bias_correction,
               double max_coeff, double min_coeff, double grad_scale) {
  const double bias1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bias2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  const LambArgs a{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                   static_cast<float>(1.0 - beta2), static_cast<float>(eps), static_cast<float>(weight_decay),
                   static_cast<float>(bias1), static_cast<float>(bias2), static_cast<float>(grad_scale)};
  for (size_t t = 0; t < params.size(); ++t) {
    const auto out = checked_copy(t, params, grads, {{&exp_avgs[t], "exp_avg"}, {&exp_avg_sqs[t], "exp_avg_sq"}},
                                  copies);
    dispatch<LambKernel>(grads[t], out, params[t].data_ptr<float>(), exp_avgs[t].data_ptr<float>(),
                         exp_avg_sqs[t].data_ptr<float>(), params[t].numel(), a, static_cast<float>(lr),
                         static_cast<float>(min_coeff), static_cast<float>(max_coeff));
  }
}

void adagrad_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> sums,
                  c10::optional<std::vector<at::Tensor>> copies, double lr, double lr_decay, double eps,
                  double weight_decay, int64_t step, double grad_scale) {
  const AdagradArgs a{static_cast<float>(-lr / (1.0 + (step - 1) * lr_decay)), static_cast<float>(eps),
                      static_cast<float>(weight_decay), static_cast<float>(grad_scale)};
  for (size_t t = 0; t < params.size(); ++t) {
    const auto out = checked_copy(t, params, grads, {{&sums[t], "sum"}}, copies);
    dispatch<AdagradKernel>(grads[t], out, params[t].data_ptr<float>(), sums[t].data_ptr<float>(),
                            params[t].numel(), a);
  }
}

// Sum of squares of all gradients (double) and whether any is inf or nan, in one pass.
std::tuple<double, bool> grad_norm_squared(std::vector<at::Tensor> grads) {
  double total = 0.0;
  for (const auto& g : grads) {
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous(), "gradients must be contiguous CPU tensors");
    if (g.scalar_type() == at::kFloat) total += sum_of_squares(g.data_ptr<float>(), g.numel());
    else if (g.scalar_type() == at::kBFloat16) total += sum_of_squares(g.data_ptr<c10::BFloat16>(), g.numel());
    else TORCH_CHECK(false, "gradients must be float32 or bfloat16, got ", g.scalar_type());
  }
  return {total, !std::isfinite(total)};
}

namespace {
template <typename G, typename O>
__attribute__((always_inline)) inline void axpy_body(float* __restrict y, const G* __restrict x, O*, int64_t n,
                                                     float alpha) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] + alpha * load_float(x, i);
}
MEGAZERO_VARIANTS(axpy_block, axpy_body, (float* y, const G* x, O* unused, int64_t n, float alpha),
                  (y, x, unused, n, alpha))
}  // namespace

// y += alpha * x in place (12 bytes per element): the memory-bandwidth probe of the benchmarks.
void axpy(at::Tensor y, at::Tensor x, double alpha) {
  check_master(y, "y");
  check_master(x, "x");
  TORCH_CHECK(x.numel() == y.numel(), "x and y differ in size");
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for_blocks(y.numel(), [&](int64_t begin, int64_t len) {
    axpy_block<float, float>(yp + begin, xp + begin, nullptr, len, static_cast<float>(alpha));
  });
}

std::string isa() {
  return kIsa == Isa::kAvx512 ? "avx512" : kIsa == Isa::kAvx2 ? "avx2" : "generic";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "Adam/AdamW step over fp32 masters (optional 16-bit copies written)");
  m.def("lamb_step", &lamb_step, "LAMB step (trust ratio per tensor)");
  m.def("adagrad_step", &adagrad_step, "Adagrad step");
  m.def("grad_norm_squared", &grad_norm_squared, "sum of squared gradients and an inf/nan flag");
  m.def("axpy", &axpy, "y += alpha * x (bandwidth probe)");
  m.def("isa", &isa, "the vector instruction set chosen at run time");
}
