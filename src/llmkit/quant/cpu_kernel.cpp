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
// once. Weights are unpacked once per block and used for every row of x; each row still costs its integer products
// and scalings, so from a few rows on a product is bound by arithmetic rather than memory (SmolLM2 at 8 rows: ~4.5x
// the time of one). For int4 the zero term zero * sum(x) uses the exact float sums of x. From `many_rows` rows of
// x on (the caller's choice: a prompt's prefill, a large batch), W is instead dequantized in panels and multiplied
// by torch's product: in fp32 (exact up to fp32 rounding), or where the caller asks for it (a CPU that multiplies
// bf16 natively: AVX512-BF16 or AMX, through oneDNN) in bf16: x and the panel rounded to bf16, the products summed
// in fp32, the result rounded to bf16.
//
// Work is split over output rows with at::parallel_for (torch's threads, torch.set_num_threads). Several matrices
// that read the same x (a layer's q, k and v) go in one pass: x is quantized once and the threads start once.

#include "cpu_kernel.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace llmkit {

namespace {

// 32 floats -> 32 int8 codes q = round(x / d) with d = max|x| / 127, in column order; returns d, and the float
// sum of the 32 values in `sum`. Rounds half to even, as std::nearbyint does.
inline float quantize_block(const float* src, int8_t* dst, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  sum = _mm_cvtss_f32(t);
  const float scale = _mm_cvtss_f32(m) / 127.f;
  const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // packs interleave the two 128-bit lanes: int32 a0 b0 a1 b1 -> int16 (a0 b0 | a1 b1) ... undone by one permute
  const __m256i w16a = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = _mm256_packs_epi16(w16a, w16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return scale;
}

// 64 codes in column order -> their even columns, then their odd ones (n = 64), or the same for 32 (n = 32)
inline void even_odd_split(int8_t* q, int64_t n) {
  // within each 128-bit lane: the 8 even bytes, then the 8 odd ones
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                         12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i a = _mm256_permute4x64_epi64(
      _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), split), 0xD8);  // evens | odds
  if (n == 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), a);
    return;
  }
  const __m256i b = _mm256_permute4x64_epi64(
      _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)), split), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute2x128_si256(a, b, 0x20));       // evens
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), _mm256_permute2x128_si256(a, b, 0x31));  // odds
}

}  // namespace

void quantize_rows(const float* x, int64_t M, int64_t K, bool even_odd, QuantizedRows& out) {
  const int64_t nb = K / BLOCK;
  out.M = M, out.K = K;
  out.q.resize(M * K), out.d.resize(M * nb), out.sums.resize(M * nb);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* row = out.q.data() + m * K;
    for (int64_t b = 0; b < nb; ++b)
      out.d[m * nb + b] = quantize_block(x + m * K + b * BLOCK, row + b * BLOCK, out.sums[m * nb + b]);
    // int4 order: each span of 64 columns (two blocks; the last block alone when nb is odd) holds its even
    // columns, then its odd ones: the order of the low, then the high nibbles of the span's 32 code bytes
    if (even_odd)
      for (int64_t c = 0; c < K; c += 2 * BLOCK) even_odd_split(row + c, std::min<int64_t>(2 * BLOCK, K - c));
  }
}

namespace {

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

// What every column of one matrix reads: its codes, scales, zeros, x's codes, block scales and block sums (the int4
// zero term).
struct Pass {
  const QuantizedMatrix& w;  // (the caller's, alive for the pass)
  const int8_t* xq;
  const float* xd;
  // int4, per row of x and pair of blocks b, b + 1 (b even): [d_b x 4, d_b+1 x 4, sum_b / 4 x 4, sum_b+1 / 4 x 4],
  // (M, nb / 2, 16): x's block scales and sums laid out as the lanes of a pair's products want them
  const float* xs;
  const float* xsums;  // (M, nb): x's float sum over each block
  int64_t nb;
  int shift;  // log2 of the blocks per scale group (G > 1), so a block's group is b >> shift
};

// The scale group of block b: one per row (G == 1) or 2^shift blocks each.
inline int64_t group_of(const Pass& p, int64_t b) { return p.w.G == 1 ? 0 : b >> p.shift; }

// int8: block b of one output column for R rows of x, into accumulator set A (0 or 1: consecutive blocks alternate,
// so that two chains of FMAs hide each other's latency). All indices the compiler sees are constants, so the
// accumulators stay in registers.
template <int R, int A>
inline void block8(__m256 (&acc)[R][2], const uint8_t* wrow, float sw, const Pass& p, int64_t m0, int64_t b) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + b * BLOCK));
  const __m256i wu = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes; the sign moves onto x
  for (int r = 0; r < R; ++r) {
    const int64_t row = (m0 + r) * p.nb + b;
    const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq + row * BLOCK)), w);
    const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
    acc[r][A] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sw * p.xd[row]), acc[r][A]);
  }
}

