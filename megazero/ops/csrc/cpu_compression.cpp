// 1-bit compression with error feedback on CPU: the two passes of megazero/optim/compression.py
// (its compress / decode_mean are the pure-torch reference these are tested against).
//
// compress_: per block of `block` elements, error <- values + error, scale = sqrt(sum(error^2) /
//   count) (squares summed in fp64: each is exact there, so the scale does not depend on the
//   summation order), one sign bit per element (1: >= 0, first element in the byte's high bit),
//   and error <- error - (bit ? scale : -scale). One pass over memory: a block stays in cache.
// decode_mean_: out = (sum over rows w of (bit ? scale_w : -scale_w)) / rows, rows in order.
//
// Threads: OpenMP over blocks; every block is computed the same way whatever the thread count.
#include "op_headers.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Below this many elements one thread does it all (as cpu_norms.cpp: a team's wake-up costs more).
// x86-64: each block kernel is compiled for AVX-512, AVX2 and the baseline, picked when the op loads
#if defined(__x86_64__) && defined(__GNUC__)
#define MZ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MZ_CLONES
#endif

constexpr int64_t kParallelElements = 32768;
constexpr int64_t kMaxBlock = 1 << 16;  // the largest block compress_ takes (a stack buffer of flags)

// The 8 signs (+1 or -1) of each byte value, first element in the high bit.
struct SignTable {
  alignas(32) float row[256][8];
  SignTable() {
    for (int byte = 0; byte < 256; ++byte)
      for (int j = 0; j < 8; ++j) row[byte][j] = (byte >> (7 - j)) & 1 ? 1.0f : -1.0f;
  }
};
const SignTable kSigns;

// One block, in cache after its first loop: error <- values + error, the scale, the signs, the
// error left.
MZ_CLONES float compress_block(
    const float* values, float* error, float count, uint8_t* bits, int64_t block) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < block; ++i) {
    const float x = error[i] + values[i];
    error[i] = x;
    sum += static_cast<double>(x) * static_cast<double>(x);
  }
  const float scale = static_cast<float>(std::sqrt(sum / static_cast<double>(count)));
  alignas(64) uint8_t positive[kMaxBlock];
#pragma omp simd
  for (int64_t i = 0; i < block; ++i) {
    const bool up = error[i] >= 0.0f;
    positive[i] = up;
    error[i] = error[i] - (up ? scale : -scale);
  }
  // 8 flags (0/1 bytes; x86 and ARM are little-endian: the first in the low byte) to one byte, the
  // first in the high bit
  for (int64_t k = 0; k < block / 8; ++k) {
    uint64_t flags;
    std::memcpy(&flags, positive + k * 8, 8);
    bits[k] = static_cast<uint8_t>((flags * 0x8040201008040201ULL) >> 56);
  }
  return scale;
}

// One block of decode_mean_: row w's signs at bits + w * row_bytes, its scale at scales[w * row_scales].
MZ_CLONES void decode_block(const uint8_t* bits, int64_t row_bytes, const float* scales, int64_t row_scales,
                            int64_t rows, int64_t block, float* out) {
  for (int64_t w = 0; w < rows; ++w) {
    const uint8_t* ib = bits + w * row_bytes;
    const float scale = scales[w * row_scales];
    for (int64_t k = 0; k < block / 8; ++k) {
      const float* sign = kSigns.row[ib[k]];
      float* x = out + k * 8;
      if (w == 0) {
#pragma omp simd
        for (int j = 0; j < 8; ++j) x[j] = sign[j] * scale;  // +-1 x scale: exactly +-scale
      } else {
#pragma omp simd
        for (int j = 0; j < 8; ++j) x[j] += sign[j] * scale;
      }
    }
  }
  if (rows > 1) {  // x / 1 is x: one row needs no pass
    const float divisor = static_cast<float>(rows);
#pragma omp simd
    for (int64_t i = 0; i < block; ++i) out[i] /= divisor;
  }
}

void check_float(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 cpu tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.numel() == numel, name, " must have ", numel, " elements, got ", t.numel());
}

void check_bytes(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous(), name,
              " must be a contiguous uint8 cpu tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.numel() == numel, name, " must have ", numel, " elements, got ", t.numel());
}

void compress_(const at::Tensor& values, at::Tensor& error, const at::Tensor& counts, at::Tensor& bits,
               at::Tensor& scales, int64_t block) {
  TORCH_CHECK(block > 0 && block % 8 == 0 && block <= kMaxBlock,
              "compress_: block must be a positive multiple of 8 up to ", kMaxBlock, ", got ", block);
  const int64_t n = values.numel();
  TORCH_CHECK(n % block == 0, "compress_: ", n, " elements are not whole blocks of ", block);
  const int64_t blocks = n / block;
  check_float(values, "values", n);
  check_float(error, "error", n);
  check_float(counts, "counts", blocks);
  check_bytes(bits, "bits", n / 8);
  check_float(scales, "scales", blocks);
  const float* v = values.data_ptr<float>();
  float* e = error.data_ptr<float>();
  const float* c = counts.data_ptr<float>();
  uint8_t* out = bits.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
  for (int64_t b = 0; b < blocks; ++b)
    s[b] = compress_block(v + b * block, e + b * block, c[b], out + b * (block / 8), block);
}

void decode_mean_(const at::Tensor& bits, const at::Tensor& scales, int64_t block, at::Tensor& out) {
  TORCH_CHECK(block > 0 && block % 8 == 0, "decode_mean_: block must be a positive multiple of 8, got ", block);
  TORCH_CHECK(bits.dim() == 2 && scales.dim() == 2 && bits.size(0) == scales.size(0),
              "decode_mean_: bits and scales must be [rows, ...] with the same rows");
  const int64_t rows = bits.size(0), n = out.numel();
  TORCH_CHECK(rows > 0 && n % block == 0, "decode_mean_: ", n, " elements are not whole blocks of ", block);
  const int64_t blocks = n / block;
  check_bytes(bits, "bits", rows * n / 8);
  check_float(scales, "scales", rows * blocks);
  check_float(out, "out", n);
  const uint8_t* in = bits.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
  for (int64_t b = 0; b < blocks; ++b)
    decode_block(in + b * (block / 8), n / 8, s + b, blocks, rows, block, o + b * block);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compress_", &compress_, "1-bit compression with error feedback, in place (error, bits, scales)");
  m.def("decode_mean_", &decode_mean_, "mean over rows of sign x scale, into out");
}
