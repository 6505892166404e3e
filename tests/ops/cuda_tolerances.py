"""Tolerances of the CUDA kernels against torch's ops, per dtype (shared by the cuda-marked tests)."""

import torch

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
             torch.float16: dict(rtol=1e-2, atol=1e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
