// What the two C++ files of llmkit's CPU extension share (native.py builds them into one module):
// cpu_kernel.cpp, quantized matrix products; cpu_decode.cpp, a decoder block's decode step built on them.

#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace llmkit {

// Argument checks throw std::runtime_error (Python's RuntimeError through pybind11) with a message put together
// from strings and std::to_string, not TORCH_CHECK: on one machine (torch 2.11 + CUDA 13, the extension built by GCC
// 13.3) the two failing TORCH_CHECKs tried whose messages format a number crashed the process (SIGSEGV) instead of
// raising, while the two with constant messages raised (cause not found); this path uses neither c10::Error nor
// iostreams (not yet run on that machine).
inline void append_to(std::string& s, const char* v) { s += v; }
inline void append_to(std::string& s, const std::string& v) { s += v; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void append_to(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename... Args>
[[noreturn]] void check_failed(const Args&... parts) {
  std::string message;
  (append_to(message, parts), ...);
  throw std::runtime_error(message);
}
#define LLMKIT_CHECK(condition, ...)                         \
  do {                                                       \
    if (!(condition)) ::llmkit::check_failed(__VA_ARGS__); \
  } while (0)

// The kernels read and write through raw pointers into CPU memory: a tensor elsewhere (CUDA) is refused here, where
// reading its device pointer would crash the process.
inline void check_cpu(const torch::Tensor& t, const char* what) {
  LLMKIT_CHECK(t.device().is_cpu(), what, " is on ", t.device().str(), ": llmkit's C++ kernels take CPU tensors");
}

constexpr int64_t BLOCK = 32;  // inputs per block of x's int8 codes (and per smallest weight group)

// Rows of x rounded to int8 per block of 32, with one fp32 scale and the float sum of each block.
struct QuantizedRows {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;       // (M, K); for int4 each span of 64 columns holds its even, then its odd columns
  std::vector<float> d, sums;  // (M, K / 32)
};

// x (M, K) fp32 -> `out`. even_odd: the int4 order, in which packed nibbles unpack.
void quantize_rows(const float* x, int64_t M, int64_t K, bool even_odd, QuantizedRows& out);

// The same codes as the AVX512-VNNI kernel (cpu_vnni.cpp) reads them.
struct VnniRows {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;       // (K / 32, M, 32): by block, then row; int4: each 8 columns' even ones, then odd ones
  std::vector<float> d, sums;  // (K / 32, M)
  std::vector<int32_t> flip;   // int8: (K / 32, M), 128 times each block's sum of codes
};

// A weight matrix in llmkit's formats (formats.py), borrowed from its tensors (which must outlive it).
struct QuantizedMatrix {
  const uint8_t* codes = nullptr;  // int4: (N, K / 2) packed, low nibble first; int8: (N, K)
  const float* scales = nullptr;   // (N, G)
  const float* zeros = nullptr;    // (N, G), int4 only
  int64_t N = 0, K = 0, G = 1;
  bool int4 = true;
  // Optional, read by the AVX512-VNNI kernel instead of transposing its own: the scales (and zeros) of each tile of
  // VNNI_TILE rows as (G, VNNI_TILE), group g's values of the tile's rows side by side; tile t at t * VNNI_TILE * G.
  const float* tiled_scales = nullptr;
  const float* tiled_zeros = nullptr;
};

constexpr int64_t VNNI_TILE = 16;  // output columns the AVX512-VNNI kernel computes at once

QuantizedMatrix int4_matrix(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& zeros);
QuantizedMatrix int8_matrix(const torch::Tensor& qweight, const torch::Tensor& scales);

// x @ W_i^T for one or more matrices W_i of one kind (int4 or int8) and the same K, as one output of width
// sum(N_i) (a layer's q, k and v side by side). `prepare` quantizes x once and sums it per scale group; then any
// range of output columns can be computed on its own, so callers split the columns over threads as they like.
class Product {
 public:
  void prepare(const float* x, int64_t M, int64_t K, const std::vector<QuantizedMatrix>& ws);
  int64_t width() const { return starts_.back(); }
  // y[m, j] for j in [j0, j1) of the side-by-side output; y (M, ldy) row-major
  void columns(int64_t j0, int64_t j1, float* y, int64_t ldy) const;

 private:
  QuantizedRows x_;
  VnniRows vnni_;  // x in the VNNI kernel's order, where it runs
  bool use_vnni_ = false;
  std::vector<QuantizedMatrix> ws_;
  std::vector<float> spread_;                   // int4: x's block scales and sums spread for pairs of blocks
  std::vector<int64_t> starts_{0};             // each matrix's first output column
};

// The AVX512-VNNI kernel (cpu_vnni.cpp): whether the CPU has it, whether products use it (the default where it
// does; select_vnni(false) keeps the AVX2 kernel), x's codes in its order (from quantize_rows' column order), and
// output columns [n0, n1) of x @ W^T into y (M, ldy).
bool cpu_has_avx512_vnni();
bool vnni_selected();
void select_vnni(bool on);
void vnni_prepare(const QuantizedRows& q, bool int4, VnniRows& out);
void vnni_columns(const QuantizedMatrix& w, const VnniRows& x, int64_t n0, int64_t n1, float* y, int64_t ldy);

// Rows [n0, n1) of W as fp32: out (n1 - n0, K) row-major.
void dequantize_rows(const QuantizedMatrix& w, int64_t n0, int64_t n1, float* out);
// The same rounded to bf16 (the bits of at::BFloat16), for a product on the CPU's bf16 units.
void dequantize_rows_bf16(const QuantizedMatrix& w, int64_t n0, int64_t n1, uint16_t* out);

// 2 x 8 floats -> 16 bf16 (their upper halves, rounded to nearest even, as torch rounds finite values): lo's, then
// hi's, as one register of 16-bit lanes
inline __m256i bf16_round(__m256 lo, __m256 hi) {
  __m256i half[2];
  const __m256 f[2] = {lo, hi};
  for (int i = 0; i < 2; ++i) {
    const __m256i b = _mm256_castps_si256(f[i]);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    half[i] = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  }
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xD8);  // packus pairs 128-bit lanes
}

// y[m, n] = (x @ W^T)[m, n] for n in [n0, n1), an fp32 W (N, K) and a few rows of x (M, K): a plain FMA loop over
// W's rows (MKL runs such small products on one thread, and 5x slower per byte beyond one row). y: (M, ldy).
void float_columns(const float* x, int64_t M, const float* w, int64_t K, int64_t n0, int64_t n1, float* y,
                   int64_t ldy);

}  // namespace llmkit
