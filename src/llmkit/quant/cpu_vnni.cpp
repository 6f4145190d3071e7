// Quantized matrix products on AVX512-VNNI (vpdpbusd), for CPUs that have it (checked at run time; the functions
// carry their own target attribute, so the extension still builds for, and runs on, plain AVX2).
//
// The arithmetic is cpu_kernel.cpp's: x rounded to int8 per block of 32 (the same codes), every block's dot product
// with the weight codes exact in integers, then scaled: y = sum over blocks of float(dot) * (s_w * d_x), plus, for
// int4, zero_w * sum(x) from x's float sums. What differs is the layout of the work. The AVX2 kernel takes one
// output column at a time and sums along its row of codes, so each 8 products of a block end in their own lane and
// every block costs each row a conversion and two multiply-adds per 8 integer products. Here a tile of 16 output
// columns is computed at once, one column per lane: a block's codes for the 16 columns are transposed in registers
// (4 bytes of each column per 32-bit lane), and each row of x multiplies them by broadcasting 4 of its codes at a
// time; a lane then holds its column's whole block dot (8 vpdpbusd, 64 products each), scaled once. Per row and
// block of 16 columns: 8 integer instructions and 3-4 float ones; the transposition is shared by up to 8 rows (a
// tile of more keeps the transposed codes for its later passes). The tile's scales (and zeros) are transposed once
// to one vector per group. One row of x alone (decoding one sequence) sums 4 blocks along each column's codes
// instead and transposes the sums (dots4): the same integers, with fewer shuffles.
//
// A column's result is a sequence of operations on its lane alone, in block order, so it has the same bits
// whichever rows, columns or threads it is computed with (batch invariance, tests/quant/test_batch_invariance.py).
// It differs from the AVX2 kernel's in the last bits (another order of the float sums); a process uses one of them
// (set_integer_kernel).
//
// vpdpbusd multiplies unsigned bytes by signed ones. int4 codes (0..15) are unsigned already; int8 codes w are
// flipped to w + 128 and the block's 128 * sum(x codes) taken off the integer dot afterwards (exact).

#include "cpu_kernel.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <vector>

#define LLMKIT_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
// (the helpers of the inner loop must be inlined: called, they return their registers through memory)
#define LLMKIT_VNNI_INLINE LLMKIT_VNNI_TARGET __attribute__((always_inline)) inline

namespace llmkit {

namespace {

std::atomic<bool> use_vnni{true};  // set_integer_kernel; only read where the CPU has VNNI

constexpr int TILE = VNNI_TILE;  // output columns per tile: one per 32-bit lane of a zmm
constexpr int PASS = 8;   // rows of x per pass over a tile (2 accumulators each, beside the 8 code registers)

// Four columns' 16 code bytes of one block (or half block, int8) in the four 128-bit lanes of a zmm.
LLMKIT_VNNI_INLINE __m512i load4(const uint8_t* const* col, int64_t offset) {
  const auto lane = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(col[i] + offset)); };
  __m512i a = _mm512_castsi128_si512(lane(0));
  a = _mm512_inserti32x4(a, lane(1), 1);
  a = _mm512_inserti32x4(a, lane(2), 2);
  return _mm512_inserti32x4(a, lane(3), 3);
}

// 16 bytes of each of 16 columns -> t[j]: bytes 4j..4j+3 of every column, column c in 32-bit lane c.
LLMKIT_VNNI_INLINE void transpose16(const uint8_t* const* col, int64_t offset, __m512i (&t)[4]) {
  const __m512i a0 = load4(col, offset), a1 = load4(col + 4, offset), a2 = load4(col + 8, offset),
                a3 = load4(col + 12, offset);
  // pairs of loads -> [words j of columns 0-3 | of 4-7 | words j + 1 of 0-3 | of 4-7] for j = 0 and j = 2
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i second = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  const __m512i p01 = _mm512_permutex2var_epi32(a0, first, a1), q01 = _mm512_permutex2var_epi32(a0, second, a1);
  const __m512i p23 = _mm512_permutex2var_epi32(a2, first, a3), q23 = _mm512_permutex2var_epi32(a2, second, a3);
  t[0] = _mm512_shuffle_i64x2(p01, p23, _MM_SHUFFLE(1, 0, 1, 0));
  t[1] = _mm512_shuffle_i64x2(p01, p23, _MM_SHUFFLE(3, 2, 3, 2));
  t[2] = _mm512_shuffle_i64x2(q01, q23, _MM_SHUFFLE(1, 0, 1, 0));
  t[3] = _mm512_shuffle_i64x2(q01, q23, _MM_SHUFFLE(3, 2, 3, 2));
}

