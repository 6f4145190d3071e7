// llama.cpp's block formats multiplied as the file stores them (llmkit/quant/blocks.py says what the bytes mean).
//
// y (M, N) = x (M, K) @ W^T with W (N, K / n * bytes) uint8: rows of blocks of n weights, byte for byte a GGUF
// tensor. For decoding rows (fewer than the caller's `many_rows`) x is rounded to int8 per 32 inputs and each block
// is multiplied in integers as it is read (cpu_blocks_kernels.inc, compiled for AVX2 and for AVX512-VNNI, picked at
// run time as cpu_vnni.cpp's kernel is: select_vnni); nothing is unpacked beyond the registers, so a decoding step
// reads the file's bytes once. From `many_rows` rows on (a prompt), W is dequantized a panel at a time and
// multiplied by torch's product, in bf16 where the caller asks for it (a CPU with native bf16), as cpu_kernel.cpp
// does for llmkit's int4 and int8 codes.

#include "cpu_blocks.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>

namespace llmkit {

namespace avx2 {
#include "cpu_blocks_kernels.inc"

void block_columns(const BlockMatrix& w, const BlockRows& x, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  with_type(w.kind, [&](auto t) { columns<decltype(t)>(w, x, n0, n1, y, ldy); });
}
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")  // vpdpbusd, vpdpwssd
namespace vnni {
#define LLMKIT_BLOCKS_VNNI 1
#include "cpu_blocks_kernels.inc"
#include "cpu_blocks_wide.inc"
#include "cpu_blocks_panels.inc"
#undef LLMKIT_BLOCKS_VNNI

void block_columns(const BlockMatrix& w, const BlockRows& x, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  with_type(w.kind, [&](auto t) {
    using T = decltype(t);
    if constexpr (FLOATS<T>)
      wide_float_columns<T>(w, x, n0, n1, y, ldy);
    else if constexpr (K4<T>)
      k4_columns<std::is_same_v<T, Q5_KT>>(w, x, n0, n1, y, ldy);
    else if constexpr (WIDE<T>)
      wide_columns<T>(w, x, n0, n1, y, ldy);
    else
      columns<T>(w, x, n0, n1, y, ldy);
  });
}

void panel_product(const BlockMatrix& w, const BlockRows& x, float* y, int64_t ldy) {
  with_type(w.kind, [&](auto t) {
    using T = decltype(t);
    if constexpr (!FLOATS<T>) panel_columns<T>(w, x, y, ldy);
  });
}

// x's side of the panels of a `kind` matrix (a PanelRows, for panel_span), or null for the float kinds
std::shared_ptr<const void> panel_rows_of(int kind, const BlockRows& x) {
  std::shared_ptr<const void> out;
  with_type(kind, [&](auto t) {
    using T = decltype(t);
    if constexpr (!FLOATS<T>) out = std::make_shared<const PanelRows>(panel_rows<T>(x));
  });
  return out;
}

// columns [n0, n1) in panels on the calling thread; rows: panel_rows_of(w.kind, x)
void panel_span(const BlockMatrix& w, const void* rows, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  with_type(w.kind, [&](auto t) {
    using T = decltype(t);
    if constexpr (!FLOATS<T>) panel_range<T>(w, *static_cast<const PanelRows*>(rows), n0, n1, y, ldy);
  });
}
}  // namespace vnni
#pragma GCC pop_options

bool block_layout(int kind, int64_t& weights, int64_t& bytes) {
  return avx2::with_type(kind, [&](auto t) { weights = decltype(t)::W, bytes = decltype(t)::BYTES; });
}

BlockMatrix block_matrix(const torch::Tensor& blocks, int kind, int64_t K) {
  int64_t weights = 0, bytes = 0;
  LLMKIT_CHECK(block_layout(kind, weights, bytes), "block type ", kind, " is not one llmkit multiplies");
  LLMKIT_CHECK(K > 0 && K % weights == 0, "rows of ", K, " weights are not whole blocks of ", weights);
  LLMKIT_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.device().is_cpu(),
               "blocks must be (N, row bytes) uint8 on the CPU");
  LLMKIT_CHECK(blocks.size(1) == K / weights * bytes, "rows of ", K, " weights take ", K / weights * bytes,
               " bytes, the blocks have ", blocks.size(1));
  LLMKIT_CHECK(blocks.stride(1) == 1 && blocks.stride(0) == blocks.size(1), "blocks must be contiguous");
  return {blocks.data_ptr<uint8_t>(), kind, blocks.size(0), K, blocks.size(1)};
}

int64_t activation_group(int kind) {
  if (kind == F16 || kind == BF16) return 0;
  return kind >= Q2_K && kind <= Q6_K || kind == IQ4_XS ? 256 : 32;
}

namespace {

// Row m of x into `out` (quantize_block_rows; out's vectors sized)
void quantize_block_row(const float* row, int64_t m, int64_t K, int64_t group, bool vnni, bool alt, BlockRows& out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < K / group; ++g) {
    const float* src = row + g * group;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < group; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + k)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float scale = _mm_cvtss_f32(h) / 127.f;  // codes q = round(x / d) in [-127, 127], half to even
    const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    out.d[m * (K / group) + g] = scale;
    int8_t* dst = out.q.data() + m * K + g * group;
    for (int64_t k = 0; k < group; k += 32) {
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + k + 8 * i), inv));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
  }
  for (int64_t j = 0; j < K / 4; ++j) {
    const int8_t* q = out.q.data() + m * K + 4 * j;
    const int four = q[0] + q[1] + q[2] + q[3];
    if (vnni) out.flip[m * (K / 4) + j] = -128 * four;
    if (j % 4 == 0) out.sums[m * (K / 16) + j / 4] = 0;
    out.sums[m * (K / 16) + j / 4] = static_cast<int16_t>(out.sums[m * (K / 16) + j / 4] + four);  // |sum| <= 2032
  }
  if (!alt) return;
  // the wide kernels' order (BlockRows::alt)
  const int64_t span = 128, piece = 16;
  const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (int64_t s = 0; s + span <= K; s += span)
    for (int p = 0; p < 8; ++p)
      std::memcpy(out.alt.data() + m * K + s + p * piece, out.q.data() + m * K + s + order[p] * piece, piece);
  for (int64_t s = 0; s + span <= K; s += span)
    for (int l = 0; l < 16; ++l) {
      const int8_t* a = out.alt.data() + m * K + s + 4 * l;
      const int sum = a[0] + a[1] + a[2] + a[3] + a[64] + a[65] + a[66] + a[67];
      out.alt_flip[(m * K + s) / 8 + l] = -128 * sum;
    }
}

}  // namespace