// int4, the last block of a row with an odd number of blocks: its 16 code bytes alone.
template <int R>
inline void block4(__m256 (&acc)[R][2], const uint8_t* wrow, float sw, const Pass& p, int64_t m0, int64_t b) {
  const __m256i wu = unpack_int4(wrow + b * (BLOCK / 2));
  for (int r = 0; r < R; ++r) {
    const int64_t row = (m0 + r) * p.nb + b;
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq + row * BLOCK));
    const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
    acc[r][0] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sw * p.xd[row]), acc[r][0]);
  }
}

// int4, blocks b and b + 1 (b even) at once: their 32 code bytes split into low nibbles (the 32 even columns) and
// high ones (the odd columns), each multiplied with x's codes in the same order; two products of codes <= 15 and
// <= 127 in magnitude sum to at most 7620, so the two halves add in int16 before widening. The low 128 bits of the
// result belong to block b and the high ones to b + 1, scaled by [s_b d_b x 4, s_b+1 d_b+1 x 4]; the zero term
// zero_b sum_b + zero_b+1 sum_b+1 goes into the other accumulator set as [zero_b x 4, ...] times [sum_b / 4 x 4, ...].
// The weight's scales and zeros are spread once for all R rows; x's come spread (Pass::xs).
template <int R, int A>
inline void pair4(__m256 (&acc)[R][2], const uint8_t* wrow, const float* srow, const float* zrow, const Pass& p,
                  int64_t m0, int64_t b) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + b * (BLOCK / 2)));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(bytes, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 sw, zw;
  if (p.w.G != 1 && p.shift == 0) {  // a scale per block
    sw = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(srow + b)))), spread);
    zw = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(zrow + b)))), spread);
  } else {  // both blocks in one group
    sw = _mm256_set1_ps(srow[group_of(p, b)]);
    zw = _mm256_set1_ps(zrow[group_of(p, b)]);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = (m0 + r) * p.nb + b;
    const int8_t* xr = p.xq + row * BLOCK;
    const float* xs = p.xs + ((m0 + r) * (p.nb / 2) + b / 2) * 16;
    const __m256i even = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)));
    const __m256i odd = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32)));
    const __m256i dot = _mm256_madd_epi16(_mm256_add_epi16(even, odd), _mm256_set1_epi16(1));
    acc[r][A] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_loadu_ps(xs)), acc[r][A]);
    acc[r][1 - A] = _mm256_fmadd_ps(zw, _mm256_loadu_ps(xs + 8), acc[r][1 - A]);
  }
}

// int4, an odd last block b with its zero term (into accumulator set 1).
template <int R>
inline void odd_block4(__m256 (&acc)[R][2], const uint8_t* wrow, const float* srow, const float* zrow, const Pass& p,
                       int64_t m0, int64_t b) {
  block4<R>(acc, wrow, srow[group_of(p, b)], p, m0, b);
  for (int r = 0; r < R; ++r)
    acc[r][1] = _mm256_add_ps(
        acc[r][1], _mm256_setr_ps(zrow[group_of(p, b)] * p.xsums[(m0 + r) * p.nb + b], 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f));
}

