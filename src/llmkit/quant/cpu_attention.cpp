// Causal attention of a prompt's queries on the CPU's bf16 dot-product units (AVX512-BF16: Zen 4/5 EPYCs,
// Xeons from Cooper Lake on), for the prefill of llmkit's default (not batch-invariant) mode. llmkit/quant/native.py
// compiles this file with the others and calls it only where the CPU has AVX512-BF16; the functions below carry
// their own target attribute, so the rest of the extension still builds for plain AVX2.
//
//   out[t, h] = softmax_j(q[t, h] . k[j, h / G] * scale) v[j, h / G],   j <= offset + t
//
// q (H, T, D), k and v (K, S, D) (any strides but the last), H = G K. Query t sits at position offset + t and sees
// the keys 0 .. offset + t: a prompt's first chunk (offset 0) or a later chunk of it over the keys cached so far.
//
// The method is flash attention's (Dao et al. 2022): per group of queries, keys in blocks of 64, a running maximum
// and sum per query, so the T x S scores never exist at once. The products round q, k, v and the softmax weights
// to bf16 and sum in fp32 (vdpbf16ps: 32 products and 16 fp32 sums per instruction); the softmax is fp32. Keys and
// values are packed once per call into the layouts vdpbf16ps reads (pairs of neighbouring values in each 32-bit
// lane: two dims of a key for q.k, the same dim of two keys for p v).
//
// Every query's arithmetic is the same whichever other queries share its call or its block: its keys are visited
// in blocks that start at key 0, in the same order; keys it may not see get weight exactly 0 and leave its running
// maximum, sum and output bit for bit unchanged. So a prompt's outputs do not depend on how it was cut into chunks.

#include "cpu_kernel.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#define LLMKIT_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace llmkit {
namespace {

using bf16 = uint16_t;

constexpr int64_t TILE = 16;         // keys per packed tile of k: one zmm of fp32 scores per query
constexpr int64_t KEYS = 64;         // keys per softmax step: 4 tiles
constexpr int64_t QUERIES = 16;      // queries per block; a block's rows are those queries in each of the G heads
constexpr int64_t QK_ROWS = 4;       // rows per q.k micro-kernel call (4 x 4 accumulators)
constexpr float LOG2E = 1.4426950408889634f;

// x fp32 -> bf16 bits, 16 at a time (round to nearest even, as torch's .to(torch.bfloat16))
template <typename T>
LLMKIT_BF16_TARGET inline void to_bf16(const T* src, bf16* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < n) {
      const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
      _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
    }
  } else {
    std::memcpy(dst, src, n * sizeof(bf16));
  }
}

// 2^x for x <= 0 (x = -inf gives 0): 2^round(x) times a polynomial of the fraction in [-0.5, 0.5] (Cephes' exp2f
// coefficients; relative error ~2e-7, far below the bf16 rounding the weights then get)
LLMKIT_BF16_TARGET inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

