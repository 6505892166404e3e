// Megatron-style fused CUDA kernels: multi-tensor Adam/AdamW and LAMB over fp32 masters, LayerNorm
// and RMSNorm forward/backward, scaled masked softmax and scaled causal (upper-triangular masked) softmax
// forward/backward, bias + GeLU forward/backward. fp32/fp16/bf16 inputs, fp32 arithmetic.
// Each has a pure-torch reference in megazero/ops/cuda_ops.py that the tests compare against.
//
// Built without --use_fast_math and with --fmad=false (builder.py): the optimizers then round each
// operation as the CPU op does (-ffp-contract=off), and tanhf/expf/sqrtf/division are the
// IEEE-accurate ones. Every entry point checks its inputs (device, dtype, contiguity, size) and
// returns before launching anything when there is no work: a grid of 0 blocks is an invalid launch.
// Reductions are deterministic: per-block partial sums in a fixed order, then a second pass over
// the blocks in a fixed order; no floating-point atomics.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(at::Half x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }

// Sum over a block (all threads get the result); `shared` holds one value per warp. The tree is
// fixed by the block size, so the result does not vary from run to run.
template <typename Acc>
__device__ Acc block_sum(Acc value, Acc* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  value = threadIdx.x < warps ? shared[threadIdx.x] : Acc(0);
  if (warp == 0)
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
  if (threadIdx.x == 0) shared[0] = value;
  __syncthreads();
  return shared[0];
}

__device__ float block_max(float value, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  value = threadIdx.x < warps ? shared[threadIdx.x] : -INFINITY;
  if (warp == 0)
    for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
  if (threadIdx.x == 0) shared[0] = value;
  __syncthreads();
  return shared[0];
}

// ---- input checks (each names the op and the tensor, expected vs got) --------------------------
std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " on " << t.device() << ", " << (t.is_contiguous() ? "contiguous" : "non-contiguous")
    << ", shape " << t.sizes();
  return s.str();
}

void check_cuda(const char* op, const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, ": ", what, " must be a CUDA tensor, got ", describe(t));
}

// `t` on `ref`'s device with `ref`'s dtype and `numel` elements (a LayerNorm weight, a bias).
void check_vector(const char* op, const char* what, const at::Tensor& t, const at::Tensor& ref, int64_t numel) {
  TORCH_CHECK(t.device() == ref.device() && t.scalar_type() == ref.scalar_type() && t.numel() == numel, op, ": ",
              what, " must be ", ref.scalar_type(), " on ", ref.device(), " with ", numel, " elements, got ",
              describe(t));
}

// `t` shaped, typed and placed as `ref` (an upstream gradient).
void check_same(const char* op, const char* what, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device() && t.scalar_type() == ref.scalar_type() && t.sizes() == ref.sizes(), op,
              ": ", what, " must be ", ref.scalar_type(), " on ", ref.device(), " with shape ", ref.sizes(),
              ", got ", describe(t));
}

void check_launchable(const char* op, int64_t blocks) {
  TORCH_CHECK(blocks <= INT_MAX, op, ": ", blocks, " blocks exceed the grid limit of ", INT_MAX);
}