// Block b's codes of the tile's 16 columns as 8 registers of unsigned bytes, w[s] holding 4 inputs of every column:
// int4, w[2j] the low nibbles of bytes 4j..4j+3 (inputs 8j, 8j+2, 8j+4, 8j+6) and w[2j+1] their high nibbles (8j+1,
// ...); int8, w[s] inputs 4s..4s+3, plus 128.
template <bool INT4>
LLMKIT_VNNI_INLINE void block_codes(const uint8_t* const* col, int64_t b, __m512i (&w)[8]) {
  __m512i t[4];
  if constexpr (INT4) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    transpose16(col, b * (BLOCK / 2), t);
    for (int j = 0; j < 4; ++j) {
      w[2 * j] = _mm512_and_si512(t[j], mask);
      w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(t[j], 4), mask);
    }
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int h = 0; h < 2; ++h) {
      transpose16(col, b * BLOCK + 16 * h, t);
      for (int j = 0; j < 4; ++j) w[4 * h + j] = _mm512_xor_si512(t[j], flip);
    }
  }
}

// 16 int64 values -> 16 int32 lanes
LLMKIT_VNNI_INLINE __m512i int32_lanes(const int64_t* v) {
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_loadu_si512(v));
  const __m256i hi = _mm512_cvtepi64_epi32(_mm512_loadu_si512(v + 8));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 16 columns' rows of G values (scales or zeros; row c at base + offset[c]) -> out (G, 16): group g's values for
// the 16 columns in one vector. 16 at a time by a transposition in registers (a gather per group and tile cost
// more than the rest of the block at one row of x).
LLMKIT_VNNI_TARGET void transpose_groups(const float* base, const int64_t* offset, int64_t G, float* out) {
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int64_t count = std::min<int64_t>(16, G - g0);
    if (count < 8) {  // a few groups left (18 = 16 + 2 per row of 576 inputs): gathered one by one
      const __m512i index = int32_lanes(offset);
      for (int64_t e = 0; e < count; ++e)
        _mm512_storeu_ps(out + (g0 + e) * 16, _mm512_i32gather_ps(index, base + g0 + e, 4));
      continue;
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    __m512 r[16], t[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_maskz_loadu_ps(valid, base + offset[c] + g0);
    for (int c = 0; c < 16; c += 2) {  // pairs of rows interleaved by element
      t[c] = _mm512_unpacklo_ps(r[c], r[c + 1]);
      t[c + 1] = _mm512_unpackhi_ps(r[c], r[c + 1]);
    }
    for (int c = 0; c < 16; c += 4)  // then by pairs of elements
      for (int h = 0; h < 2; ++h) {
        r[c + h] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[c + h]), _mm512_castps_pd(t[c + 2 + h])));
        r[c + 2 + h] =
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[c + h]), _mm512_castps_pd(t[c + 2 + h])));
      }
    // r[4q + j] holds, in 128-bit lane l, element 4l + (0, 2, 1, 3)[j] of rows 4q .. 4q + 3
    __m512 out16[16];
    constexpr int place[4] = {0, 2, 1, 3};
    for (int j = 0; j < 4; ++j) {
      __m512 even[2], odd[2];  // rows 8p .. 8p + 7: their lanes 0 and 2, then 1 and 3
      for (int p = 0; p < 2; ++p) {
        even[p] = _mm512_shuffle_f32x4(r[8 * p + j], r[8 * p + 4 + j], _MM_SHUFFLE(2, 0, 2, 0));
        odd[p] = _mm512_shuffle_f32x4(r[8 * p + j], r[8 * p + 4 + j], _MM_SHUFFLE(3, 1, 3, 1));
      }
      out16[place[j]] = _mm512_shuffle_f32x4(even[0], even[1], _MM_SHUFFLE(2, 0, 2, 0));
      out16[8 + place[j]] = _mm512_shuffle_f32x4(even[0], even[1], _MM_SHUFFLE(3, 1, 3, 1));
      out16[4 + place[j]] = _mm512_shuffle_f32x4(odd[0], odd[1], _MM_SHUFFLE(2, 0, 2, 0));
      out16[12 + place[j]] = _mm512_shuffle_f32x4(odd[0], odd[1], _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int e = 0; e < count; ++e) _mm512_storeu_ps(out + (g0 + e) * 16, out16[e]);
  }
}

