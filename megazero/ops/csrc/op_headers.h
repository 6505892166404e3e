// What megazero's CPU ops need of torch: ATen's tensor, the few factory ops they call, and pybind11
// with torch's tensor casters. Not <torch/extension.h> (all of libtorch's C++ API): its parsing was
// about 3/4 of each op's build time. The build key hashes this file too (megazero/ops/builder.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>