int64_t leading_rows(const at::Tensor& x) {  // product of all but the last dimension (0 when any is 0)
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// ---- multi-tensor optimizers ------------------------------------------------------------------
constexpr int kChunk = 4096;       // elements per block
constexpr int kMaxTensors = 64;    // tensors per launch: the table is a kernel argument (< 4 KiB)

int64_t chunks_of(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// The tensors of one launch, passed by value as a kernel argument, so no host-to-device copy is
// needed per step. Tensor t owns blocks [first_chunk[t], first_chunk[t + 1]); empty tensors are
// never in a batch, so first_chunk strictly increases.
struct TensorBatch {
  float* params[kMaxTensors];
  const void* grads[kMaxTensors];
  float* exp_avgs[kMaxTensors];
  float* exp_avg_sqs[kMaxTensors];
  int64_t sizes[kMaxTensors];
  int64_t first_chunk[kMaxTensors];
  int count;
};

// The tensor that block `block` works on: the last t with first_chunk[t] <= block.
__device__ __forceinline__ int find_tensor(const TensorBatch& batch, int64_t block) {
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.first_chunk[mid] <= block) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The gradient divisor: the device scalar where one is given (no host sync to read it), else the
// host's. 1/scale is rounded from double, as the host computes it for the CPU op.
__device__ __forceinline__ float inverse_scale(const float* device_scale, float host_inverse) {
  return device_scale ? static_cast<float>(1.0 / static_cast<double>(*device_scale)) : host_inverse;
}

template <typename G>
__global__ void adam_kernel(TensorBatch batch, float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                            float l2, float decay, float neg_step_size, float inv_bias2_sqrt, float host_inv_scale,
                            const float* device_scale) {
  const float inv_grad_scale = inverse_scale(device_scale, host_inv_scale);
  const int t = find_tensor(batch, blockIdx.x);
  const int64_t start = (blockIdx.x - batch.first_chunk[t]) * kChunk;
  const int64_t end = min(start + kChunk, batch.sizes[t]);
  float* p = batch.params[t];
  const G* g = static_cast<const G*>(batch.grads[t]);
  float* m = batch.exp_avgs[t];
  float* v = batch.exp_avg_sqs[t];
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    float grad = to_float(g[i]) * inv_grad_scale;  // as the CPU op: exact when the scale is 1
    float w = p[i];
    grad = grad + l2 * w;
    const float mi = m[i] + one_minus_beta1 * (grad - m[i]);
    const float vi = v[i] * beta2 + one_minus_beta2 * grad * grad;
    w = w * decay;
    w = w + neg_step_size * (mi / (sqrtf(vi) * inv_bias2_sqrt + eps));
    m[i] = mi;
    v[i] = vi;
    p[i] = w;
  }
}

// LAMB pass 1: moments, and per block the partial sums of w^2 and update^2 (partial[2 * block + 0/1]).
template <typename G>
__global__ void lamb_moments_kernel(TensorBatch batch, float beta1, float one_minus_beta1, float beta2,
                                    float one_minus_beta2, float eps, float weight_decay, float bias1, float bias2,
                                    float host_scale, const float* device_scale, float* partial) {
  __shared__ float shared[32];
  const float grad_scale = device_scale ? *device_scale : host_scale;
  const int t = find_tensor(batch, blockIdx.x);
  const int64_t start = (blockIdx.x - batch.first_chunk[t]) * kChunk;
  const int64_t end = min(start + kChunk, batch.sizes[t]);
  const float* p = batch.params[t];
  const G* g = static_cast<const G*>(batch.grads[t]);
  float* m = batch.exp_avgs[t];
  float* v = batch.exp_avg_sqs[t];
  float w2 = 0.0f, u2 = 0.0f;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float grad = to_float(g[i]) / grad_scale;  // divides, as the CPU op does
    const float mi = m[i] * beta1 + one_minus_beta1 * grad;
    const float vi = v[i] * beta2 + one_minus_beta2 * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float u = (mi / bias1) / (sqrtf(vi / bias2) + eps) + weight_decay * p[i];
    w2 += p[i] * p[i];
    u2 += u * u;
  }
  w2 = block_sum(w2, shared);
  u2 = block_sum(u2, shared);
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = w2;
    partial[2 * blockIdx.x + 1] = u2;
  }
}

// LAMB pass 2: one block per tensor sums its blocks' partials (double, fixed order) into the trust
// ratio, clamped as the CPU op does, and stores lr * trust.
__global__ void lamb_trust_kernel(TensorBatch batch, const float* partial, float* scaled_lr, float lr,
                                  float min_coeff, float max_coeff) {
  __shared__ double shared[32];
  const int t = blockIdx.x;
  const int64_t first = batch.first_chunk[t], last = first + (batch.sizes[t] + kChunk - 1) / kChunk;
  double w2 = 0.0, u2 = 0.0;
  for (int64_t c = first + threadIdx.x; c < last; c += blockDim.x) {
    w2 += partial[2 * c];
    u2 += partial[2 * c + 1];
  }
  w2 = block_sum(w2, shared);
  u2 = block_sum(u2, shared);
  if (threadIdx.x == 0) {
    float trust = 1.0f;
    if (w2 > 0.0 && u2 > 0.0) trust = fminf(fmaxf(static_cast<float>(sqrt(w2) / sqrt(u2)), min_coeff), max_coeff);
    scaled_lr[t] = lr * trust;
  }
}

// LAMB pass 3: the update with the tensor's lr * trust.
__global__ void lamb_apply_kernel(TensorBatch batch, float eps, float weight_decay, float bias1, float bias2,
                                  const float* scaled_lr) {
  const int t = find_tensor(batch, blockIdx.x);
  const int64_t start = (blockIdx.x - batch.first_chunk[t]) * kChunk;
  const int64_t end = min(start + kChunk, batch.sizes[t]);
  float* p = batch.params[t];
  const float* m = batch.exp_avgs[t];
  const float* v = batch.exp_avg_sqs[t];
  const float lr = scaled_lr[t];
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float u = (m[i] / bias1) / (sqrtf(v[i] / bias2) + eps) + weight_decay * p[i];
    p[i] = p[i] - lr * u;
  }
}