LLMKIT_BF16_TARGET inline __m512bh pair_of(const bf16* two) {  // two neighbouring bf16 values, broadcast to every 32-bit lane
  int32_t bits;
  std::memcpy(&bits, two, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// Keys and values of one kv head in vdpbf16ps's layouts, zero-padded to whole blocks of KEYS:
//   kp[tile][d / 2][key in tile][d % 2]   (a tile's 16 keys, two dims per 32-bit lane)
//   vp[key / 2][d][key % 2]               (two neighbouring keys per 32-bit lane, 16 dims per zmm)
template <typename T>
LLMKIT_BF16_TARGET void pack_head(const T* k, const T* v, int64_t key_stride_k, int64_t key_stride_v, int64_t n,
                                  int64_t D, int64_t tiles_from, int64_t tiles_to, bf16* kp, bf16* vp) {
  alignas(64) bf16 row[256], other[256];
  const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                              38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t tile = tiles_from; tile < tiles_to; ++tile) {
    bf16* kt = kp + tile * TILE * D;
    for (int64_t i = 0; i < TILE; ++i) {
      const int64_t j = tile * TILE + i;
      if (j < n) {
        to_bf16(k + j * key_stride_k, row, D);
      } else {
        std::memset(row, 0, D * sizeof(bf16));
      }
      for (int64_t p = 0; p < D / 2; ++p) std::memcpy(kt + (p * TILE + i) * 2, row + 2 * p, 2 * sizeof(bf16));
    }
    for (int64_t j = tile * TILE; j < (tile + 1) * TILE; j += 2) {
      for (int64_t r = 0; r < 2; ++r) {
        bf16* dst = r == 0 ? row : other;
        if (j + r < n) {
          to_bf16(v + (j + r) * key_stride_v, dst, D);
        } else {
          std::memset(dst, 0, D * sizeof(bf16));
        }
      }
      bf16* out = vp + j * D;  // = (j / 2) * D * 2
      for (int64_t d = 0; d < D; d += 16) {
        const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
        const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(other + d)));
        _mm512_storeu_si512(out + d * 2, _mm512_permutex2var_epi16(a, interleave, b));
      }
    }
  }
}

// scores (QK_ROWS, KEYS) of QK_ROWS bf16 query rows (each D long) against a block of 4 packed tiles
LLMKIT_BF16_TARGET inline void qk_block(const bf16* q, int64_t D, const bf16* kp, float* scores) {
  __m512 acc[QK_ROWS][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512bh k[4];
    for (int t = 0; t < 4; ++t) k[t] = (__m512bh)_mm512_loadu_si512(kp + (t * D / 2 + p) * TILE * 2);
    for (int r = 0; r < QK_ROWS; ++r) {
      const __m512bh qv = pair_of(q + r * D + 2 * p);
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qv, k[t]);
    }
  }
  for (int r = 0; r < QK_ROWS; ++r)
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(scores + r * KEYS + t * TILE, acc[r][t]);
}

// One row's softmax step over a block of KEYS scores, of which the first `visible` may be seen: updates the running
// maximum m (in log2 units) and sum l, writes the weights as bf16 to p, returns the factor the row's output so far
// must be multiplied by (exactly 1 when the maximum did not move).
LLMKIT_BF16_TARGET inline float softmax_step(const float* scores, int64_t visible, float scale, float& m, float& l,
                                             bf16* p) {
  __m512 x[4];
  __mmask16 seen[4];
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = minus_inf;
  for (int t = 0; t < 4; ++t) {
    const int64_t n = std::clamp<int64_t>(visible - t * TILE, 0, TILE);
    seen[t] = (__mmask16)((1u << n) - 1);
    x[t] = _mm512_mask_mov_ps(minus_inf, seen[t], _mm512_mul_ps(_mm512_loadu_ps(scores + t * TILE), _mm512_set1_ps(scale)));
    top = _mm512_max_ps(top, x[t]);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(top));
  const float alpha = m == m_new ? 1.f : std::exp2(m - m_new);
  const __m512 shift = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int t = 0; t < 4; ++t) {
    x[t] = _mm512_maskz_mov_ps(seen[t], exp2_ps(_mm512_sub_ps(x[t], shift)));
    sum = _mm512_add_ps(sum, x[t]);
  }
  _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
  _mm512_storeu_si512(p + 32, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

// o (R, D) = o * alpha + p (R, KEYS) @ v (KEYS, D) for R rows, D = 16 C
template <int R, int C>
LLMKIT_BF16_TARGET inline void pv_block(const bf16* p, const bf16* vp, const float* alpha, float* o) {
  constexpr int64_t D = 16 * C;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), _mm512_set1_ps(alpha[r]));
  for (int64_t pair = 0; pair < KEYS / 2; ++pair) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + (pair * D + 16 * c) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = pair_of(p + r * KEYS + 2 * pair);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