// Output column n of the pass's matrix for R rows of x starting at m0, into Y (row stride ldy).
template <int R, bool INT4>
inline void column(const Pass& p, int64_t n, int64_t m0, float* Y, int64_t ldy) {
  const QuantizedMatrix& w = p.w;
  const uint8_t* wrow = w.codes + n * (INT4 ? w.K / 2 : w.K);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* srow = w.scales + n * w.G;
  int64_t b = 0;
  if constexpr (INT4) {
    const float* zrow = w.zeros + n * w.G;
    for (; b + 3 < p.nb; b += 4) {
      pair4<R, 0>(acc, wrow, srow, zrow, p, m0, b);
      pair4<R, 1>(acc, wrow, srow, zrow, p, m0, b + 2);
    }
    if (b + 1 < p.nb) pair4<R, 0>(acc, wrow, srow, zrow, p, m0, b), b += 2;
    if (b < p.nb) odd_block4<R>(acc, wrow, srow, zrow, p, m0, b);
  } else {
    for (; b + 1 < p.nb; b += 2) {
      block8<R, 0>(acc, wrow, srow[group_of(p, b)], p, m0, b);
      block8<R, 1>(acc, wrow, srow[group_of(p, b + 1)], p, m0, b + 1);
    }
    if (b < p.nb) block8<R, 0>(acc, wrow, srow[group_of(p, b)], p, m0, b);
  }
  for (int r = 0; r < R; ++r) Y[(m0 + r) * ldy + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

constexpr int ROWS = 4;  // rows of x computed together (registers: ROWS accumulators per output)
// Weight rows requested ahead of the ones being computed. Decoding reads each weight once, from memory, and a row's
// codes, scales and zeros are three short streams the hardware prefetcher does not run far enough ahead on: asking
// for the rows a few columns early made SmolLM2's int4 blocks ~1.4x faster at batch 1 (its 30 down projections
// 1.1 -> 0.58 ms a step, all blocks 4.1 -> 3.1 ms) and its int8 head ~25% (1.2-1.3 -> 0.9-1.0 ms).
constexpr int64_t PREFETCH_ROWS = 4;

// always_inline: GCC 12 judged a function made only of prefetches free of effects and deleted its int4 calls (the
// built extension held no int4 prefetch at all; SmolLM2's down projections then read at ~19 GB/s instead of ~33).
template <bool INT4>
__attribute__((always_inline)) inline void prefetch_row(const QuantizedMatrix& w, int64_t n) {
  const int64_t bytes = INT4 ? w.K / 2 : w.K;
  const char* codes = reinterpret_cast<const char*>(w.codes + n * bytes);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(codes + o, _MM_HINT_T0);
  for (int64_t o = 0; o < w.G; o += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w.scales + n * w.G + o), _MM_HINT_T0);
    if (INT4) _mm_prefetch(reinterpret_cast<const char*>(w.zeros + n * w.G + o), _MM_HINT_T0);
  }
}

// Columns [n0, n1) of the pass's matrix for every row of x.
// Batch-1 int4: output columns n and n + 1 of one row of x together, interleaved so that x's codes and scales are
// loaded once for both and the two columns' FMA chains overlap. Each column gets exactly column<1, true>'s
// arithmetic, in the same order, so a row's result does not depend on how many rows are computed with it (decoding
// alone, in a serving batch, or verifying a speculative round's drafts give the same bits).
inline void two_columns4(const Pass& p, int64_t n, float* Y) {
  const QuantizedMatrix& w = p.w;
  const uint8_t* wr[2] = {w.codes + n * (w.K / 2), w.codes + (n + 1) * (w.K / 2)};
  const float* sr[2] = {w.scales + n * w.G, w.scales + (n + 1) * w.G};
  const float* zr[2] = {w.zeros + n * w.G, w.zeros + (n + 1) * w.G};
  __m256 acc[2][1][2];
  for (auto& a : acc) a[0][0] = a[0][1] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 3 < p.nb; b += 4) {
    for (int c = 0; c < 2; ++c) pair4<1, 0>(acc[c], wr[c], sr[c], zr[c], p, 0, b);
    for (int c = 0; c < 2; ++c) pair4<1, 1>(acc[c], wr[c], sr[c], zr[c], p, 0, b + 2);
  }
  if (b + 1 < p.nb) {
    for (int c = 0; c < 2; ++c) pair4<1, 0>(acc[c], wr[c], sr[c], zr[c], p, 0, b);
    b += 2;
  }
  for (int c = 0; c < 2; ++c) {
    if (b < p.nb) odd_block4<1>(acc[c], wr[c], sr[c], zr[c], p, 0, b);
    Y[n + c] = hsum(_mm256_add_ps(acc[c][0][0], acc[c][0][1]));
  }
}