void quantize_block_rows(const float* x, int64_t M, int64_t K, int64_t group, BlockRows& out, bool decoding) {
  LLMKIT_CHECK(K % group == 0 && group % 32 == 0, "x's width ", K, " is not a multiple of ", group);
  out.M = M, out.K = K, out.group = group;
  out.q.resize(M * K), out.d.resize(M * (K / group)), out.sums.resize(M * (K / 16));
  const bool vnni = decoding && vnni_selected();  // flip and alt are the VNNI decoding kernels' alone
  const bool alt = vnni && group == 32;
  out.flip.resize(vnni ? M * (K / 4) : 0);
  out.alt.resize(alt ? M * K : 0);
  out.alt_flip.assign(alt ? M * (K / 8) : 0, 0);
  // (a prompt's rows in parallel; a decoding step's few rows inline: a thread team costs more than rounding them)
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t{1} << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_block_row(x + m * K, m, K, group, vnni, alt, out);
  });
}

void block_columns(const BlockMatrix& w, const BlockRows& x, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  LLMKIT_CHECK(x.K == w.K, "x has ", x.K, " columns, the weights ", w.K);
  LLMKIT_CHECK(x.group == activation_group(w.kind), "x is quantized in groups of ", x.group, ", not the kind's");
  if (vnni_selected())
    vnni::block_columns(w, x, n0, n1, y, ldy);
  else
    avx2::block_columns(w, x, n0, n1, y, ldy);
}

void dequantize_block_rows(const BlockMatrix& w, int64_t n0, int64_t n1, float* out) {
  avx2::dequantize_rows(w, n0, n1, out);
}

void dequantize_block_rows_bf16(const BlockMatrix& w, int64_t n0, int64_t n1, uint16_t* out) {
  avx2::dequantize_rows_bf16(w, n0, n1, out);
}

void BlockProduct::prepare(const float* x, int64_t M, int64_t K, const std::vector<BlockMatrix>& ws, bool panels) {
  LLMKIT_CHECK(!ws.empty(), "a product needs a matrix");
  ws_ = ws;
  starts_.assign(1, 0);
  bool g32 = false, g256 = false;
  for (const BlockMatrix& w : ws) {
    LLMKIT_CHECK(w.K == K, "matrices in one product share K");
    starts_.push_back(starts_.back() + w.N);
    const int64_t group = activation_group(w.kind);
    g32 |= group == 32, g256 |= group == 256;
  }
  if (g32) quantize_block_rows(x, M, K, 32, x32_);
  if (g256) quantize_block_rows(x, M, K, 256, x256_);
  xf_.M = M, xf_.K = K, xf_.group = 0, xf_.xf = x;
  panel_rows_.assign(ws.size(), nullptr);
  if (panels && vnni_selected())  // (the float kinds keep their kernel: x is not rounded, a row's bits are its own)
    for (size_t i = 0; i < ws.size(); ++i) panel_rows_[i] = vnni::panel_rows_of(ws[i].kind, rows_for(ws[i].kind));
}

const BlockRows& BlockProduct::rows_for(int kind) const {
  switch (activation_group(kind)) {
    case 256: return x256_;
    case 32: return x32_;
    default: return xf_;
  }
}

