// Fused RMSNorm forward/backward on CPU: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps) per
// row; fp32 and bf16 (fp32 arithmetic). One pass per row forward; backward one pass per row for dx
// and the row's share of dweight. Its pure-torch reference is megazero/ops/cuda_ops.py's
// rms_norm_reference (F.rms_norm in fp32).
//
// Threads: OpenMP over fixed chunks of rows (kRowsPerChunk, set by the shape, not the thread
// count); dweight sums each chunk's rows in order into its own partial row, then the chunks in
// order, so results do not depend on the thread count (deterministic, as the CUDA backward).
#include "op_headers.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowsPerChunk = 64;
// Below this many elements one thread does the whole tensor (torch's own grain size,
// at::internal::GRAIN_SIZE): waking the OpenMP team costs more than the work, and on a loaded
// machine a barrier waiting for a descheduled thread took 25-65 ms where torch took 0.3 ms
// (32x32, 2 threads, load average 18). Every row and chunk is computed the same either way.
constexpr int64_t kParallelElements = 32768;

inline float load_float(const float* p, int64_t i) { return p[i]; }

inline float load_float(const c10::BFloat16* p, int64_t i) {  // exact: bf16 is the top half of an fp32
  const uint32_t bits = static_cast<uint32_t>(p[i].x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void store_float(float* p, int64_t i, float v) { p[i] = v; }

// fp32 -> bf16 with round-to-nearest-even and torch's NaN (0x7FC0), branch-free so it vectorises
inline void store_float(c10::BFloat16* p, int64_t i, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  p[i].x = (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : rounded;
}

template <typename T>
void forward_rows(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) sum += load_float(xr, c) * load_float(xr, c);
    const float rs = 1.0f / std::sqrt(sum / cols + eps);
    rstd[r] = rs;
    T* yr = y + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) store_float(yr, c, load_float(xr, c) * rs * load_float(w, c));
  }
}

// dx = rstd * (dy * w - xhat * mean(dy * w * xhat)), xhat = x * rstd; partial[chunk] += dy * xhat.
template <typename T>
void backward_rows(const T* dy, const T* x, const T* w, const float* rstd, T* dx, float* partial, int64_t rows,
                   int64_t cols) {
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelElements)
  for (int64_t k = 0; k < chunks; ++k) {
    float* pw = partial + k * cols;
    std::fill(pw, pw + cols, 0.0f);
    for (int64_t r = k * kRowsPerChunk; r < std::min(rows, (k + 1) * kRowsPerChunk); ++r) {
      const T* xr = x + r * cols;
      const T* gr = dy + r * cols;
      const float rs = rstd[r];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) sum += load_float(gr, c) * load_float(w, c) * (load_float(xr, c) * rs);
      const float mean = sum / cols;
      T* dxr = dx + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat = load_float(xr, c) * rs, g = load_float(gr, c);
        store_float(dxr, c, rs * (g * load_float(w, c) - xhat * mean));
        pw[c] += g * xhat;
      }
    }
  }
}

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a float32 or bfloat16 CPU tensor with at least one dimension, got ", x.scalar_type(),
              " on ", x.device(), " of shape ", x.sizes());
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.numel() == x.size(-1),
              op, ": weight must be ", x.scalar_type(), " on cpu of shape [", x.size(-1), "], got ", w.scalar_type(),
              " on ", w.device(), " of shape ", w.sizes());
}

}  // namespace

std::vector<at::Tensor> rms_norm_forward(at::Tensor x, at::Tensor weight, double eps) {
  check_inputs("rms_norm_forward", x, weight);
  x = x.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  at::Tensor rstd = at::zeros({rows}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return {y, rstd};
  if (x.scalar_type() == at::kFloat)
    forward_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols,
                 static_cast<float>(eps));
  else
    forward_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
                 rstd.data_ptr<float>(), rows, cols, static_cast<float>(eps));
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_backward(at::Tensor dy, at::Tensor x, at::Tensor weight, at::Tensor rstd) {
  check_inputs("rms_norm_backward", x, weight);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.device().is_cpu(),
              "rms_norm_backward: dy must be ", x.scalar_type(), " on cpu of shape ", x.sizes(), ", got ",
              dy.scalar_type(), " on ", dy.device(), " of shape ", dy.sizes());
  dy = dy.contiguous();
  x = x.contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows && rstd.device().is_cpu(),
              "rms_norm_backward: rstd must be float32 on cpu with ", rows, " elements, got ", rstd.scalar_type(),
              " with ", rstd.numel());
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (rows == 0 || cols == 0) return {dx, at::zeros_like(w)};
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  at::Tensor partial = at::empty({chunks, cols}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    backward_rows(dy.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), rstd.contiguous().data_ptr<float>(),
                  dx.data_ptr<float>(), partial.data_ptr<float>(), rows, cols);
  else
    backward_rows(dy.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                  rstd.contiguous().data_ptr<float>(), dx.data_ptr<at::BFloat16>(), partial.data_ptr<float>(), rows,
                  cols);
  // the chunks' partials in chunk order (one thread): deterministic
  at::Tensor dweight = at::zeros({cols}, x.options().dtype(at::kFloat));
  float* dw = dweight.data_ptr<float>();
  const float* p = partial.data_ptr<float>();
  for (int64_t k = 0; k < chunks; ++k)
    for (int64_t c = 0; c < cols; ++c) dw[c] += p[k * cols + c];
  return {dx, dweight.to(weight.scalar_type())};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_forward", &rms_norm_forward, "RMSNorm forward on CPU: (y, rstd)");
  m.def("rms_norm_backward", &rms_norm_backward, "RMSNorm backward on CPU: (dx, dweight)");
}
