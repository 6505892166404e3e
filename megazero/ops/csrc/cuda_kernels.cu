// Megatron-style fused CUDA kernels: multi-tensor Adam/AdamW and LAMB over fp32 masters, LayerNorm
// forward/backward, scaled masked softmax and scaled causal (upper-triangular masked) softmax
// forward/backward, bias + GeLU forward/backward. fp32/fp16/bf16 inputs, fp32 arithmetic.
// Each has a pure-torch reference in megazero/ops/cuda_ops.py that the tests compare against.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <vector>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(at::Half x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }

// Sum over a block (all threads get the result); `shared` holds one float per warp.
__device__ float block_sum(float value, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  value = threadIdx.x < warps ? shared[threadIdx.x] : 0.0f;
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

// ---- multi-tensor optimizers ------------------------------------------------------------------
constexpr int kChunk = 4096;  // elements per block

struct TensorList {
  const int64_t* params;  // device arrays of raw pointers (as int64) and sizes
  const int64_t* grads;
  const int64_t* exp_avgs;
  const int64_t* exp_avg_sqs;
  const int64_t* sizes;
  const int64_t* chunk_tensor;  // per block: which tensor
  const int64_t* chunk_start;   // per block: first element
};

template <typename G>
__global__ void adam_kernel(TensorList list, float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                            float l2, float decay, float neg_step_size, float inv_bias2_sqrt, float inv_grad_scale) {
  const int64_t t = list.chunk_tensor[blockIdx.x];
  const int64_t start = list.chunk_start[blockIdx.x];
  const int64_t end = min(start + kChunk, list.sizes[t]);
  float* p = reinterpret_cast<float*>(list.params[t]);
  const G* g = reinterpret_cast<const G*>(list.grads[t]);
  float* m = reinterpret_cast<float*>(list.exp_avgs[t]);
  float* v = reinterpret_cast<float*>(list.exp_avg_sqs[t]);
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    float grad = to_float(g[i]) * inv_grad_scale;
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

template <typename G>
__global__ void lamb_moments_kernel(TensorList list, float beta1, float one_minus_beta1, float beta2,
                                    float one_minus_beta2, float eps, float weight_decay, float bias1, float bias2,
                                    float inv_grad_scale, float* norms) {
  __shared__ float shared[32];
  const int64_t t = list.chunk_tensor[blockIdx.x];
  const int64_t start = list.chunk_start[blockIdx.x];
  const int64_t end = min(start + kChunk, list.sizes[t]);
  const float* p = reinterpret_cast<const float*>(list.params[t]);
  const G* g = reinterpret_cast<const G*>(list.grads[t]);
  float* m = reinterpret_cast<float*>(list.exp_avgs[t]);
  float* v = reinterpret_cast<float*>(list.exp_avg_sqs[t]);
  float w2 = 0.0f, u2 = 0.0f;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float grad = to_float(g[i]) * inv_grad_scale;
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
    atomicAdd(&norms[2 * t], w2);
    atomicAdd(&norms[2 * t + 1], u2);
  }
}

__global__ void lamb_apply_kernel(TensorList list, float eps, float weight_decay, float bias1, float bias2, float lr,
                                  float min_coeff, float max_coeff, const float* norms) {
  const int64_t t = list.chunk_tensor[blockIdx.x];
  const int64_t start = list.chunk_start[blockIdx.x];
  const int64_t end = min(start + kChunk, list.sizes[t]);
  float* p = reinterpret_cast<float*>(list.params[t]);
  const float* m = reinterpret_cast<const float*>(list.exp_avgs[t]);
  const float* v = reinterpret_cast<const float*>(list.exp_avg_sqs[t]);
  const float w2 = norms[2 * t], u2 = norms[2 * t + 1];
  float trust = 1.0f;
  if (w2 > 0.0f && u2 > 0.0f) trust = fminf(fmaxf(sqrtf(w2) / sqrtf(u2), min_coeff), max_coeff);
  const float scaled_lr = lr * trust;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float u = (m[i] / bias1) / (sqrtf(v[i] / bias2) + eps) + weight_decay * p[i];
    p[i] = p[i] - scaled_lr * u;
  }
}

// Builds the device-side tensor table and the chunk map; keeps the host tensors alive.
struct DeviceTable {
  at::Tensor table;  // [7, ...] int64 on the device
  TensorList list;
  int64_t blocks;
};