// Parameters, states and gradients of one optimizer step: equal counts; per tensor a contiguous
// fp32 parameter and states on the first parameter's device, and a contiguous fp32/bf16/fp16
// gradient of the same size there. Mixed gradient dtypes are fine: each launch takes one dtype.
void check_optimizer_tensors(const char* op, const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                             const std::vector<at::Tensor>& exp_avg_sqs) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n, op, ": ", n,
              " parameters but ", grads.size(), " gradients, ", exp_avgs.size(), " exp_avg and ",
              exp_avg_sqs.size(), " exp_avg_sq tensors");
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), op, ": parameter 0 must be a CUDA tensor, got ", describe(params[0]));
  auto check = [&](const char* what, size_t t, const at::Tensor& x, bool any_float) {
    const auto type = x.scalar_type();
    const bool type_ok = any_float ? (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf)
                                   : type == at::kFloat;
    TORCH_CHECK(type_ok && x.device() == device && x.is_contiguous() && x.numel() == params[t].numel(), op, ": ",
                what, " ", t, " must be a contiguous ", (any_float ? "float32/bfloat16/float16" : "float32"),
                " tensor on ", device, " with ", params[t].numel(), " elements, got ", describe(x), " (",
                x.numel(), " elements)");
  };
  for (size_t t = 0; t < n; ++t) {
    check("parameter", t, params[t], false);
    check("gradient", t, grads[t], true);
    check("exp_avg", t, exp_avgs[t], false);
    check("exp_avg_sq", t, exp_avg_sqs[t], false);
  }
}

// Calls fn(batch, blocks, grad dtype) per launch: the non-empty tensors grouped by gradient dtype,
// at most kMaxTensors per launch.
template <typename Fn>
void for_each_batch(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs, Fn fn) {
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    TensorBatch batch{};
    int64_t blocks = 0;
    for (size_t t = 0; t < params.size(); ++t) {
      if (grads[t].scalar_type() != type || params[t].numel() == 0) continue;
      if (batch.count == kMaxTensors) {
        fn(batch, blocks, type);
        batch = TensorBatch{};
        blocks = 0;
      }
      const int c = batch.count++;
      batch.params[c] = params[t].data_ptr<float>();
      batch.grads[c] = grads[t].data_ptr();
      batch.exp_avgs[c] = exp_avgs[t].data_ptr<float>();
      batch.exp_avg_sqs[c] = exp_avg_sqs[t].data_ptr<float>();
      batch.sizes[c] = params[t].numel();
      batch.first_chunk[c] = blocks;
      blocks += chunks_of(params[t].numel());
    }
    if (batch.count > 0) fn(batch, blocks, type);
  }
}

template <typename Fn>
void dispatch_grad(at::ScalarType type, Fn fn) {
  if (type == at::kFloat) fn(float());
  else if (type == at::kBFloat16) fn(at::BFloat16());
  else if (type == at::kHalf) fn(at::Half());
  else TORCH_CHECK(false, "gradients must be float32, bfloat16 or float16, got ", type);
}

// ---- LayerNorm ---------------------------------------------------------------------------------
template <typename T>
__global__ void layer_norm_forward_kernel(const T* x, const T* gamma, const T* beta, T* y, float* mean, float* rstd,
                                          int64_t cols, float eps) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += to_float(xr[c]);
  const float mu = block_sum(sum, shared) / cols;
  float var = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_float(xr[c]) - mu;
    var += d * d;
  }
  const float r = rsqrtf(block_sum(var, shared) / cols + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    y[row * cols + c] = from_float<T>((to_float(xr[c]) - mu) * r * to_float(gamma[c]) + to_float(beta[c]));
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
}

// dx, one block per row.
template <typename T>
__global__ void layer_norm_backward_input_kernel(const T* dy, const T* x, const T* gamma, const float* mean,
                                                 const float* rstd, T* dx, int64_t cols) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const float mu = mean[row], r = rstd[row];
  float sum_dyg = 0.0f, sum_dyg_xhat = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(x[row * cols + c]) - mu) * r;
    const float dyg = to_float(dy[row * cols + c]) * to_float(gamma[c]);
    sum_dyg += dyg;
    sum_dyg_xhat += dyg * xhat;
  }
  sum_dyg = block_sum(sum_dyg, shared);
  sum_dyg_xhat = block_sum(sum_dyg_xhat, shared);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(x[row * cols + c]) - mu) * r;
    const float dyg = to_float(dy[row * cols + c]) * to_float(gamma[c]);
    dx[row * cols + c] = from_float<T>(r * (dyg - (sum_dyg + xhat * sum_dyg_xhat) / cols));
  }
}