// acc + the dot products of w's 16 lanes of 4 unsigned bytes with the 4 signed bytes at p: vpdpbusd with its
// operand broadcast from memory (GCC does not fold _mm512_set1_epi32 into it, and the separate broadcasts were a
// third of the kernel's instructions).
LLMKIT_VNNI_INLINE __m512i dot4(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Rows m0 .. m0 + R - 1 of x times the tile's columns (col: each column's codes; scales and zeros: (G, 16), see
// transpose_groups), into Y (row stride ldy) where the mask says the tile has a column.
// `ahead` (or null): the next tile's first column, whose codes (16 rows, one run of memory) are requested a few cache
// lines a block, in order: a tile reads 16 rows of codes at once, more streams than the hardware prefetcher follows
// (without it one row of x ran at half the speed; a line per column every 64 bytes, or two tiles ahead: ~10% slower).
// The transposed codes come from the columns (col) or, on later passes over a tile of more than PASS rows, from
// `kept` (nb, 8, 64 bytes), where the first pass leaves them.
enum Codes { TRANSPOSE = 0, TRANSPOSE_AND_KEEP = 1, KEPT = 2 };

template <int R, bool INT4, int SOURCE>
LLMKIT_VNNI_TARGET void tile(const QuantizedMatrix& w, const VnniRows& x, const uint8_t* const* col,
                             const float* scales, const float* zeros, int64_t m0, __mmask16 mask, float* Y,
                             int64_t ldy, const uint8_t* ahead, __m512i* kept) {
  const int64_t nb = w.K / BLOCK, per_group = nb / w.G;
  constexpr int64_t BYTES = INT4 ? BLOCK / 2 : BLOCK;  // of a column's codes per block
  __m512 acc[R];  // (one per row: a second one for the zero terms spilled GCC's registers to the stack)
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 sw = _mm512_setzero_ps(), zw = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (b % per_group == 0) {  // the tile's scales (and zeros) of this group
      const int64_t g = b / per_group;
      sw = _mm512_loadu_ps(scales + g * TILE);
      if constexpr (INT4) zw = _mm512_loadu_ps(zeros + g * TILE);
    }
    if (ahead != nullptr)  // the next tile's 16 * BYTES bytes of this block's share, a line at a time
      for (int l = 0; l < BYTES / 4; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (b * BYTES / 4 + l) * 64), _MM_HINT_T0);
    __m512i codes[8];
    if constexpr (SOURCE == KEPT) {
      for (int i = 0; i < 8; ++i) codes[i] = _mm512_loadu_si512(kept + b * 8 + i);
    } else {
      block_codes<INT4>(col, b, codes);
      if constexpr (SOURCE == TRANSPOSE_AND_KEEP)
        for (int i = 0; i < 8; ++i) _mm512_storeu_si512(kept + b * 8 + i, codes[i]);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = b * x.M + m0 + r;
      const int8_t* xq = x.q.data() + row * BLOCK;
      // two chains of 4 (their latency hides behind each other's); integer sums, so exact in any order
      __m512i d0 = dot4(_mm512_setzero_si512(), codes[0], xq), d1 = dot4(_mm512_setzero_si512(), codes[1], xq + 4);
      for (int s = 2; s < 8; s += 2) d0 = dot4(d0, codes[s], xq + 4 * s), d1 = dot4(d1, codes[s + 1], xq + 4 * s + 4);
      __m512i dot = _mm512_add_epi32(d0, d1);
      if constexpr (!INT4) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(x.flip[row]));
      if constexpr (INT4) acc[r] = _mm512_fmadd_ps(zw, _mm512_set1_ps(x.sums[row]), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_set1_ps(x.d[row])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(Y + (m0 + r) * ldy, mask, acc[r]);
}

// One row of x against int4 codes (decoding one sequence). A transposition of codes serves only this row, so the
// dots of 4 blocks are instead computed along each column's codes (one 64-byte load a column; vpdpbusd leaves each
// block's dot in 4 lanes), then summed in pairs of lanes and transposed: D[j] holds block b + j's dots, column c in
// lane c. The same integers as tile<1>'s, so the same result bits, with a third of its shuffles.
// 4 blocks of one column's int4 codes (64 bytes) times x's codes in dots4's order: 4 partial dots of each block.
LLMKIT_VNNI_INLINE __m512i column_dots(const uint8_t* codes, __m512i xlo, __m512i xhi) {
  const __m512i mask = _mm512_set1_epi8(0x0F), bytes = _mm512_loadu_si512(codes);
  const __m512i lo = _mm512_and_si512(bytes, mask), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
}

LLMKIT_VNNI_INLINE void dots4(const uint8_t* const* col, int64_t b, const int8_t* xq, __m512i (&D)[4]) {
  // x's codes of blocks b .. b + 3 in the order the nibbles come: per block, the low nibbles' inputs (each 8
  // inputs' even ones, the first 4 bytes of each 8 in VnniRows), then the high nibbles'
  const __m512i v0 = _mm512_loadu_si512(xq + b * BLOCK), v1 = _mm512_loadu_si512(xq + b * BLOCK + 64);
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i xlo = _mm512_permutex2var_epi32(v0, evens, v1), xhi = _mm512_permutex2var_epi32(v0, odds, v1);
  __m512i S[4];  // S[g], 128-bit lane j: block j's dots of columns 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    __m512i Q[2];  // per 128-bit lane: two columns' sums of partials 0 + 2, then of 1 + 3
    for (int h = 0; h < 2; ++h) {
      const __m512i a = column_dots(col[4 * g + 2 * h] + b * (BLOCK / 2), xlo, xhi);
      const __m512i e = column_dots(col[4 * g + 2 * h + 1] + b * (BLOCK / 2), xlo, xhi);
      Q[h] = _mm512_add_epi32(_mm512_unpacklo_epi32(a, e), _mm512_unpackhi_epi32(a, e));
    }
    S[g] = _mm512_add_epi32(_mm512_unpacklo_epi64(Q[0], Q[1]), _mm512_unpackhi_epi64(Q[0], Q[1]));
  }
  const __m512i s01a = _mm512_shuffle_i64x2(S[0], S[1], _MM_SHUFFLE(1, 0, 1, 0));  // S0 lanes 0 1, S1 lanes 0 1
  const __m512i s01b = _mm512_shuffle_i64x2(S[0], S[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i s23a = _mm512_shuffle_i64x2(S[2], S[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i s23b = _mm512_shuffle_i64x2(S[2], S[3], _MM_SHUFFLE(3, 2, 3, 2));
  D[0] = _mm512_shuffle_i64x2(s01a, s23a, _MM_SHUFFLE(2, 0, 2, 0));
  D[1] = _mm512_shuffle_i64x2(s01a, s23a, _MM_SHUFFLE(3, 1, 3, 1));
  D[2] = _mm512_shuffle_i64x2(s01b, s23b, _MM_SHUFFLE(2, 0, 2, 0));
  D[3] = _mm512_shuffle_i64x2(s01b, s23b, _MM_SHUFFLE(3, 1, 3, 1));
}

// acc + block b's term of one row of x (int4): tile<1>'s two multiply-adds
LLMKIT_VNNI_INLINE __m512 add_block(__m512 acc, __m512i dot, int64_t b, int64_t per_group, const VnniRows& x,
                                    const float* scales, const float* zeros) {
  const int64_t g = b / per_group;
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(zeros + g * TILE), _mm512_set1_ps(x.sums[b]), acc);
  const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(scales + g * TILE), _mm512_set1_ps(x.d[b]));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}

// tile<1, true, TRANSPOSE>'s result by dots4 (the blocks after the last 4 as there).
LLMKIT_VNNI_TARGET void one_row4(const QuantizedMatrix& w, const VnniRows& x, const uint8_t* const* col,
                                 const float* scales, const float* zeros, __mmask16 mask, float* Y,
                                 const uint8_t* ahead) {
  const int64_t nb = w.K / BLOCK, per_group = nb / w.G;
  __m512 acc = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    if (ahead != nullptr)  // the next tile's codes of these 4 blocks' share
      for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + (b * 4 + l) * 64), _MM_HINT_T0);
    __m512i D[4];
    dots4(col, b, x.q.data(), D);
    for (int j = 0; j < 4; ++j) acc = add_block(acc, D[j], b + j, per_group, x, scales, zeros);
  }
  for (; b < nb; ++b) {
    __m512i codes[8];
    block_codes<true>(col, b, codes);
    const int8_t* xq = x.q.data() + b * BLOCK;
    __m512i d0 = dot4(_mm512_setzero_si512(), codes[0], xq), d1 = dot4(_mm512_setzero_si512(), codes[1], xq + 4);
    for (int s = 2; s < 8; s += 2) d0 = dot4(d0, codes[s], xq + 4 * s), d1 = dot4(d1, codes[s + 1], xq + 4 * s + 4);
    acc = add_block(acc, _mm512_add_epi32(d0, d1), b, per_group, x, scales, zeros);
  }
  _mm512_mask_storeu_ps(Y, mask, acc);
}