void BlockProduct::columns(int64_t j0, int64_t j1, float* y, int64_t ldy) const {
  for (size_t i = 0; i < ws_.size(); ++i) {  // the part of [j0, j1) that falls in matrix i
    const int64_t a = std::max(j0, starts_[i]) - starts_[i], e = std::min(j1, starts_[i + 1]) - starts_[i];
    if (a >= e) continue;
    if (panel_rows_[i])
      vnni::panel_span(ws_[i], panel_rows_[i].get(), a, e, y + starts_[i], ldy);
    else
      block_columns(ws_[i], rows_for(ws_[i].kind), a, e, y + starts_[i], ldy);
  }
}

namespace {

constexpr int64_t PANEL = int64_t{1} << 22;  // weights per dequantized panel (as cpu_kernel.cpp's)

torch::Tensor dequantized_product(const torch::Tensor& x, const BlockMatrix& w, bool bf16) {
  if (w.kind == BF16 && bf16) {  // the weights are the panel
    const auto weights = torch::from_blob(const_cast<uint8_t*>(w.data), {w.N, w.K}, x.options().dtype(torch::kBFloat16));
    return at::mm(x.to(torch::kBFloat16), weights.t()).to(torch::kFloat32);
  }
  const int64_t rows = std::max<int64_t>(16, PANEL / w.K);
  const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  auto panel = torch::empty({std::min(rows, w.N), w.K}, x.options().dtype(dtype));
  const auto xs = bf16 ? x.to(torch::kBFloat16) : x;
  torch::Tensor y;
  for (int64_t n0 = 0; n0 < w.N; n0 += rows) {
    const int64_t n1 = std::min(w.N, n0 + rows);
    at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t e) {
      if (bf16)
        dequantize_block_rows_bf16(w, a, e, reinterpret_cast<uint16_t*>(panel.data_ptr<at::BFloat16>()) + (a - n0) * w.K);
      else
        dequantize_block_rows(w, a, e, panel.data_ptr<float>() + (a - n0) * w.K);
    });
    const auto part = at::mm(xs, panel.narrow(0, 0, n1 - n0).t());
    if (n0 == 0 && n1 == w.N) return bf16 ? part.to(torch::kFloat32) : part;
    if (!y.defined()) y = torch::empty({x.size(0), w.N}, x.options());
    y.narrow(1, n0, n1 - n0).copy_(part);
  }
  return y;
}

// x @ W^T of many rows in integers (cpu_blocks_panels.inc): x rounded to int8 as for decoding rows
torch::Tensor panel_product(const torch::Tensor& x, const BlockMatrix& w) {
  BlockRows rows;
  quantize_block_rows(x.data_ptr<float>(), x.size(0), w.K, activation_group(w.kind), rows, false);
  auto y = torch::empty({x.size(0), w.N}, x.options());
  vnni::panel_product(w, rows, y.data_ptr<float>(), w.N);
  return y;
}

torch::Tensor block_linear(torch::Tensor x, torch::Tensor blocks, int64_t kind, int64_t many_rows, bool bf16,
                           bool integer) {
  check_cpu(x, "x");
  LLMKIT_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be (M, K) fp32");
  const BlockMatrix w = block_matrix(blocks, static_cast<int>(kind), x.size(1));
  if (x.size(0) >= many_rows) {
    if (integer && vnni_selected() && activation_group(w.kind) != 0) return panel_product(x, w);
    return dequantized_product(x, w, bf16);
  }
  BlockProduct product;
  product.prepare(x.data_ptr<float>(), x.size(0), w.K, {w});
  auto y = torch::empty({x.size(0), w.N}, x.options());
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) { product.columns(n0, n1, Y, w.N); });
  return y;
}

torch::Tensor block_dequantize(torch::Tensor blocks, int64_t kind, int64_t K) {
  const BlockMatrix w = block_matrix(blocks, static_cast<int>(kind), K);
  auto out = torch::empty({w.N, K}, torch::kFloat32);
  at::parallel_for(0, w.N, 16, [&](int64_t a, int64_t e) { dequantize_block_rows(w, a, e, out.data_ptr<float>() + a * K); });
  return out;
}

}  // namespace

void bind_blocks(pybind11::module& m) {
  namespace py = pybind11;
  m.def("block_linear", &block_linear, py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("many_rows") = 32,
        py::arg("bf16") = false, py::arg("integer") = false,
        "x (M, K) fp32 @ W^T for W stored as GGUF blocks of ggml type `kind` -> (M, N); from `many_rows` rows on in "
        "integer panels (`integer`, on AVX512-VNNI) or dequantized panels (in bf16: `bf16`)");
  m.def("block_dequantize", &block_dequantize, py::arg("blocks"), py::arg("kind"), py::arg("k"),
        "rows of GGUF blocks of ggml type `kind` holding k weights each -> (N, k) fp32");
}

}  // namespace llmkit