// dgamma/dbeta pass 1: block (x, y) sums kTileCols columns over the rows of chunk y (threads of a
// column take every kTileRows-th row, then add up in a fixed order) into partial[y * cols + col].
constexpr int kTileCols = 32, kTileRows = 8;

template <typename T>
__global__ void layer_norm_param_partials_kernel(const T* dy, const T* x, const float* mean, const float* rstd,
                                                 float* partial_gamma, float* partial_beta, int64_t rows,
                                                 int64_t cols, int64_t rows_per_chunk) {
  __shared__ float sums_gamma[kTileRows][kTileCols + 1], sums_beta[kTileRows][kTileCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = min(begin + rows_per_chunk, rows);
  float acc_gamma = 0.0f, acc_beta = 0.0f;
  if (col < cols) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kTileRows) {
      const float g = to_float(dy[r * cols + col]);
      const float xhat = (to_float(x[r * cols + col]) - mean[r]) * rstd[r];
      acc_gamma += g * xhat;
      acc_beta += g;
    }
  }
  sums_gamma[threadIdx.y][threadIdx.x] = acc_gamma;
  sums_beta[threadIdx.y][threadIdx.x] = acc_beta;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total_gamma = 0.0f, total_beta = 0.0f;
    for (int i = 0; i < kTileRows; ++i) {
      total_gamma += sums_gamma[i][threadIdx.x];
      total_beta += sums_beta[i][threadIdx.x];
    }
    partial_gamma[blockIdx.y * cols + col] = total_gamma;
    partial_beta[blockIdx.y * cols + col] = total_beta;
  }
}

// dgamma/dbeta pass 2: per column, the chunks' partials in chunk order.
__global__ void layer_norm_param_final_kernel(const float* partial_gamma, const float* partial_beta, float* dgamma,
                                              float* dbeta, int64_t chunks, int64_t cols) {
  for (int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; col < cols;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total_gamma = 0.0f, total_beta = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      total_gamma += partial_gamma[c * cols + col];
      total_beta += partial_beta[c * cols + col];
    }
    dgamma[col] = total_gamma;
    dbeta[col] = total_beta;
  }
}

// ---- RMSNorm -----------------------------------------------------------------------------------
// y = x * rstd * gamma with rstd = 1 / sqrt(mean(x^2) + eps) per row (no centring, no bias).
template <typename T>
__global__ void rms_norm_forward_kernel(const T* x, const T* gamma, T* y, float* rstd, int64_t cols, float eps) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_float(xr[c]);
    sum += v * v;
  }
  const float r = rsqrtf(block_sum(sum, shared) / cols + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    y[row * cols + c] = from_float<T>(to_float(xr[c]) * r * to_float(gamma[c]));
  if (threadIdx.x == 0) rstd[row] = r;
}

// dx = rstd * (dy * gamma - xhat * mean(dy * gamma * xhat)), xhat = x * rstd; one block per row.
template <typename T>
__global__ void rms_norm_backward_input_kernel(const T* dy, const T* x, const T* gamma, const float* rstd, T* dx,
                                               int64_t cols) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const float r = rstd[row];
  float sum_dyg_xhat = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    sum_dyg_xhat += to_float(dy[row * cols + c]) * to_float(gamma[c]) * to_float(x[row * cols + c]) * r;
  sum_dyg_xhat = block_sum(sum_dyg_xhat, shared);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = to_float(x[row * cols + c]) * r;
    const float dyg = to_float(dy[row * cols + c]) * to_float(gamma[c]);
    dx[row * cols + c] = from_float<T>(r * (dyg - xhat * sum_dyg_xhat / cols));
  }
}

// dgamma pass 1, as LayerNorm's: block (x, y) sums kTileCols columns of dy * xhat over the rows of
// chunk y (a column's threads take every kTileRows-th row, then add up in a fixed order).
template <typename T>
__global__ void rms_norm_param_partials_kernel(const T* dy, const T* x, const float* rstd, float* partial_gamma,
                                               int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  __shared__ float sums[kTileRows][kTileCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = min(begin + rows_per_chunk, rows);
  float acc = 0.0f;
  if (col < cols)
    for (int64_t r = begin + threadIdx.y; r < end; r += kTileRows)
      acc += to_float(dy[r * cols + col]) * (to_float(x[r * cols + col]) * rstd[r]);
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
    for (int i = 0; i < kTileRows; ++i) total += sums[i][threadIdx.x];
    partial_gamma[blockIdx.y * cols + col] = total;
  }
}

// dgamma pass 2: per column, the chunks' partials in chunk order.
__global__ void rms_norm_param_final_kernel(const float* partial_gamma, float* dgamma, int64_t chunks, int64_t cols) {
  for (int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; col < cols;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) total += partial_gamma[c * cols + col];
    dgamma[col] = total;
  }
}