template <bool INT4>
void columns(const Pass& p, int64_t M, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  if (INT4 && M == 1) {
    for (; n0 + 1 < n1; n0 += 2) {
      if (n0 + PREFETCH_ROWS + 1 < n1) {
        prefetch_row<INT4>(p.w, n0 + PREFETCH_ROWS);
        prefetch_row<INT4>(p.w, n0 + PREFETCH_ROWS + 1);
      }
      two_columns4(p, n0, Y);
    }
  }
  for (int64_t n = n0; n < n1; ++n) {  // the weight row stays in L1 while every tile of x rows passes
    if (M <= 2 && n + PREFETCH_ROWS < n1) prefetch_row<INT4>(p.w, n + PREFETCH_ROWS);  // more rows: compute-bound
    int64_t m0 = 0;
    for (; m0 + ROWS <= M; m0 += ROWS) column<ROWS, INT4>(p, n, m0, Y, ldy);
    switch (M - m0) {
      case 3: column<3, INT4>(p, n, m0, Y, ldy); break;
      case 2: column<2, INT4>(p, n, m0, Y, ldy); break;
      case 1: column<1, INT4>(p, n, m0, Y, ldy); break;
      default: break;
    }
  }
}

void check_matrix(const torch::Tensor& qweight, const torch::Tensor& scales, int64_t K, c10::ScalarType type) {
  check_cpu(qweight, "qweight");
  check_cpu(scales, "scales");
  LLMKIT_CHECK(qweight.scalar_type() == type && qweight.is_contiguous() && qweight.dim() == 2, "bad qweight");
  LLMKIT_CHECK(K % BLOCK == 0, "the input width must be a multiple of 32");
  LLMKIT_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == qweight.size(0),
              "bad scales");
  const int64_t per_group = K / BLOCK / scales.size(1);
  LLMKIT_CHECK(K % (BLOCK * scales.size(1)) == 0 && (scales.size(1) == 1 || (per_group & (per_group - 1)) == 0),
              "the group size must be 32 times a power of two, or the whole row");
}

}  // namespace

QuantizedMatrix int4_matrix(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& zeros) {
  const int64_t K = qweight.size(1) * 2;
  check_matrix(qweight, scales, K, torch::kUInt8);
  llmkit::check_cpu(zeros, "zeros");
  LLMKIT_CHECK(zeros.sizes() == scales.sizes() && zeros.is_contiguous() && zeros.scalar_type() == torch::kFloat32,
              "zeros must match scales");
  return {qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), qweight.size(0), K,
          scales.size(1), true};
}

QuantizedMatrix int8_matrix(const torch::Tensor& qweight, const torch::Tensor& scales) {
  const int64_t K = qweight.size(1);
  check_matrix(qweight, scales, K, torch::kInt8);
  return {reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()), scales.data_ptr<float>(), nullptr,
          qweight.size(0), K, scales.size(1), false};
}

void Product::prepare(const float* x, int64_t M, int64_t K, const std::vector<QuantizedMatrix>& ws) {
  LLMKIT_CHECK(!ws.empty(), "a product needs a matrix");
  const bool int4 = ws[0].int4;
  use_vnni_ = vnni_selected();
  quantize_rows(x, M, K, int4 && !use_vnni_, x_);
  if (use_vnni_) vnni_prepare(x_, int4, vnni_);
  const int64_t nb = K / BLOCK;
  ws_ = ws;
  starts_.assign(1, 0);
  for (const QuantizedMatrix& w : ws) {
    LLMKIT_CHECK(w.K == K && w.int4 == int4, "matrices in one product share K and kind");
    starts_.push_back(starts_.back() + w.N);
  }
  if (int4 && !use_vnni_) {  // Pass::xs
    const int64_t pairs = nb / 2;
    spread_.resize(M * pairs * 16);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t q = 0; q < pairs; ++q) {
        float* o = spread_.data() + (m * pairs + q) * 16;
        for (int i = 0; i < 4; ++i) {
          o[i] = x_.d[m * nb + 2 * q], o[4 + i] = x_.d[m * nb + 2 * q + 1];
          o[8 + i] = x_.sums[m * nb + 2 * q] / 4, o[12 + i] = x_.sums[m * nb + 2 * q + 1] / 4;
        }
      }
  }
}