// tile<rows, INT4, SOURCE>(args...)
template <bool INT4, int SOURCE, typename... Args>
LLMKIT_VNNI_TARGET void pass(int rows, const Args&... args) {
  switch (rows) {
    case 1: return tile<1, INT4, SOURCE>(args...);
    case 2: return tile<2, INT4, SOURCE>(args...);
    case 3: return tile<3, INT4, SOURCE>(args...);
    case 4: return tile<4, INT4, SOURCE>(args...);
    case 5: return tile<5, INT4, SOURCE>(args...);
    case 6: return tile<6, INT4, SOURCE>(args...);
    case 7: return tile<7, INT4, SOURCE>(args...);
    default: return tile<8, INT4, SOURCE>(args...);
  }
}

template <bool INT4, typename... Args>
LLMKIT_VNNI_TARGET void pass(int source, int rows, const Args&... args) {
  switch (source) {
    case TRANSPOSE: return pass<INT4, TRANSPOSE>(rows, args...);
    case TRANSPOSE_AND_KEEP: return pass<INT4, TRANSPOSE_AND_KEEP>(rows, args...);
    default: return pass<INT4, KEPT>(rows, args...);
  }
}

template <bool INT4>
LLMKIT_VNNI_TARGET void tiles(const QuantizedMatrix& w, const VnniRows& x, int64_t n0, int64_t n1, float* Y,
                              int64_t ldy) {
  const int64_t stride = INT4 ? w.K / 2 : w.K;
  const uint8_t* col[TILE];
  int64_t first[TILE];  // each column's first scale
  thread_local std::vector<float> scales, zeros;  // the tile's, (G, 16)
  thread_local std::vector<int64_t> kept;         // its codes, transposed, for later passes (64 bytes a register)
  scales.resize(w.G * TILE), zeros.resize(INT4 ? w.G * TILE : 0);
  if (x.M > PASS) kept.resize(w.K / BLOCK * 8 * 8);
  __m512i* keep = reinterpret_cast<__m512i*>(kept.data());
  // tiles at multiples of 16 rows of the matrix (the first one may be partial), whose scales the matrix may hold
  // transposed already (QuantizedMatrix::tiled_scales)
  for (int64_t t0 = n0, t1; t0 < n1; t0 = t1) {
    t1 = std::min(n1, (t0 / TILE + 1) * TILE);
    const int cols = static_cast<int>(t1 - t0);
    const bool fetch = t1 < n1;  // a next tile exists
    for (int c = 0; c < TILE; ++c) {  // a partial tile repeats its last column in the missing lanes, never stored
      const int64_t n = t0 + std::min(c, cols - 1);
      col[c] = w.codes + n * stride, first[c] = n * w.G;
    }
    const float* tile_scales = scales.data();
    const float* tile_zeros = zeros.data();
    if (w.tiled_scales != nullptr && t0 % TILE == 0) {
      tile_scales = w.tiled_scales + t0 * w.G, tile_zeros = INT4 ? w.tiled_zeros + t0 * w.G : nullptr;
      for (int64_t o = 0; fetch && o < TILE * w.G; o += 16) {  // the next tile's, one run each
        _mm_prefetch(reinterpret_cast<const char*>(tile_scales + TILE * w.G + o), _MM_HINT_T0);
        if (INT4) _mm_prefetch(reinterpret_cast<const char*>(tile_zeros + TILE * w.G + o), _MM_HINT_T0);
      }
    } else {
      for (int64_t o = 0; fetch && o < TILE * w.G; o += 16) {  // the next tile's scales (and zeros): one run each
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + t1 * w.G + o), _MM_HINT_T0);
        if (INT4) _mm_prefetch(reinterpret_cast<const char*>(w.zeros + t1 * w.G + o), _MM_HINT_T0);
      }
      transpose_groups(w.scales, first, w.G, scales.data());
      if (INT4) transpose_groups(w.zeros, first, w.G, zeros.data());
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    float* y = Y + t0;
    for (int64_t m0 = 0; m0 < x.M; m0 += PASS) {
      const int rows = static_cast<int>(std::min<int64_t>(PASS, x.M - m0));
      const uint8_t* later = m0 == 0 && fetch ? w.codes + t1 * stride : nullptr;
      if (INT4 && x.M == 1) {
        one_row4(w, x, col, tile_scales, tile_zeros, mask, y, later);
      } else {
        const int source = x.M <= PASS ? TRANSPOSE : m0 == 0 ? TRANSPOSE_AND_KEEP : KEPT;
        pass<INT4>(source, rows, w, x, col, tile_scales, tile_zeros, m0, mask, y, ldy, later, keep);
      }
    }
  }
}

}  // namespace