// ---- softmax -----------------------------------------------------------------------------------
// A mask broadcast to [batch, heads, sq, sk]: element strides, 0 along broadcast dimensions.
struct MaskView {
  const bool* data;  // nullptr: no mask
  int64_t batch, head, query, key;
};

// One block per row of `cols` scores; masked positions (mask true, or col > query when causal) get
// probability 0; a row with nothing left to normalise (every position masked, or -inf) gets all zeros.
template <typename T>
__global__ void softmax_forward_kernel(const T* x, MaskView mask, T* y, int64_t heads, int64_t sq, int64_t cols,
                                       float scale, bool causal) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const int64_t query = row % sq, head = (row / sq) % heads, batch = row / (sq * heads);
  const T* xr = x + row * cols;
  const bool* mr = mask.data ? mask.data + batch * mask.batch + head * mask.head + query * mask.query : nullptr;
  auto masked = [&](int64_t c) { return (mr && mr[c * mask.key]) || (causal && c > query); };
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    if (!masked(c)) mx = fmaxf(mx, to_float(xr[c]) * scale);
  mx = block_max(mx, shared);
  if (mx == -INFINITY) {  // as the reference's nan_to_num of a softmax over nothing
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) y[row * cols + c] = from_float<T>(0.0f);
    return;
  }
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    if (!masked(c)) sum += expf(to_float(xr[c]) * scale - mx);
  sum = block_sum(sum, shared);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float p = masked(c) ? 0.0f : expf(to_float(xr[c]) * scale - mx) / sum;
    y[row * cols + c] = from_float<T>(p);
  }
}

template <typename T>
__global__ void softmax_backward_kernel(const T* dy, const T* y, T* dx, int64_t cols, float scale) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dot += to_float(dy[row * cols + c]) * to_float(y[row * cols + c]);
  dot = block_sum(dot, shared);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float yc = to_float(y[row * cols + c]);
    dx[row * cols + c] = from_float<T>(scale * yc * (to_float(dy[row * cols + c]) - dot));
  }
}

// ---- bias + GeLU (tanh approximation) ----------------------------------------------------------
__device__ __forceinline__ float gelu_tanh(float z) {
  return 0.5f * z * (1.0f + tanhf(0.7978845608028654f * (z + 0.044715f * z * z * z)));
}

__device__ __forceinline__ float gelu_tanh_grad(float z) {
  const float inner = 0.7978845608028654f * (z + 0.044715f * z * z * z);
  const float t = tanhf(inner);
  return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * z * z);
}

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* x, const T* bias, T* y, int64_t n, int64_t cols) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = from_float<T>(gelu_tanh(to_float(x[i]) + to_float(bias[i % cols])));
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* dy, const T* x, const T* bias, T* dx, int64_t n, int64_t cols) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dx[i] = from_float<T>(to_float(dy[i]) * gelu_tanh_grad(to_float(x[i]) + to_float(bias[i % cols])));
}

template <typename Fn>
void dispatch_float(at::ScalarType type, Fn fn) {
  if (type == at::kFloat) fn(float());
  else if (type == at::kBFloat16) fn(at::BFloat16());
  else if (type == at::kHalf) fn(at::Half());
  else TORCH_CHECK(false, "expected float32, bfloat16 or float16, got ", type);
}

int64_t grid_for(int64_t n) { return std::min<int64_t>((n + kThreads - 1) / kThreads, 65535); }

}  // namespace

// A one-element float32 tensor on the parameters' device (the engine's loss-scale x clip divisor),
// read by the kernels, or none (`grad_scale` is then the divisor).
static const float* device_scale_of(const char* op, const c10::optional<at::Tensor>& scale, const at::Tensor& param) {
  if (!scale.has_value()) return nullptr;
  TORCH_CHECK(scale->device() == param.device() && scale->scalar_type() == at::kFloat && scale->numel() == 1, op,
              ": grad_scale_tensor must be one float32 element on ", param.device(), ", got ", describe(*scale));
  return scale->data_ptr<float>();
}