DeviceTable make_table(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs) {
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<int64_t> chunk_tensor, chunk_start;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(params[t].is_cuda() && params[t].scalar_type() == at::kFloat && params[t].is_contiguous(),
                "parameters must be contiguous float32 CUDA tensors");
    TORCH_CHECK(grads[t].numel() == params[t].numel() && grads[t].is_contiguous(), "gradient ", t, " mismatches");
    for (int64_t s = 0; s < params[t].numel(); s += kChunk) {
      chunk_tensor.push_back(t);
      chunk_start.push_back(s);
    }
  }
  const int64_t chunks = static_cast<int64_t>(chunk_tensor.size());
  at::Tensor host = at::empty({5 * n + 2 * chunks}, at::kLong);
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    h[t] = reinterpret_cast<int64_t>(params[t].data_ptr());
    h[n + t] = reinterpret_cast<int64_t>(grads[t].data_ptr());
    h[2 * n + t] = reinterpret_cast<int64_t>(exp_avgs[t].data_ptr());
    h[3 * n + t] = reinterpret_cast<int64_t>(exp_avg_sqs[t].data_ptr());
    h[4 * n + t] = params[t].numel();
  }
  std::copy(chunk_tensor.begin(), chunk_tensor.end(), h + 5 * n);
  std::copy(chunk_start.begin(), chunk_start.end(), h + 5 * n + chunks);
  DeviceTable out;
  out.table = host.to(params[0].device(), /*non_blocking=*/false);
  const int64_t* d = out.table.data_ptr<int64_t>();
  out.list = TensorList{d, d + n, d + 2 * n, d + 3 * n, d + 4 * n, d + 5 * n, d + 5 * n + chunks};
  out.blocks = chunks;
  return out;
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

template <typename T>
__global__ void layer_norm_backward_kernel(const T* dy, const T* x, const T* gamma, const float* mean,
                                           const float* rstd, T* dx, float* dgamma, float* dbeta, int64_t cols) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const float mu = mean[row], r = rstd[row];
  float sum_dyg = 0.0f, sum_dyg_xhat = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(x[row * cols + c]) - mu) * r;
    const float g = to_float(dy[row * cols + c]);
    const float dyg = g * to_float(gamma[c]);
    sum_dyg += dyg;
    sum_dyg_xhat += dyg * xhat;
    atomicAdd(&dgamma[c], g * xhat);
    atomicAdd(&dbeta[c], g);
  }
  sum_dyg = block_sum(sum_dyg, shared);
  sum_dyg_xhat = block_sum(sum_dyg_xhat, shared);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(x[row * cols + c]) - mu) * r;
    const float dyg = to_float(dy[row * cols + c]) * to_float(gamma[c]);
    dx[row * cols + c] = from_float<T>(r * (dyg - (sum_dyg + xhat * sum_dyg_xhat) / cols));
  }
}

// ---- softmax -----------------------------------------------------------------------------------
// One block per row of `cols` scores; masked positions (mask != 0, or col > row + offset when
// causal) get probability 0; a row with every position masked gets all zeros.
template <typename T>
__global__ void softmax_forward_kernel(const T* x, const bool* mask, T* y, int64_t cols, int64_t rows_per_mask,
                                       int64_t mask_rows, float scale, bool causal, int64_t sq) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const bool* mr = mask ? mask + ((row / rows_per_mask) * mask_rows + row % mask_rows) * cols : nullptr;
  const int64_t query = row % sq;
  auto masked = [&](int64_t c) { return (mr && mr[c]) || (causal && c > query); };
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    if (!masked(c)) mx = fmaxf(mx, to_float(xr[c]) * scale);
  mx = block_max(mx, shared);
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    if (!masked(c)) sum += __expf(to_float(xr[c]) * scale - mx);
  sum = block_sum(sum, shared);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float p = (masked(c) || sum == 0.0f) ? 0.0f : __expf(to_float(xr[c]) * scale - mx) / sum;
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