bool cpu_has_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

bool vnni_selected() { return cpu_has_avx512_vnni() && use_vnni.load(std::memory_order_relaxed); }

void select_vnni(bool on) { use_vnni.store(on, std::memory_order_relaxed); }

void vnni_prepare(const QuantizedRows& q, bool int4, VnniRows& out) {
  const int64_t M = q.M, K = q.K, nb = K / BLOCK;
  out.M = M, out.K = K;
  out.q.resize(M * K), out.d.resize(M * nb), out.sums.resize(M * nb), out.flip.resize(int4 ? 0 : M * nb);
  // int4: within each 8 inputs, the even ones, then the odd ones (the order a code byte's nibbles unpack in)
  const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2, 4, 6, 1, 3, 5,
                                         7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t from = m * nb + b, to = b * M + m;
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.q.data() + from * BLOCK));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + to * BLOCK),
                          int4 ? _mm256_shuffle_epi8(codes, order) : codes);
      out.d[to] = q.d[from], out.sums[to] = q.sums[from];
      if (!int4) {  // 128 times the sum of the 32 codes: pairs, then quads, summed in int16 / int32
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), codes);
        const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
        out.flip[to] = 128 * _mm_cvtsi128_si32(sum);
      }
    }
}

void vnni_columns(const QuantizedMatrix& w, const VnniRows& x, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  if (w.int4)
    tiles<true>(w, x, n0, n1, Y, ldy);
  else
    tiles<false>(w, x, n0, n1, Y, ldy);
}

}  // namespace llmkit