void multi_tensor_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                       std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step, bool adamw, bool bias_correction,
                       double grad_scale, c10::optional<at::Tensor> grad_scale_tensor) {
  if (params.empty() && grads.empty() && exp_avgs.empty() && exp_avg_sqs.empty()) return;
  TORCH_CHECK(!params.empty(), "multi_tensor_adam: no parameters but ", grads.size(), " gradients");
  check_optimizer_tensors("multi_tensor_adam", params, grads, exp_avgs, exp_avg_sqs);
  const float* device_scale = device_scale_of("multi_tensor_adam", grad_scale_tensor, params[0]);
  const c10::cuda::CUDAGuard guard(params[0].device());
  const double bias1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bias2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  for_each_batch(params, grads, exp_avgs, exp_avg_sqs, [&](const TensorBatch& batch, int64_t blocks, at::ScalarType type) {
    check_launchable("multi_tensor_adam", blocks);
    dispatch_grad(type, [&](auto g) {
      using G = decltype(g);
      adam_kernel<G><<<blocks, kThreads, 0, stream>>>(
          batch, static_cast<float>(1.0 - beta1), static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
          static_cast<float>(eps), static_cast<float>(adamw ? 0.0 : weight_decay),
          static_cast<float>(adamw ? 1.0 - lr * weight_decay : 1.0), static_cast<float>(-lr / bias1),
          static_cast<float>(1.0 / std::sqrt(bias2)), static_cast<float>(1.0 / grad_scale), device_scale);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void multi_tensor_lamb(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                       std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step, bool bias_correction,
                       double max_coeff, double min_coeff, double grad_scale,
                       c10::optional<at::Tensor> grad_scale_tensor) {
  if (params.empty() && grads.empty() && exp_avgs.empty() && exp_avg_sqs.empty()) return;
  TORCH_CHECK(!params.empty(), "multi_tensor_lamb: no parameters but ", grads.size(), " gradients");
  check_optimizer_tensors("multi_tensor_lamb", params, grads, exp_avgs, exp_avg_sqs);
  const float* device_scale = device_scale_of("multi_tensor_lamb", grad_scale_tensor, params[0]);
  const c10::cuda::CUDAGuard guard(params[0].device());
  const float bias1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const float bias2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  int64_t total_blocks = 0, tensors = 0;
  for (const auto& p : params) {
    total_blocks += chunks_of(p.numel());
    tensors += p.numel() > 0;
  }
  if (total_blocks == 0) return;
  // every entry is written before it is read: no zero-fill pass
  at::Tensor partial = at::empty({2 * total_blocks}, params[0].options());
  at::Tensor scaled_lr = at::empty({tensors}, params[0].options());
  float* partial_at = partial.data_ptr<float>();
  float* scaled_lr_at = scaled_lr.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream();
  for_each_batch(params, grads, exp_avgs, exp_avg_sqs, [&](const TensorBatch& batch, int64_t blocks, at::ScalarType type) {
    check_launchable("multi_tensor_lamb", blocks);
    dispatch_grad(type, [&](auto g) {
      using G = decltype(g);
      lamb_moments_kernel<G><<<blocks, kThreads, 0, stream>>>(
          batch, static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
          static_cast<float>(1.0 - beta2), static_cast<float>(eps), static_cast<float>(weight_decay), bias1, bias2,
          static_cast<float>(grad_scale), device_scale, partial_at);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    lamb_trust_kernel<<<batch.count, kThreads, 0, stream>>>(batch, partial_at, scaled_lr_at, static_cast<float>(lr),
                                                            static_cast<float>(min_coeff),
                                                            static_cast<float>(max_coeff));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    lamb_apply_kernel<<<blocks, kThreads, 0, stream>>>(batch, static_cast<float>(eps),
                                                       static_cast<float>(weight_decay), bias1, bias2, scaled_lr_at);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    partial_at += 2 * blocks;
    scaled_lr_at += batch.count;
  });
}

std::vector<at::Tensor> layer_norm_forward(at::Tensor x, at::Tensor gamma, at::Tensor beta, double eps) {
  constexpr const char* op = "layer_norm_forward";
  check_cuda(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got ", describe(x));
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  check_vector(op, "weight", gamma, x, cols);
  check_vector(op, "bias", beta, x, cols);
  const c10::cuda::CUDAGuard guard(x.device());
  x = x.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return {y, mean.zero_(), rstd.zero_()};  // nothing to launch, no division by cols
  check_launchable(op, rows);
  const at::Tensor g = gamma.contiguous(), b = beta.contiguous();
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    layer_norm_forward_kernel<T><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), g.data_ptr<T>(), b.data_ptr<T>(), y.data_ptr<T>(), mean.data_ptr<float>(),
        rstd.data_ptr<float>(), cols, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, mean, rstd};
}

std::vector<at::Tensor> layer_norm_backward(at::Tensor dy, at::Tensor x, at::Tensor gamma, at::Tensor mean,
                                            at::Tensor rstd) {
  constexpr const char* op = "layer_norm_backward";
  check_cuda(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got ", describe(x));
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  check_same(op, "dy", dy, x);
  check_vector(op, "weight", gamma, x, cols);
  auto check_stat = [&](const char* name, const at::Tensor& stat) {
    TORCH_CHECK(stat.device() == x.device() && stat.scalar_type() == at::kFloat && stat.numel() == rows, op, ": ",
                name, " must be float32 on ", x.device(), " with ", rows, " elements, got ", describe(stat));
  };
  check_stat("mean", mean);
  check_stat("rstd", rstd);
  const c10::cuda::CUDAGuard guard(x.device());
  dy = dy.contiguous();
  x = x.contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dgamma = at::zeros({cols}, x.options().dtype(at::kFloat));
  at::Tensor dbeta = at::zeros({cols}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return {dx, dgamma.to(gamma.scalar_type()), dbeta.to(gamma.scalar_type())};
  check_launchable(op, rows);
  const at::Tensor g = gamma.contiguous(), m = mean.contiguous(), r = rstd.contiguous();
  auto stream = c10::cuda::getCurrentCUDAStream();
  // row chunks for dgamma/dbeta: enough blocks to fill the GPU, few enough that the partial sums
  // stay small next to x (at most 128 rows of partials); fixed by the shape, so deterministic
  const int64_t rows_per_chunk = std::max<int64_t>(64, (rows + 127) / 128);
  const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  check_launchable(op, col_tiles);
  at::Tensor partial_gamma = chunks > 1 ? at::empty({chunks, cols}, dgamma.options()) : dgamma;
  at::Tensor partial_beta = chunks > 1 ? at::empty({chunks, cols}, dbeta.options()) : dbeta;
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    layer_norm_backward_input_kernel<T><<<rows, kThreads, 0, stream>>>(
        dy.data_ptr<T>(), x.data_ptr<T>(), g.data_ptr<T>(), m.data_ptr<float>(), r.data_ptr<float>(),
        dx.data_ptr<T>(), cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    layer_norm_param_partials_kernel<T><<<dim3(col_tiles, chunks), dim3(kTileCols, kTileRows), 0, stream>>>(
        dy.data_ptr<T>(), x.data_ptr<T>(), m.data_ptr<float>(), r.data_ptr<float>(), partial_gamma.data_ptr<float>(),
        partial_beta.data_ptr<float>(), rows, cols, rows_per_chunk);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (chunks > 1) {
    layer_norm_param_final_kernel<<<grid_for(cols), kThreads, 0, stream>>>(
        partial_gamma.data_ptr<float>(), partial_beta.data_ptr<float>(), dgamma.data_ptr<float>(),
        dbeta.data_ptr<float>(), chunks, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dx, dgamma.to(gamma.scalar_type()), dbeta.to(gamma.scalar_type())};
}

std::vector<at::Tensor> rms_norm_forward(at::Tensor x, at::Tensor gamma, double eps) {
  constexpr const char* op = "rms_norm_forward";
  check_cuda(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got ", describe(x));
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  check_vector(op, "weight", gamma, x, cols);
  const c10::cuda::CUDAGuard guard(x.device());
  x = x.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return {y, rstd.zero_()};  // nothing to launch, no division by cols
  check_launchable(op, rows);
  const at::Tensor g = gamma.contiguous();
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    rms_norm_forward_kernel<T><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), g.data_ptr<T>(), y.data_ptr<T>(), rstd.data_ptr<float>(), cols, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_backward(at::Tensor dy, at::Tensor x, at::Tensor gamma, at::Tensor rstd) {
  constexpr const char* op = "rms_norm_backward";
  check_cuda(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got ", describe(x));
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  check_same(op, "dy", dy, x);
  check_vector(op, "weight", gamma, x, cols);
  TORCH_CHECK(rstd.device() == x.device() && rstd.scalar_type() == at::kFloat && rstd.numel() == rows, op,
              ": rstd must be float32 on ", x.device(), " with ", rows, " elements, got ", describe(rstd));
  const c10::cuda::CUDAGuard guard(x.device());
  dy = dy.contiguous();
  x = x.contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dgamma = at::zeros({cols}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return {dx, dgamma.to(gamma.scalar_type())};
  check_launchable(op, rows);
  const at::Tensor g = gamma.contiguous(), r = rstd.contiguous();
  auto stream = c10::cuda::getCurrentCUDAStream();
  // row chunks for dgamma as LayerNorm's: fixed by the shape, so the sums are deterministic
  const int64_t rows_per_chunk = std::max<int64_t>(64, (rows + 127) / 128);
  const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  check_launchable(op, col_tiles);
  at::Tensor partial_gamma = chunks > 1 ? at::empty({chunks, cols}, dgamma.options()) : dgamma;
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    rms_norm_backward_input_kernel<T><<<rows, kThreads, 0, stream>>>(
        dy.data_ptr<T>(), x.data_ptr<T>(), g.data_ptr<T>(), r.data_ptr<float>(), dx.data_ptr<T>(), cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    rms_norm_param_partials_kernel<T><<<dim3(col_tiles, chunks), dim3(kTileCols, kTileRows), 0, stream>>>(
        dy.data_ptr<T>(), x.data_ptr<T>(), r.data_ptr<float>(), partial_gamma.data_ptr<float>(), rows, cols,
        rows_per_chunk);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (chunks > 1) {
    rms_norm_param_final_kernel<<<grid_for(cols), kThreads, 0, stream>>>(partial_gamma.data_ptr<float>(),
                                                                          dgamma.data_ptr<float>(), chunks, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dx, dgamma.to(gamma.scalar_type())};
}

// x: [batch, heads, sq, sk]; mask: bool (true = masked out) broadcastable to x ([batch, 1, sq, sk],
// [batch, 1, 1, sk], [sq, sk], ...), or none (e.g. with causal).
at::Tensor softmax_forward(at::Tensor x, c10::optional<at::Tensor> mask, double scale, bool causal) {
  constexpr const char* op = "softmax_forward";
  check_cuda(op, "scores", x);
  TORCH_CHECK(x.dim() == 4, op, ": scores must be [batch, heads, sq, sk], got ", describe(x));
  const int64_t b = x.size(0), h = x.size(1), sq = x.size(2), sk = x.size(3);
  MaskView view{nullptr, 0, 0, 0, 0};
  at::Tensor expanded;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.device() == x.device() && m.scalar_type() == at::kBool && m.dim() <= 4, op,
                ": mask must be bool on ", x.device(), " with at most 4 dimensions, got ", describe(m));
    bool broadcastable = true;
    for (int64_t d = 1; d <= m.dim(); ++d)
      broadcastable = broadcastable && (m.size(-d) == 1 || m.size(-d) == x.size(-d));
    TORCH_CHECK(broadcastable, op, ": mask of shape ", m.sizes(), " does not broadcast to the scores' ", x.sizes());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  x = x.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = b * h * sq;
  if (rows == 0 || sk == 0) return y;
  check_launchable(op, rows);
  if (mask.has_value()) {
    expanded = mask->expand({b, h, sq, sk});  // a view: strides 0 along the broadcast dimensions
    view = MaskView{expanded.data_ptr<bool>(), expanded.stride(0), expanded.stride(1), expanded.stride(2),
                    expanded.stride(3)};
  }
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    softmax_forward_kernel<T><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), view, y.data_ptr<T>(), h, sq, sk, static_cast<float>(scale), causal);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor softmax_backward(at::Tensor dy, at::Tensor y, double scale) {
  constexpr const char* op = "softmax_backward";
  check_cuda(op, "y", y);
  TORCH_CHECK(y.dim() >= 1, op, ": y must have at least one dimension, got ", describe(y));
  check_same(op, "dy", dy, y);
  const c10::cuda::CUDAGuard guard(y.device());
  dy = dy.contiguous();
  y = y.contiguous();
  at::Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
  const int64_t cols = y.size(-1), rows = leading_rows(y);
  if (rows == 0 || cols == 0) return dx;
  check_launchable(op, rows);
  dispatch_float(y.scalar_type(), [&](auto t) {
    using T = decltype(t);
    softmax_backward_kernel<T><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<T>(), y.data_ptr<T>(), dx.data_ptr<T>(), cols, static_cast<float>(scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

at::Tensor bias_gelu_forward(at::Tensor x, at::Tensor bias) {
  constexpr const char* op = "bias_gelu_forward";
  check_cuda(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got ", describe(x));
  check_vector(op, "bias", bias, x, x.size(-1));
  const c10::cuda::CUDAGuard guard(x.device());
  x = x.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return y;
  const at::Tensor b = bias.contiguous();
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    bias_gelu_forward_kernel<T><<<grid_for(x.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), b.data_ptr<T>(), y.data_ptr<T>(), x.numel(), b.numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor bias_gelu_backward(at::Tensor dy, at::Tensor x, at::Tensor bias) {
  constexpr const char* op = "bias_gelu_backward";
  check_cuda(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got ", describe(x));
  check_same(op, "dy", dy, x);
  check_vector(op, "bias", bias, x, x.size(-1));
  const c10::cuda::CUDAGuard guard(x.device());
  dy = dy.contiguous();
  x = x.contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return dx;
  const at::Tensor b = bias.contiguous();
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    bias_gelu_backward_kernel<T><<<grid_for(x.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<T>(), x.data_ptr<T>(), b.data_ptr<T>(), dx.data_ptr<T>(), x.numel(), b.numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}