using PvFn = void (*)(const bf16*, const bf16*, const float*, float*);

template <int C>
constexpr int pv_rows() {  // up to 16 accumulators; a power of two, so that it divides a block's 16 G rows
  return C <= 2 ? 8 : C <= 4 ? 4 : C <= 8 ? 2 : 1;
}

template <int C>
PvFn pv_for() {
  return &pv_block<pv_rows<C>(), C>;
}

std::pair<PvFn, int> pv_kernel(int64_t D) {
  switch (D / 16) {
#define LLMKIT_PV(C) \
  case C:            \
    return {pv_for<C>(), pv_rows<C>()};
    LLMKIT_PV(1) LLMKIT_PV(2) LLMKIT_PV(3) LLMKIT_PV(4) LLMKIT_PV(5) LLMKIT_PV(6) LLMKIT_PV(7) LLMKIT_PV(8)
    LLMKIT_PV(9) LLMKIT_PV(10) LLMKIT_PV(11) LLMKIT_PV(12) LLMKIT_PV(13) LLMKIT_PV(14) LLMKIT_PV(15) LLMKIT_PV(16)
#undef LLMKIT_PV
    default:
      check_failed("causal_attention: head dim ", D, " is not a multiple of 16 up to 256");
  }
}

// What one thread needs for a block of queries: rows = G * QUERIES
struct Scratch {
  std::vector<bf16> q, p;
  std::vector<float> scores, o, m, l, alpha;
  std::vector<int64_t> position;
  Scratch(int64_t rows, int64_t D)
      : q(rows * D), p(rows * KEYS), scores(rows * KEYS), o(rows * D), m(rows), l(rows), alpha(rows), position(rows) {}
};

template <typename T>
LLMKIT_BF16_TARGET void attend_block(const T* q, const std::array<int64_t, 2>& q_strides, T* out, int64_t H, int64_t T_,
                                     int64_t D, int64_t G, int64_t kv_head, int64_t block, int64_t offset,
                                     float scale, const bf16* kp, const bf16* vp, Scratch& s, PvFn pv, int pv_rows) {
  const int64_t rows = G * QUERIES;
  int64_t last = 0;  // the block's last position: keys up to it are visited
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = kv_head * G + r / QUERIES, t = block * QUERIES + r % QUERIES;
    bf16* qr = s.q.data() + r * D;
    if (t < T_) {
      to_bf16(q + h * q_strides[0] + t * q_strides[1], qr, D);
      s.position[r] = offset + t;
    } else {  // past the prompt's end: computed with the block and dropped
      std::memset(qr, 0, D * sizeof(bf16));
      s.position[r] = offset + T_ - 1;
    }
    last = std::max(last, s.position[r]);
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.f;
  }
  std::fill(s.o.begin(), s.o.end(), 0.f);
  for (int64_t start = 0; start <= last; start += KEYS) {
    const bf16* kb = kp + start * D;
    for (int64_t r = 0; r < rows; r += QK_ROWS) qk_block(s.q.data() + r * D, D, kb, s.scores.data() + r * KEYS);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::clamp<int64_t>(s.position[r] + 1 - start, 0, KEYS);
      s.alpha[r] = softmax_step(s.scores.data() + r * KEYS, visible, scale, s.m[r], s.l[r], s.p.data() + r * KEYS);
    }
    const bf16* vb = vp + start * D;
    for (int64_t r = 0; r < rows; r += pv_rows) pv(s.p.data() + r * KEYS, vb, s.alpha.data() + r, s.o.data() + r * D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = kv_head * G + r / QUERIES, t = block * QUERIES + r % QUERIES;
    if (t >= T_) continue;
    const float inv = 1.f / s.l[r];
    const float* o = s.o.data() + r * D;
    T* dst = out + (t * H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
  }
}