void Product::columns(int64_t j0, int64_t j1, float* y, int64_t ldy) const {
  const int64_t nb = x_.K / BLOCK;
  for (size_t i = 0; i < ws_.size(); ++i) {  // the part of [j0, j1) that falls in matrix i
    const int64_t a = std::max(j0, starts_[i]) - starts_[i], e = std::min(j1, starts_[i + 1]) - starts_[i];
    if (a >= e) continue;
    if (use_vnni_) {
      vnni_columns(ws_[i], vnni_, a, e, y + starts_[i], ldy);
      continue;
    }
    const Pass p{ws_[i], x_.q.data(), x_.d.data(), spread_.data(), x_.sums.data(), nb, __builtin_ctzll(nb / ws_[i].G)};
    if (p.w.int4)
      llmkit::columns<true>(p, x_.M, a, e, y + starts_[i], ldy);
    else
      llmkit::columns<false>(p, x_.M, a, e, y + starts_[i], ldy);
  }
}

namespace {

// Output column n of an fp32 W for R rows of x starting at m0; 16 inputs a step in two chains of FMAs. `ahead`
// (or null): the weight row PREFETCH_ROWS further on, requested a cache line per step, as the integer kernels do.
template <int R>
inline void float_column(const float* x, const float* wrow, const float* ahead, int64_t K, int64_t m0, float* Y,
                         int64_t ldy, int64_t n) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(wrow + k), w1 = _mm256_loadu_ps(wrow + k + 8);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * K + k;
      acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    for (int64_t kk = k; kk < K; ++kk) out += wrow[kk] * x[(m0 + r) * K + kk];
    Y[(m0 + r) * ldy + n] = out;
  }
}

}  // namespace

void dequantize_rows(const QuantizedMatrix& w, int64_t n0, int64_t n1, float* out) {
  const int64_t nb = w.K / BLOCK, per_group = nb / w.G;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    float* row = out + (n - n0) * w.K;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 s = _mm256_set1_ps(w.scales[n * w.G + b / per_group]);
      float* dst = row + b * BLOCK;
      if (w.int4) {  // 16 bytes: columns 2i (low nibble) and 2i + 1 (high nibble) of the block
        const __m256 z = _mm256_set1_ps(w.zeros[n * w.G + b / per_group]);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codes + n * (w.K / 2) + b * 16));
        const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        const __m128i halves[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  // columns in order
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 2; ++e) {
            const __m128i eight = e ? _mm_srli_si128(halves[h], 8) : halves[h];
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
            _mm256_storeu_ps(dst + h * 16 + e * 8, _mm256_fmadd_ps(q, s, z));
          }
      } else {
        const int8_t* codes = reinterpret_cast<const int8_t*>(w.codes) + n * w.K + b * BLOCK;
        for (int e = 0; e < 4; ++e) {
          const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + e * 8));
          _mm256_storeu_ps(dst + e * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), s));
        }
      }
    }
  }
}

// 16 floats -> 16 bf16
inline void bf16_16(const float* src, uint16_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_round(_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8)));
}

