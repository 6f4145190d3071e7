// Quantized matrix products for x86 CPUs with AVX2 (llmkit/quant/native.py compiles this file on first use).
//
// y (M, N) = x (M, K) @ W^T, with W in llmkit's formats (formats.py):
//   int4: qweight (N, K/2) uint8, column 2j in the low nibble and 2j+1 in the high one; scales, zeros (N, G)
//   int8: qweight (N, K) int8; scales (N, G)
// G groups of g = K / G inputs each, g a multiple of 32.
//
// The method is llama.cpp's: each row of x is rounded to int8 in blocks of 32 values (one fp32 scale per block;
// relative error about 0.4% of the block's largest value), then every block's dot product with the weight codes
// is computed in integers (vpmaddubsw multiplies unsigned by signed bytes, vpmaddwd sums the pairs) and scaled
// once. Weights are unpacked once per block and used for every row of x, so small batches cost little more than
// one row. For int4 the zero term zero * sum(x) of each group uses the exact float sum of x.
//
// Work is split over output rows with at::parallel_for (torch's threads, torch.set_num_threads).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t ROWS = 4;  // rows of x computed together (registers: ROWS accumulators per output)

// x rows -> int8 codes per block of 32 (for int4, reordered within each block as the 16 even then the 16 odd
// columns, the order in which the nibbles unpack), the block scales, and the float sum of each block.
void quantize_rows(const float* x, int64_t M, int64_t K, bool even_odd, int8_t* q, float* d, float* sums) {
  const int64_t nb = K / BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + m * K + b * BLOCK;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) {
        amax = std::max(amax, std::fabs(src[i]));
        sum += src[i];
      }
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      int8_t* dst = q + (m * nb + b) * BLOCK;
      for (int64_t i = 0; i < BLOCK; ++i) {
        const int64_t at = even_odd ? (i % 2) * 16 + i / 2 : i;
        dst[at] = static_cast<int8_t>(std::nearbyint(src[i] * inv));
      }
      d[m * nb + b] = scale;
      sums[m * nb + b] = sum;
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 int4 codes of one block (16 bytes) -> 32 unsigned bytes: the low nibbles, then the high ones.
inline __m256i unpack_int4(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// sum over 32 pairs of (unsigned w) * (signed x), as 8 int32 lanes
inline __m256i dot_u8s8(__m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

void check(const torch::Tensor& x, const torch::Tensor& scales, int64_t N, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be (M, K) fp32");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weights ", K);
  TORCH_CHECK(K % BLOCK == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == N, "bad scales");
  TORCH_CHECK((K / scales.size(1)) % BLOCK == 0, "the group size must be a multiple of 32");
}

}  // namespace

// Block b of one output column for R rows of x, into accumulator set A (0 or 1: consecutive blocks alternate,
// so that two chains of FMAs hide each other's latency). All indices the compiler sees are constants, so the
// accumulators stay in registers.
template <int R, int A, bool INT4>
inline void block(__m256 (&acc)[R][2], const uint8_t* wrow, float sw, const int8_t* xq, const float* xd, int64_t nb,
                  int64_t m0, int64_t b) {
  __m256i w, wu;
  if constexpr (INT4) {
    wu = unpack_int4(wrow + b * (BLOCK / 2));
  } else {
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + b * BLOCK));
    wu = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes; the sign moves onto x
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = (m0 + r) * nb + b;
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + row * BLOCK));
    if constexpr (!INT4) xv = _mm256_sign_epi8(xv, w);
    const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
    acc[r][A] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sw * xd[row]), acc[r][A]);
  }
}

// One output column n for R rows of x starting at m0. INT4: codes unpacked from nibbles, plus the zero term; else
// int8 codes (signed). `shift`: log2 of the blocks per scale group (G > 1), so a block's group is b >> shift.
template <int R, bool INT4>
inline void column(const uint8_t* wrow, const float* S, const float* Z, int64_t n, int64_t G, int shift,
                   const int8_t* xq, const float* xd, const float* xgs, int64_t nb, int64_t m0, float* Y, int64_t N) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* srow = S + n * G;
  auto scale = [&](int64_t b) { return G == 1 ? srow[0] : srow[b >> shift]; };
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    block<R, 0, INT4>(acc, wrow, scale(b), xq, xd, nb, m0, b);
    block<R, 1, INT4>(acc, wrow, scale(b + 1), xq, xd, nb, m0, b + 1);
  }
  if (b < nb) block<R, 0, INT4>(acc, wrow, scale(b), xq, xd, nb, m0, b);
  for (int r = 0; r < R; ++r) {
    float zero_term = 0.f;
    if constexpr (INT4)
      for (int64_t g = 0; g < G; ++g) zero_term += Z[n * G + g] * xgs[(m0 + r) * G + g];
    Y[(m0 + r) * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + zero_term;
  }
}

template <bool INT4>
torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros) {
  const int64_t M = x.size(0), N = qweight.size(0), K = INT4 ? qweight.size(1) * 2 : qweight.size(1);
  check(x, scales, N, K);
  TORCH_CHECK(qweight.scalar_type() == (INT4 ? torch::kUInt8 : torch::kInt8) && qweight.is_contiguous(),
              "qweight must be ", INT4 ? "uint8 (packed int4)" : "int8");
  if (INT4) TORCH_CHECK(zeros.sizes() == scales.sizes() && zeros.is_contiguous(), "zeros must match scales");
  const int64_t nb = K / BLOCK, G = scales.size(1), per_group = nb / G;
  TORCH_CHECK(G == 1 || (per_group & (per_group - 1)) == 0, "the group size must be 32 times a power of two");
  const int shift = __builtin_ctzll(per_group);
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb), xgs(M * G, 0.f);
  quantize_rows(x.data_ptr<float>(), M, K, INT4, xq.data(), xd.data(), xs.data());
  for (int64_t m = 0; m < M; ++m)  // each group's float sum of x, for the int4 zero term
    for (int64_t b = 0; b < nb; ++b) xgs[m * G + b / per_group] += xs[m * nb + b];
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* W = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const int64_t row_bytes = INT4 ? K / 2 : K;
  const float* S = scales.data_ptr<float>();
  const float* Z = INT4 ? zeros.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {  // the weight row stays in L1 while every tile of x rows passes
      const uint8_t* wrow = W + n * row_bytes;
      int64_t m0 = 0;
      for (; m0 + ROWS <= M; m0 += ROWS)
        column<ROWS, INT4>(wrow, S, Z, n, G, shift, xq.data(), xd.data(), xgs.data(), nb, m0, Y, N);
      switch (M - m0) {
        case 3: column<3, INT4>(wrow, S, Z, n, G, shift, xq.data(), xd.data(), xgs.data(), nb, m0, Y, N); break;
        case 2: column<2, INT4>(wrow, S, Z, n, G, shift, xq.data(), xd.data(), xgs.data(), nb, m0, Y, N); break;
        case 1: column<1, INT4>(wrow, S, Z, n, G, shift, xq.data(), xd.data(), xgs.data(), nb, m0, Y, N); break;
        default: break;
      }
    }
  });
  return y;
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros) {
  return quantized_linear<true>(x, qweight, scales, zeros);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  return quantized_linear<false>(x, qweight, scales, scales);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "x (M, K) fp32 @ int4 W^T -> (M, N)");
  m.def("int8_linear", &int8_linear, "x (M, K) fp32 @ int8 W^T -> (M, N)");
}