void multi_tensor_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                       std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step, bool adamw, bool bias_correction,
                       double grad_scale) {
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  DeviceTable table = make_table(params, grads, exp_avgs, exp_avg_sqs);
  const double bias1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bias2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_grad(grads[0].scalar_type(), [&](auto g) {
    using G = decltype(g);
    adam_kernel<G><<<table.blocks, kThreads, 0, stream>>>(
        table.list, static_cast<float>(1.0 - beta1), static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
        static_cast<float>(eps), static_cast<float>(adamw ? 0.0 : weight_decay),
        static_cast<float>(adamw ? 1.0 - lr * weight_decay : 1.0), static_cast<float>(-lr / bias1),
        static_cast<float>(1.0 / std::sqrt(bias2)), static_cast<float>(1.0 / grad_scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void multi_tensor_lamb(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                       std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step, bool bias_correction,
                       double max_coeff, double min_coeff, double grad_scale) {
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  DeviceTable table = make_table(params, grads, exp_avgs, exp_avg_sqs);
  const float bias1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const float bias2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  at::Tensor norms = at::zeros({2 * static_cast<int64_t>(params.size())}, params[0].options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_grad(grads[0].scalar_type(), [&](auto g) {
    using G = decltype(g);
    lamb_moments_kernel<G><<<table.blocks, kThreads, 0, stream>>>(
        table.list, static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
        static_cast<float>(1.0 - beta2), static_cast<float>(eps), static_cast<float>(weight_decay), bias1, bias2,
        static_cast<float>(1.0 / grad_scale), norms.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  lamb_apply_kernel<<<table.blocks, kThreads, 0, stream>>>(
      table.list, static_cast<float>(eps), static_cast<float>(weight_decay), bias1, bias2, static_cast<float>(lr),
      static_cast<float>(min_coeff), static_cast<float>(max_coeff), norms.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<at::Tensor> layer_norm_forward(at::Tensor x, at::Tensor gamma, at::Tensor beta, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  x = x.contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    layer_norm_forward_kernel<T><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), gamma.contiguous().data_ptr<T>(), beta.contiguous().data_ptr<T>(), y.data_ptr<T>(),
        mean.data_ptr<float>(), rstd.data_ptr<float>(), cols, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, mean, rstd};
}

std::vector<at::Tensor> layer_norm_backward(at::Tensor dy, at::Tensor x, at::Tensor gamma, at::Tensor mean,
                                            at::Tensor rstd) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  dy = dy.contiguous();
  x = x.contiguous();
  at::Tensor dx = at::empty_like(x);
  at::Tensor dgamma = at::zeros({cols}, x.options().dtype(at::kFloat));
  at::Tensor dbeta = at::zeros({cols}, x.options().dtype(at::kFloat));
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    layer_norm_backward_kernel<T><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<T>(), x.data_ptr<T>(), gamma.contiguous().data_ptr<T>(), mean.data_ptr<float>(),
        rstd.data_ptr<float>(), dx.data_ptr<T>(), dgamma.data_ptr<float>(), dbeta.data_ptr<float>(), cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dx, dgamma.to(gamma.scalar_type()), dbeta.to(gamma.scalar_type())};
}

// x: [batch, heads, sq, sk]; mask: [batch, 1, sq, sk] bool (true = masked out), or undefined with causal.
at::Tensor softmax_forward(at::Tensor x, c10::optional<at::Tensor> mask, double scale, bool causal) {
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() == 4, "scores must be [batch, heads, sq, sk]");
  x = x.contiguous();
  const int64_t b = x.size(0), h = x.size(1), sq = x.size(2), sk = x.size(3);
  at::Tensor y = at::empty_like(x);
  const bool* mask_ptr = nullptr;
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool && m.size(0) == b && m.size(1) == 1 && m.size(2) == sq && m.size(3) == sk,
                "mask must be bool [batch, 1, sq, sk]");
    mask_ptr = m.data_ptr<bool>();
  }
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    softmax_forward_kernel<T><<<b * h * sq, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), mask_ptr, y.data_ptr<T>(), sk, h * sq, sq, static_cast<float>(scale), causal, sq);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor softmax_backward(at::Tensor dy, at::Tensor y, double scale) {
  const c10::cuda::CUDAGuard guard(y.device());
  dy = dy.contiguous();
  y = y.contiguous();
  at::Tensor dx = at::empty_like(y);
  const int64_t cols = y.size(-1), rows = y.numel() / cols;
  dispatch_float(y.scalar_type(), [&](auto t) {
    using T = decltype(t);
    softmax_backward_kernel<T><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<T>(), y.data_ptr<T>(), dx.data_ptr<T>(), cols, static_cast<float>(scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

at::Tensor bias_gelu_forward(at::Tensor x, at::Tensor bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  x = x.contiguous();
  at::Tensor y = at::empty_like(x);
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    bias_gelu_forward_kernel<T><<<grid_for(x.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), bias.contiguous().data_ptr<T>(), y.data_ptr<T>(), x.numel(), bias.numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor bias_gelu_backward(at::Tensor dy, at::Tensor x, at::Tensor bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  dy = dy.contiguous();
  x = x.contiguous();
  at::Tensor dx = at::empty_like(x);
  dispatch_float(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    bias_gelu_backward_kernel<T><<<grid_for(x.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<T>(), x.data_ptr<T>(), bias.contiguous().data_ptr<T>(), dx.data_ptr<T>(), x.numel(),
        bias.numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}