template <typename T>
void causal_attention_typed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t offset,
                            double scale, torch::Tensor& out) {
  const int64_t H = q.size(0), T_ = q.size(1), D = q.size(2), K = k.size(0), G = H / K;
  const int64_t n = offset + T_;  // keys used
  const int64_t padded = (n + KEYS - 1) / KEYS * KEYS, tiles = padded / TILE;
  std::vector<bf16> kp(K * padded * D), vp(K * padded * D);
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  at::parallel_for(0, K * tiles, 8, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e;) {  // runs of tiles within one head
      const int64_t head = i / tiles, to = std::min(e, (head + 1) * tiles);
      pack_head(kd + head * k.stride(0), vd + head * v.stride(0), k.stride(1), v.stride(1), n, D, i - head * tiles,
                to - head * tiles, kp.data() + head * padded * D, vp.data() + head * padded * D);
      i = to;
    }
  });
  const auto [pv, rows_per_pv] = pv_kernel(D);
  const int64_t blocks = (T_ + QUERIES - 1) / QUERIES, work = K * blocks;
  std::atomic<int64_t> next{0};  // blocks are handed out longest first, one at a time, to whichever thread is free
  const T* qd = q.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const std::array<int64_t, 2> q_strides{q.stride(0), q.stride(1)};
  const float scale_log2 = static_cast<float>(scale) * LOG2E;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch s(G * QUERIES, D);
    for (int64_t i; (i = next.fetch_add(1)) < work;) {
      const int64_t block = blocks - 1 - i / K, head = i % K;
      attend_block(qd, q_strides, od, H, T_, D, G, head, block, offset, scale_log2, kp.data() + head * padded * D,
                   vp.data() + head * padded * D, s, pv, rows_per_pv);
    }
  });
}

// q (H, T, D), k and v (K, S >= offset + T, D), last dims contiguous, fp32 or bf16 alike -> (H, T, D) of q's dtype,
// laid out (T, H, D) in memory (so that the caller's transpose back to (T, H D) is free)
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t offset,
                               double scale) {
  check_cpu(q, "causal_attention: q");
  check_cpu(k, "causal_attention: k");
  check_cpu(v, "causal_attention: v");
  LLMKIT_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "causal_attention: q, k, v must be 3-D (heads, n, D)");
  LLMKIT_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
               "causal_attention: q, k and v must share a dtype");
  const int64_t H = q.size(0), T_ = q.size(1), D = q.size(2), K = k.size(0);
  LLMKIT_CHECK(K > 0 && H % K == 0 && v.size(0) == K, "causal_attention: ", H, " query heads over ", K, " kv heads");
  LLMKIT_CHECK(k.size(2) == D && v.size(2) == D && D % 16 == 0 && D <= 256,
               "causal_attention: head dims ", D, "/", k.size(2), "/", v.size(2), " (a multiple of 16 up to 256)");
  LLMKIT_CHECK(offset >= 0 && k.size(1) >= offset + T_ && v.size(1) >= offset + T_, "causal_attention: ",
               k.size(1), " keys for ", T_, " queries from position ", offset);
  LLMKIT_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "causal_attention: last dims must be contiguous");
  auto out = torch::empty({T_, H, D}, q.options()).transpose(0, 1);
  if (T_ == 0) return out;
  if (q.scalar_type() == torch::kFloat32) {
    causal_attention_typed<float>(q, k, v, offset, scale, out);
  } else {
    LLMKIT_CHECK(q.scalar_type() == torch::kBFloat16, "causal_attention: fp32 or bf16 inputs");
    causal_attention_typed<at::BFloat16>(q, k, v, offset, scale, out);
  }
  return out;
}

}  // namespace

void bind_attention(pybind11::module& m) {
  m.def("causal_attention", &causal_attention, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("offset"), pybind11::arg("scale"),
        "causal attention of queries at positions offset.. on bf16 dot-product units (AVX512-BF16 CPUs only)");
}

}  // namespace llmkit