namespace {

// The same with AVX512-BF16 (a CPU that has it, checked at run time): a block of 32 weights at a time, widened to
// fp32 in two registers and rounded to bf16 by one instruction (vcvtne2ps2bf16, nearest even).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void dequantize_rows_bf16_avx512(
    const QuantizedMatrix& w, int64_t n0, int64_t n1, uint16_t* out) {
  const int64_t nb = w.K / BLOCK, per_group = nb / w.G;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    uint16_t* row = out + (n - n0) * w.K;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = n * w.G + b / per_group;
      const __m512 s = _mm512_set1_ps(w.scales[g]);
      __m512 lo, hi;  // columns 0-15 and 16-31 of the block
      if (w.int4) {
        const __m512 z = _mm512_set1_ps(w.zeros[g]);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codes + n * (w.K / 2) + b * 16));
        const __m128i l = _mm_and_si128(bytes, mask), h = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(l, h))), s, z);
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(l, h))), s, z);
      } else {
        const int8_t* codes = reinterpret_cast<const int8_t*>(w.codes) + n * w.K + b * BLOCK;
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)))), s);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)))), s);
      }
      _mm512_storeu_si512(row + b * BLOCK, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

}  // namespace

void dequantize_rows_bf16(const QuantizedMatrix& w, int64_t n0, int64_t n1, uint16_t* out) {
  static const bool avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  if (avx512_bf16) return dequantize_rows_bf16_avx512(w, n0, n1, out);
  std::vector<float> row(w.K);  // elsewhere (bf16 asked for on a CPU that emulates it): fp32, then rounded
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_rows(w, n, n + 1, row.data());
    for (int64_t k = 0; k < w.K; k += 16) bf16_16(row.data() + k, out + (n - n0) * w.K + k);
  }
}

void float_columns(const float* x, int64_t M, const float* w, int64_t K, int64_t n0, int64_t n1, float* y,
                   int64_t ldy) {
  // up to FLOAT_ROWS rows of x a pass (2 accumulators each, 12 of the 16 registers at 6), so that a verifying step's
  // k + 1 <= 6 tokens read each weight row once
  constexpr int64_t FLOAT_ROWS = 6;
  for (int64_t n = n0; n < n1; ++n) {
    const float* wrow = w + n * K;
    const float* ahead = n + PREFETCH_ROWS < n1 ? wrow + PREFETCH_ROWS * K : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += FLOAT_ROWS) {
      const float* pf = m0 == 0 ? ahead : nullptr;
      switch (std::min<int64_t>(M - m0, FLOAT_ROWS)) {
        case 6: float_column<6>(x, wrow, pf, K, m0, y, ldy, n); break;
        case 5: float_column<5>(x, wrow, pf, K, m0, y, ldy, n); break;
        case 4: float_column<4>(x, wrow, pf, K, m0, y, ldy, n); break;
        case 3: float_column<3>(x, wrow, pf, K, m0, y, ldy, n); break;
        case 2: float_column<2>(x, wrow, pf, K, m0, y, ldy, n); break;
        default: float_column<1>(x, wrow, pf, K, m0, y, ldy, n); break;
      }
    }
  }
}

}  // namespace llmkit

namespace {

// From this many rows of x on, a product dequantizes W to fp32 a panel of rows at a time and hands it to torch's
// matrix product (MKL here), which runs near the CPU's peak: the integer kernel's per-block unpacking and scaling
// cost more than the dequantization once enough rows share it (measured on a Zen 3 core: about equal at 64-96 rows,
// 1.3-1.5x faster at 512).
constexpr int64_t PANEL = int64_t{1} << 22;  // weights per dequantized panel (16 MB of fp32)

torch::Tensor dequantized_product(const torch::Tensor& x, const llmkit::QuantizedMatrix& w, bool bf16) {
  const int64_t rows = std::max<int64_t>(16, PANEL / w.K);
  const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  auto panel = torch::empty({std::min(rows, w.N), w.K}, x.options().dtype(dtype));
  const auto xs = bf16 ? x.to(torch::kBFloat16) : x;
  torch::Tensor y;  // (M, N) fp32, when W takes several panels
  for (int64_t n0 = 0; n0 < w.N; n0 += rows) {
    const int64_t n1 = std::min(w.N, n0 + rows);
    at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t e) {
      if (bf16)
        llmkit::dequantize_rows_bf16(w, a, e, reinterpret_cast<uint16_t*>(panel.data_ptr<at::BFloat16>()) + (a - n0) * w.K);
      else
        llmkit::dequantize_rows(w, a, e, panel.data_ptr<float>() + (a - n0) * w.K);
    });
    const auto part = at::mm(xs, panel.narrow(0, 0, n1 - n0).t());
    if (n0 == 0 && n1 == w.N) return bf16 ? part.to(torch::kFloat32) : part;  // (bf16 widens exactly)
    if (!y.defined()) y = torch::empty({x.size(0), w.N}, x.options());
    y.narrow(1, n0, n1 - n0).copy_(part);
  }
  return y;
}

