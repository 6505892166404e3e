// Python bindings of the CUDA kernels in cuda_kernels.cu.
#include <torch/extension.h>

#include <vector>

void multi_tensor_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                       std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step, bool adamw, bool bias_correction,
                       double grad_scale, c10::optional<at::Tensor> grad_scale_tensor);
void multi_tensor_lamb(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                       std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step, bool bias_correction,
                       double max_coeff, double min_coeff, double grad_scale,
                       c10::optional<at::Tensor> grad_scale_tensor);
std::vector<at::Tensor> layer_norm_forward(at::Tensor x, at::Tensor gamma, at::Tensor beta, double eps);
std::vector<at::Tensor> layer_norm_backward(at::Tensor dy, at::Tensor x, at::Tensor gamma, at::Tensor mean,
                                            at::Tensor rstd);
std::vector<at::Tensor> rms_norm_forward(at::Tensor x, at::Tensor gamma, double eps);
std::vector<at::Tensor> rms_norm_backward(at::Tensor dy, at::Tensor x, at::Tensor gamma, at::Tensor rstd);
at::Tensor softmax_forward(at::Tensor x, c10::optional<at::Tensor> mask, double scale, bool causal);
at::Tensor softmax_backward(at::Tensor dy, at::Tensor y, double scale);
at::Tensor bias_gelu_forward(at::Tensor x, at::Tensor bias);
at::Tensor bias_gelu_backward(at::Tensor dy, at::Tensor x, at::Tensor bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // grad_scale_tensor: the divisor as a one-element CUDA tensor (read on the device), or None
  m.def("multi_tensor_adam", &multi_tensor_adam, "Adam/AdamW over many fp32 CUDA tensors (64 a launch)",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"), py::arg("grad_scale_tensor") = py::none());
  m.def("multi_tensor_lamb", &multi_tensor_lamb, "LAMB over many fp32 CUDA tensors (trust ratio per tensor)",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("bias_correction"), py::arg("max_coeff"), py::arg("min_coeff"), py::arg("grad_scale"),
        py::arg("grad_scale_tensor") = py::none());
  m.def("layer_norm_forward", &layer_norm_forward, "LayerNorm forward: (y, mean, rstd)");
  m.def("layer_norm_backward", &layer_norm_backward, "LayerNorm backward: (dx, dgamma, dbeta)");
  m.def("rms_norm_forward", &rms_norm_forward, "RMSNorm forward: (y, rstd)");
  m.def("rms_norm_backward", &rms_norm_backward, "RMSNorm backward: (dx, dgamma)");
  m.def("softmax_forward", &softmax_forward, "scaled masked (or causal) softmax forward");
  m.def("softmax_backward", &softmax_backward, "scaled softmax backward");
  m.def("bias_gelu_forward", &bias_gelu_forward, "gelu_tanh(x + bias)");
  m.def("bias_gelu_backward", &bias_gelu_backward, "gradient of gelu_tanh(x + bias) w.r.t. x");
}