// From `many_rows` rows of x on, W is dequantized (in bf16 where `bf16`) and multiplied by torch's product.
torch::Tensor run(const torch::Tensor& x, const llmkit::QuantizedMatrix& w, int64_t many_rows, bool bf16) {
  llmkit::check_cpu(x, "x");
  LLMKIT_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be (M, K) fp32");
  LLMKIT_CHECK(x.size(1) == w.K, "x has ", x.size(1), " columns, the weights ", w.K);
  if (x.size(0) >= many_rows) return dequantized_product(x, w, bf16);
  llmkit::Product product;
  product.prepare(x.data_ptr<float>(), x.size(0), w.K, {w});
  auto y = torch::empty({x.size(0), w.N}, x.options());
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) { product.columns(n0, n1, Y, w.N); });
  return y;
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                          int64_t many_rows, bool bf16) {
  return run(x, llmkit::int4_matrix(qweight, scales, zeros), many_rows, bf16);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t many_rows,
                          bool bf16) {
  return run(x, llmkit::int8_matrix(qweight, scales), many_rows, bf16);
}

// x (M, K) @ W^T (+ b) for fp32 W (N, K) and a few rows of x: every weight read once for all rows, the columns
// split over torch's threads. For a decoding step's output head: MKL's sgemm takes about twice as long for two rows
// as for one here (and 15 ms for SmolLM2's 49,152 x 576 head at one row, a third of the bandwidth), where a step
// verifying speculative drafts needs the head for each of its few tokens.
torch::Tensor float_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  llmkit::check_cpu(x, "x");
  llmkit::check_cpu(w, "w");
  if (bias) llmkit::check_cpu(*bias, "bias");
  LLMKIT_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be (M, K) fp32");
  LLMKIT_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be (N, K) fp32, contiguous, with x's K columns");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (bias) LLMKIT_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat32 &&
                            bias->is_contiguous(), "the bias must be (N,) fp32");
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { llmkit::float_columns(X, M, W, K, n0, n1, Y, N); });
  if (bias) y.add_(*bias);
  return y;
}

}  // namespace

void bind_decode(pybind11::module& m);  // cpu_decode.cpp
namespace llmkit {
void bind_attention(pybind11::module& m);  // cpu_attention.cpp
void bind_blocks(pybind11::module& m);     // cpu_blocks.cpp
void bind_kquants(pybind11::module& m);    // cpu_kquants.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("zeros"), pybind11::arg("many_rows") = 96, pybind11::arg("bf16") = false,
        "x (M, K) fp32 @ int4 W^T -> (M, N)");
  m.def("int8_linear", &int8_linear, pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("many_rows") = 96, pybind11::arg("bf16") = false, "x (M, K) fp32 @ int8 W^T -> (M, N)");
  m.def("float_linear", &float_linear, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none(),
        "x (M, K) fp32 @ fp32 W^T (+ bias) -> (M, N), for a few rows");
  m.def("cpu_has_avx512_vnni", &llmkit::cpu_has_avx512_vnni, "whether the CPU has AVX512-VNNI (and F, BW, VL, DQ)");
  m.def("vnni_selected", &llmkit::vnni_selected, "whether integer products run on the AVX512-VNNI kernel");
  m.def("select_vnni", &llmkit::select_vnni, pybind11::arg("on"),
        "use the AVX512-VNNI kernel for integer products where the CPU has it (default), or the AVX2 one");
  bind_decode(m);
  llmkit::bind_attention(m);
  llmkit::bind_blocks(m);
  llmkit::bind_kquants(m);
}
