// Quantizing float rows to llama.cpp's K-quants (Q2_K ... Q6_K) and to IQ4_NL / IQ4_XS: kquants.py's and
// iquants.py's rules, step for step, in C++.
//
// kquants.py is the reference and says what each step does; this file computes the same bytes (tested equal) 2-4x
// faster, each sub-block's candidate scales tried in registers instead of one tensor operation a step over all
// sub-blocks (its sums, in index order, are chains of dependent additions: their latency bounds it). Every product
// and quotient is its own float operation: the functions are compiled with floating-point contraction off, so no
// multiply-add is fused.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernel.h"

#define LLMKIT_EXACT __attribute__((optimize("fp-contract=off")))

namespace llmkit {
namespace {

constexpr int QK = 256;
constexpr float EPS = 1e-15f;

LLMKIT_EXACT inline float nearest(float v) { return std::nearbyint(v); }  // half to even, as torch.round

inline uint16_t half_bits(float v) { return c10::Half(v).x; }
inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

inline void put_half(uint8_t* at, uint16_t bits) {
  at[0] = bits & 255;
  at[1] = bits >> 8;
}

// make_qkx2_quants: codes 0..nmax of w = scale q - min for n weights x with weights w; returns scale, sets min.
// `mad`: the error weighs absolute differences (Q2_K's), not squared ones.
LLMKIT_EXACT float scale_and_min(const float* x, const float* w, int n, int nmax, float rmin, float rdelta, int nstep,
                                 uint8_t* L, float* the_min, bool mad = false) {
  float lo = x[0], hi = x[0], sum_w = w[0], sum_x = w[0] * x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (lo > 0) lo = 0;
  if (hi == lo) {
    std::memset(L, 0, n);
    *the_min = -lo;
    return 0.f;
  }
  float iscale = static_cast<float>(nmax) / (hi - lo);
  float scale = 1.f / iscale;
  float best = 0;
  for (int i = 0; i < n; ++i) {
    const float l = std::clamp(nearest(iscale * (x[i] - lo)), 0.f, static_cast<float>(nmax));
    L[i] = static_cast<uint8_t>(l);
    const float diff = scale * l + lo - x[i];
    best += w[i] * (mad ? std::fabs(diff) : diff * diff);
  }
  uint8_t trial[32];
  for (int step = 0; step <= nstep; ++step) {
    iscale = (rmin + rdelta * static_cast<float>(step) + static_cast<float>(nmax)) / (hi - lo);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const float l = std::clamp(nearest(iscale * (x[i] - lo)), 0.f, static_cast<float>(nmax));
      trial[i] = static_cast<uint8_t>(l);
      const float wl = w[i] * l;
      sum_l += wl;
      sum_l2 += wl * l;
      sum_xl += wl * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float error = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * static_cast<float>(trial[i]) + this_min - x[i];
        error += w[i] * (mad ? std::fabs(diff) : diff * diff);
      }
      if (error < best) {
        std::memcpy(L, trial, n);
        best = error;
        scale = this_scale;
        lo = this_min;
      }
    }
  }
  *the_min = -lo;
  return scale;
}

// one grid of make_qx_quants: levels -nmax..nmax - 1 at iscale, and the weighted sums of the least-squares fit
// (weights qw where given, else x^2)
LLMKIT_EXACT void fit_levels(const float* x, int n, int nmax, float iscale, int8_t* levels, float& sum_lx,
                             float& sum_l2, const float* qw) {
  sum_lx = 0;
  sum_l2 = 0;
  for (int i = 0; i < n; ++i) {
    const float l = std::clamp(nearest(iscale * x[i]), static_cast<float>(-nmax), static_cast<float>(nmax - 1));
    levels[i] = static_cast<int8_t>(l);
    const float w = qw != nullptr ? qw[i] : x[i] * x[i];
    sum_lx += w * x[i] * l;
    sum_l2 += w * l * l;
  }
}

// make_qx_quants, rmse_type 1: codes 0..2 nmax - 1 of w = scale (q - nmax) for n <= 32 weights; returns scale.
// The fits are weighted by qw where given (an importance matrix's), else by x^2.
LLMKIT_EXACT float signed_scale(const float* x, int n, int nmax, uint8_t* L, const float* qw = nullptr) {
  float peak = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      peak = x[i];
    }
  }
  if (amax < EPS) {
    std::memset(L, 0, n);
    return 0.f;
  }
  int8_t levels[32], trial[32];
  float sum_lx, sum_l2;
  fit_levels(x, n, nmax, static_cast<float>(-nmax) / peak, levels, sum_lx, sum_l2, qw);
  float scale = sum_l2 != 0 ? sum_lx / sum_l2 : 0.f;
  float best = scale * sum_lx;
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    fit_levels(x, n, nmax, -(static_cast<float>(nmax) + 0.1f * static_cast<float>(step)) / peak, trial, sum_lx, sum_l2,
               qw);
    if (sum_l2 > 0 && sum_lx * sum_lx > best * sum_l2) {
      std::memcpy(levels, trial, n);
      scale = sum_lx / sum_l2;
      best = scale * sum_lx;
    }
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(levels[i] + nmax);
  return scale;
}

// 256 two-bit codes packed: per half of 128, byte l holds codes l, l + 32, l + 64, l + 96 (kquants._pack_2bit)
void pack_2bit(const uint8_t* L, uint8_t* qs) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* q = L + 128 * h;
    for (int l = 0; l < 32; ++l) qs[32 * h + l] = q[l] | (q[l + 32] << 2) | (q[l + 64] << 4) | (q[l + 96] << 6);
  }
}

// A Q2_K block's bytes once its 16 scale-and-min bytes are in out[0, 16): d and dmin, then x's codes recomputed
// against the scales as stored (both quantizers end so)
LLMKIT_EXACT void q2_k_store(const float* x, uint16_t d16, uint16_t dmin16, uint8_t* L, uint8_t* out) {
  const uint8_t* sc = out;
  put_half(out + 80, d16);
  put_half(out + 82, dmin16);
  const float d = half_value(d16), dmin = half_value(dmin16);
  for (int j = 0; j < 16; ++j) {
    const float sub_d = d * static_cast<float>(sc[j] & 15);
    if (sub_d == 0) continue;
    const float sub_m = dmin * static_cast<float>(sc[j] >> 4);
    for (int l = 0; l < 16; ++l) {
      L[16 * j + l] = static_cast<uint8_t>(std::clamp(nearest((x[16 * j + l] + sub_m) / sub_d), 0.f, 3.f));
    }
  }
  pack_2bit(L, out + 16);
}

// Q2_K (kquants._q2_k): 16 sub-blocks of 16, each one's scale and min by make_qkx2_quants (weights |x|, absolute
// errors), both coded in 4 bits against fp16 d and dmin
LLMKIT_EXACT void q2_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  float scales[16], mins[16], weights[16];
  for (int j = 0; j < 16; ++j) {
    const float* s = x + 16 * j;
    for (int l = 0; l < 16; ++l) weights[l] = std::fabs(s[l]);
    scales[j] = scale_and_min(s, weights, 16, 3, -0.5f, 0.1f, 15, L + 16 * j, &mins[j], true);
  }
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 16; ++j) {
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  uint8_t* sc = out;
  const float inv_scale = max_scale > 0 ? 15.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 15.f / max_min : 0.f;
  for (int j = 0; j < 16; ++j) {  // as C stores nearest_int's int in a uint8: a negative one wraps
    sc[j] = static_cast<uint8_t>(static_cast<int>(nearest(inv_scale * scales[j])));
    sc[j] |= static_cast<uint8_t>(static_cast<int>(nearest(inv_min * mins[j])) << 4);
  }
  q2_k_store(x, half_bits(max_scale / 15.f), half_bits(max_min / 15.f), L, out);
}

// make_q3_quants(16, 4, ., rmse) (kquants._q3_search): codes 0..7 of w = scale (q - 4), all 0 for a zero sub-block
LLMKIT_EXACT float q3_search(const float* x, uint8_t* codes) {
  float amax = 0, peak = 0;
  for (int i = 0; i < 16; ++i) {
    if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), peak = x[i];
  }
  if (amax < EPS) {
    std::memset(codes, 0, 16);
    return 0.f;
  }
  const float iscale = -4.f / peak;
  float L[16], sum_lx = 0, sum_l2 = 0;
  for (int i = 0; i < 16; ++i) {
    L[i] = std::clamp(nearest(iscale * x[i]), -4.f, 3.f);
    const float w = x[i] * x[i];
    sum_lx += w * x[i] * L[i];
    sum_l2 += w * L[i] * L[i];
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < 16; ++i) {
      const float w = x[i] * x[i];
      float slx = sum_lx - w * x[i] * L[i];
      if (slx <= 0) continue;
      float sl2 = sum_l2 - w * L[i] * L[i];
      const float level = std::clamp(nearest(x[i] * sl2 / slx), -4.f, 3.f);
      if (level == L[i]) continue;
      slx += w * x[i] * level;
      sl2 += w * level * level;
      if (sl2 > 0 && slx * slx * sum_l2 > sum_lx * sum_lx * sl2) L[i] = level, sum_lx = slx, sum_l2 = sl2, ++changed;
    }
    if (!changed) break;
  }
  for (int i = 0; i < 16; ++i) codes[i] = static_cast<uint8_t>(L[i] + 4.f);
  return sum_l2 > 0 ? sum_lx / sum_l2 : 0.f;
}

// A Q3_K block's bytes once its scales are in out[96, 108) (the rest zero): d, then x's codes recomputed against the
// scales as stored, their high bits in hmask (both quantizers end so)
LLMKIT_EXACT void q3_k_store(const float* x, uint16_t d16, uint8_t* L, uint8_t* out) {
  uint8_t *hmask = out, *sc = out + 96;
  put_half(out + 108, d16);
  const float d = half_value(d16);
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4, high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    const float sub_d = d * static_cast<float>((low | (high << 4)) - 32);
    if (sub_d == 0) continue;
    for (int l = 0; l < 16; ++l) {
      L[16 * j + l] = static_cast<uint8_t>(std::clamp(nearest(x[16 * j + l] / sub_d), -4.f, 3.f) + 4.f);
    }
  }
  for (int j = 0; j < QK; ++j) {  // the high bit of weight j: bit j / 32 of hmask[j % 32]
    if (L[j] > 3) hmask[j % 32] |= 1 << (j / 32), L[j] -= 4;
  }
  pack_2bit(L, out + 32);
}

// Q3_K (kquants._q3_k): 16 sub-blocks of 16, signed 6-bit scales against one fp16 d, 3-bit codes (a high bit apart)
LLMKIT_EXACT void q3_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  float scales[16], amax = 0, peak = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = q3_search(x + 16 * j, L + 16 * j);
    if (std::fabs(scales[j]) > amax) amax = std::fabs(scales[j]), peak = scales[j];
  }
  std::memset(out, 0, 110);
  uint8_t* sc = out + 96;
  uint16_t d16 = half_bits(0.f);
  if (peak != 0) {
    const float iscale = -32.f / peak;
    for (int j = 0; j < 16; ++j) {
      const int l = static_cast<int>(std::clamp(nearest(iscale * scales[j]), -32.f, 31.f)) + 32;
      sc[j % 8] |= (l & 15) << (j < 8 ? 0 : 4);
      sc[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
    }
    d16 = half_bits(1.f / iscale);
  }
  q3_k_store(x, d16, L, out);
}

LLMKIT_EXACT void k4_store(const float* x, int nmax, uint16_t d16, uint16_t dmin16, const uint8_t* ls,
                           const uint8_t* lm, uint8_t* head, uint8_t* L);

// Q4_K and Q5_K (nmax 15 or 31): d, dmin, the 12 scale bytes and the codes L (256) of one super-block
LLMKIT_EXACT void k4(const float* x, int nmax, float rmin, int nstep, uint8_t* head, uint8_t* L) {
  float scales[8], mins[8], weights[32];
  for (int j = 0; j < 8; ++j) {
    const float* s = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += s[l] * s[l];
    const float av = std::sqrt(sum_x2 / 32.f);
    for (int l = 0; l < 32; ++l) weights[l] = av + std::fabs(s[l]);
    scales[j] = scale_and_min(s, weights, 32, nmax, rmin, 0.1f, nstep, L + 32 * j, &mins[j]);
  }
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {  // as C stores nearest_int's int in a uint8: a negative one wraps
    ls[j] = std::min<uint8_t>(63, static_cast<uint8_t>(static_cast<int>(nearest(inv_scale * scales[j]))));
    lm[j] = std::min<uint8_t>(63, static_cast<uint8_t>(static_cast<int>(nearest(inv_min * mins[j]))));
  }
  k4_store(x, nmax, half_bits(max_scale / 63.f), half_bits(max_min / 63.f), ls, lm, head, L);
}

// Q4_K's / Q5_K's d, dmin and 12 scale bytes into head, and every weight coded again against its sub-block's
// stored scale and min into L (a sub-block whose scale is 0 keeps its searched codes)
LLMKIT_EXACT void k4_store(const float* x, int nmax, uint16_t d16, uint16_t dmin16, const uint8_t* ls,
                           const uint8_t* lm, uint8_t* head, uint8_t* L) {
  put_half(head, d16);
  put_half(head + 2, dmin16);
  uint8_t* sc = head + 4;
  for (int j = 0; j < 4; ++j) {
    sc[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
    sc[j + 4] = lm[j] | ((lm[j + 4] >> 4) << 6);
    sc[j + 8] = (ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4);
  }
  const float d = half_value(d16), dmin = half_value(dmin16);
  for (int j = 0; j < 8; ++j) {
    const float sub_d = d * static_cast<float>(ls[j]);
    if (sub_d == 0) continue;
    const float sub_m = dmin * static_cast<float>(lm[j]);
    for (int l = 0; l < 32; ++l) {
      L[32 * j + l] = static_cast<uint8_t>(std::clamp(nearest((x[32 * j + l] + sub_m) / sub_d), 0.f,
                                                      static_cast<float>(nmax)));
    }
  }
}

void pack_q4_k(const uint8_t* L, uint8_t* out) {
  uint8_t* qs = out + 16;
  for (int run = 0; run < 4; ++run) {
    for (int l = 0; l < 32; ++l) qs[32 * run + l] = L[64 * run + l] | (L[64 * run + 32 + l] << 4);
  }
}

void q4_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  k4(x, 15, -1.f, 20, out, L);
  pack_q4_k(L, out);
}

void pack_q5_k(const uint8_t* L, uint8_t* out) {
  uint8_t *qh = out + 16, *qs = out + 48;
  std::memset(qh, 0, 32);
  for (int u = 0; u < 8; ++u) {
    for (int l = 0; l < 32; ++l) qh[l] |= ((L[32 * u + l] >> 4) & 1) << u;
  }
  for (int run = 0; run < 4; ++run) {
    for (int l = 0; l < 32; ++l) {
      qs[32 * run + l] = (L[64 * run + l] & 15) | ((L[64 * run + 32 + l] & 15) << 4);
    }
  }
}

void q5_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  k4(x, 31, -0.5f, 15, out, L);
  pack_q5_k(L, out);
}

// (qw: the importance of each weight, where given: weighted.py)
LLMKIT_EXACT void q6_k_with(const float* x, uint8_t* out, const float* qw) {
  uint8_t L[QK];
  float scales[16];
  float peak = 0, amax = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = signed_scale(x + 16 * j, 16, 32, L + 16 * j, qw != nullptr ? qw + 16 * j : nullptr);
    if (std::fabs(scales[j]) > amax) {
      amax = std::fabs(scales[j]);
      peak = scales[j];
    }
  }
  std::memset(out, 0, 210);
  if (amax < EPS) return;
  const float iscale = -128.f / peak;
  const uint16_t d16 = half_bits(1.f / iscale);
  put_half(out + 208, d16);
  const float d = half_value(d16);
  int8_t* sc = reinterpret_cast<int8_t*>(out + 192);
  for (int j = 0; j < 16; ++j) {
    sc[j] = static_cast<int8_t>(std::min(127.f, nearest(iscale * scales[j])));
    const float sub_d = d * static_cast<float>(sc[j]);
    if (sub_d == 0) continue;
    for (int l = 0; l < 16; ++l) {
      L[16 * j + l] = static_cast<uint8_t>(std::clamp(nearest(x[16 * j + l] / sub_d), -32.f, 31.f) + 32.f);
    }
  }
  uint8_t *ql = out, *qh = out + 128;
  for (int h = 0; h < 2; ++h) {
    const uint8_t* q = L + 128 * h;
    for (int l = 0; l < 32; ++l) {
      ql[64 * h + l] = (q[l] & 15) | ((q[l + 64] & 15) << 4);
      ql[64 * h + 32 + l] = (q[l + 32] & 15) | ((q[l + 96] & 15) << 4);
      qh[32 * h + l] = (q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) | ((q[l + 96] >> 4) << 6);
    }
  }
}

void q6_k(const float* x, uint8_t* out) { q6_k_with(x, out, nullptr); }

// ---- IQ4_NL and IQ4_XS (iquants.py's rules, step for step)

constexpr float LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// the index of the level nearest v, the lower one on a tie (iquants._nearest_level)
LLMKIT_EXACT inline int nearest_level(float v) {
  if (v <= LEVELS[0]) return 0;
  if (v >= LEVELS[15]) return 15;
  int upper = 1;
  while (LEVELS[upper] <= v) ++upper;  // the first level above v
  return v - LEVELS[upper - 1] < LEVELS[upper] - v ? upper - 1 : upper;
}

// sum w q x and sum w q^2 over a block of 32 for the levels nearest inverse * x (iquants._fit)
LLMKIT_EXACT inline void fit(const float* x, const float* w, float inverse, float& sumqx, float& sumq2) {
  sumqx = 0.f, sumq2 = 0.f;
  for (int j = 0; j < 32; ++j) {
    const float q = LEVELS[nearest_level(inverse * x[j])], wq = w[j] * q;
    sumqx += wq * x[j];
    sumq2 += wq * q;
  }
}

// a block of 32's least-squares scale after the 15 tries (iquants._block_scales), the fits weighted by `given`
// where given (weighted.py), else by x^2
LLMKIT_EXACT float iq4_scale(const float* x, const float* given = nullptr) {
  float w[32], amax = 0.f, top = 0.f;
  for (int j = 0; j < 32; ++j) {
    w[j] = given != nullptr ? given[j] : x[j] * x[j];
    if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), top = x[j];
  }
  if (amax < EPS) return 0.f;
  float d = -top / LEVELS[0], sumqx, sumq2;
  fit(x, w, 1.f / d, sumqx, sumq2);
  d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
  float best = d * sumqx;
  for (int t = -7; t <= 7; ++t) {
    fit(x, w, static_cast<float>(t + static_cast<int>(LEVELS[0])) / top, sumqx, sumq2);
    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) d = sumqx / sumq2, best = d * sumqx;
  }
  return d;
}

LLMKIT_EXACT inline float inverse_or_zero(float v) { return v != 0.f ? 1.f / v : 0.f; }

// 32 codes (the levels of inverse * x) packed: code j in byte j's low nibble, code 16 + j in its high one
LLMKIT_EXACT void pack_levels(const float* x, float inverse, uint8_t* out) {
  for (int j = 0; j < 16; ++j)
    out[j] = static_cast<uint8_t>(nearest_level(inverse * x[j]) | (nearest_level(inverse * x[16 + j]) << 4));
}

LLMKIT_EXACT void iq4_nl(const float* x, uint8_t* out) {  // 32 weights -> fp16 d, 16 bytes
  const float d = iq4_scale(x);
  put_half(out, half_bits(d));
  pack_levels(x, inverse_or_zero(d), out + 2);
}

LLMKIT_EXACT void iq4_xs_store(const float* x, const float* scales, uint8_t* out);

LLMKIT_EXACT void iq4_xs(const float* x, uint8_t* out) {  // 256 weights -> fp16 d, 2 + 4 bytes of scales, 128
  float scales[8];
  for (int b = 0; b < 8; ++b) scales[b] = iq4_scale(x + 32 * b);
  iq4_xs_store(x, scales, out);
}

// IQ4_XS's bytes for 256 weights whose 8 blocks have the least-squares scales `scales`
LLMKIT_EXACT void iq4_xs_store(const float* x, const float* scales, uint8_t* out) {
  float top = 0.f, amax = 0.f;
  for (int b = 0; b < 8; ++b) {
    if (std::fabs(scales[b]) > amax) amax = std::fabs(scales[b]), top = scales[b];
  }
  const float d = -top / 32.f, id = inverse_or_zero(d);
  put_half(out, half_bits(d));
  uint16_t high = 0;
  std::memset(out + 4, 0, 4);
  for (int b = 0; b < 8; ++b) {
    const int l = static_cast<int>(std::clamp(nearest(id * scales[b]), -32.f, 31.f));
    pack_levels(x + 32 * b, inverse_or_zero(d * static_cast<float>(l)), out + 8 + 16 * b);
    const int u = l + 32;
    out[4 + b / 2] |= static_cast<uint8_t>((u & 15) << (4 * (b % 2)));
    high |= static_cast<uint16_t>((u >> 4) << (2 * b));
  }
  put_half(out + 2, high);
}

// ---- with an importance matrix (weighted.py's rules, step for step; qw: the importance of each weight)

// make_qp_quants over n <= 16 non-negative values x weighted by w (weighted._qp): codes 0..nmax into L; the scale
LLMKIT_EXACT float qp(const float* x, const float* w, int n, int nmax, uint8_t* L) {
  float top = 0;
  for (int i = 0; i < n; ++i) top = std::max(top, x[i]);
  if (top < EPS) {
    std::memset(L, 0, n);
    return 0.f;
  }
  const float fmax = static_cast<float>(nmax);
  float iscale = fmax / top, scale = 1.f / iscale, best = 0;
  for (int i = 0; i < n; ++i) {
    const float diff = x[i] - scale * nearest(iscale * x[i]);
    best += w[i] * diff * diff;
  }
  for (int step = -4; step <= 4; ++step) {
    if (step == 0) continue;
    const float trial = (0.1f * static_cast<float>(step) + fmax) / top, trial_scale = 1.f / trial;
    float error = 0;
    for (int i = 0; i < n; ++i) {
      const float diff = x[i] - trial_scale * std::min(fmax, nearest(trial * x[i]));
      error += w[i] * diff * diff;
    }
    if (error < best) best = error, iscale = trial;
  }
  float l[16], sum_lx = 0, sum_l2 = 0;
  for (int i = 0; i < n; ++i) {
    l[i] = std::min(fmax, nearest(iscale * x[i]));
    sum_lx += w[i] * x[i] * l[i];
    sum_l2 += w[i] * l[i] * l[i];
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      float slx = sum_lx - w[i] * x[i] * l[i], sl2 = sum_l2 - w[i] * l[i] * l[i];
      if (!(slx > 0 && sl2 > 0)) continue;
      const float fresh = std::min(fmax, nearest(x[i] * sl2 / slx));
      if (fresh == l[i]) continue;
      slx += w[i] * x[i] * fresh;
      sl2 += w[i] * fresh * fresh;
      if (slx * slx * sum_l2 > sum_lx * sum_lx * sl2) l[i] = fresh, sum_lx = slx, sum_l2 = sl2, ++changed;
    }
    if (!changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(l[i]);
  return sum_l2 > 0 ? sum_lx / sum_l2 : 0.f;
}

// qw sqrt(sigma2 + x^2) for n weights; returns their sum, in order (a sub-block's weight when its scale is coded)
LLMKIT_EXACT float importance_weights(const float* x, const float* qw, float sigma2, int n, float* w) {
  float sum = 0;
  for (int j = 0; j < n; ++j) w[j] = qw[j] * std::sqrt(sigma2 + x[j] * x[j]), sum += w[j];
  return sum;
}

LLMKIT_EXACT float sum_squares(const float* x, int n) {
  float s = 0;
  for (int j = 0; j < n; ++j) s += x[j] * x[j];
  return s;
}

// Q4_K and Q5_K with an importance matrix (weighted._k4): scales and mins by make_qkx3_quants, then make_qp_quants
LLMKIT_EXACT void k4_weighted(const float* x, const float* qw, int nmax, uint8_t* head, uint8_t* L) {
  const float sigma2 = 2.f * sum_squares(x, QK) / static_cast<float>(QK);
  float scales[8], mins[8], sums[8], weights[32];
  for (int j = 0; j < 8; ++j) {
    sums[j] = importance_weights(x + 32 * j, qw + 32 * j, sigma2, 32, weights);
    scales[j] = scale_and_min(x + 32 * j, weights, 32, nmax, -0.9f, 0.05f, 36, L + 32 * j, &mins[j]);
  }
  uint8_t ls[8], lm[8];
  const float d = qp(scales, sums, 8, 63, ls), dmin = qp(mins, sums, 8, 63, lm);
  k4_store(x, nmax, half_bits(d), half_bits(dmin), ls, lm, head, L);
}

LLMKIT_EXACT void q4_k_weighted(const float* x, const float* qw, uint8_t* out) {
  uint8_t L[QK];
  k4_weighted(x, qw, 15, out, L);
  pack_q4_k(L, out);
}

LLMKIT_EXACT void q5_k_weighted(const float* x, const float* qw, uint8_t* out) {
  uint8_t L[QK];
  k4_weighted(x, qw, 31, out, L);
  pack_q5_k(L, out);
}

LLMKIT_EXACT void q6_k_weighted(const float* x, const float* qw, uint8_t* out) { q6_k_with(x, out, qw); }

// Q2_K with an importance matrix (weighted._q2_k): sub-blocks by make_qkx3_quants (squared errors), the 16 scales
// and mins by make_qp_quants in 4 bits
LLMKIT_EXACT void q2_k_weighted(const float* x, const float* qw, uint8_t* out) {
  const float sigma2 = sum_squares(x, QK) / static_cast<float>(QK);
  uint8_t L[QK], ls[16], lm[16];
  float scales[16], mins[16], sums[16], weights[16];
  for (int j = 0; j < 16; ++j) {
    sums[j] = importance_weights(x + 16 * j, qw + 16 * j, sigma2, 16, weights);
    scales[j] = scale_and_min(x + 16 * j, weights, 16, 3, -0.9f, 0.05f, 36, L + 16 * j, &mins[j]);
  }
  const uint16_t d16 = half_bits(qp(scales, sums, 16, 15, ls)), dmin16 = half_bits(qp(mins, sums, 16, 15, lm));
  for (int j = 0; j < 16; ++j) out[j] = static_cast<uint8_t>(ls[j] | (lm[j] << 4));
  q2_k_store(x, d16, dmin16, L, out);
}

// Q3_K with an importance matrix (weighted._q3_k): sub-blocks by make_qx_quants with the weights, the 16 scales by
// make_qx_quants weighted by their sub-blocks' summed weights
LLMKIT_EXACT void q3_k_weighted(const float* x, const float* qw, uint8_t* out) {
  const float sigma2 = 2.f * sum_squares(x, QK) / static_cast<float>(QK);
  uint8_t L[QK], ls[16];
  float scales[16], sums[16], weights[16];
  for (int j = 0; j < 16; ++j) {
    sums[j] = importance_weights(x + 16 * j, qw + 16 * j, sigma2, 16, weights);
    scales[j] = signed_scale(x + 16 * j, 16, 4, L + 16 * j, weights);
  }
  const uint16_t d16 = half_bits(signed_scale(scales, 16, 32, ls, sums));
  std::memset(out, 0, 110);
  uint8_t* sc = out + 96;
  for (int j = 0; j < 16; ++j) {
    sc[j % 8] |= (ls[j] & 15) << (j < 8 ? 0 : 4);
    sc[8 + j % 4] |= (ls[j] >> 4) << (2 * (j / 4));
  }
  q3_k_store(x, d16, L, out);
}

LLMKIT_EXACT void iq4_nl_weighted(const float* x, const float* qw, uint8_t* out) {
  float w[32];
  importance_weights(x, qw, sum_squares(x, 32) * (2.f / 32.f), 32, w);
  const float d = iq4_scale(x, w);
  put_half(out, half_bits(d));
  pack_levels(x, inverse_or_zero(d), out + 2);
}

LLMKIT_EXACT void iq4_xs_weighted(const float* x, const float* qw, uint8_t* out) {
  const float sigma2 = sum_squares(x, QK) * (2.f / static_cast<float>(QK));
  float scales[8], w[32];
  for (int b = 0; b < 8; ++b) {
    importance_weights(x + 32 * b, qw + 32 * b, sigma2, 32, w);
    scales[b] = iq4_scale(x + 32 * b, w);
  }
  iq4_xs_store(x, scales, out);
}

// the 32-weight types (weighted._symmetric / _asymmetric): sigma2 is the row's mean square
LLMKIT_EXACT void nibbles(const uint8_t* L, uint8_t* qs) {
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((L[j] & 15) | ((L[j + 16] & 15) << 4));
}

LLMKIT_EXACT void fifth_bits(const uint8_t* L, uint8_t* qh) {
  uint32_t bits = 0;
  for (int j = 0; j < 32; ++j) bits |= static_cast<uint32_t>((L[j] >> 4) & 1) << j;
  for (int b = 0; b < 4; ++b) qh[b] = static_cast<uint8_t>(bits >> (8 * b));
}

LLMKIT_EXACT void q32_weighted(int kind, const float* x, const float* qw, float sigma2, uint8_t* out) {
  float w[32];
  uint8_t L[32];
  importance_weights(x, qw, sigma2, 32, w);
  if (kind == 2 || kind == 6) {  // Q4_0, Q5_0: d, (qh,) nibbles
    put_half(out, half_bits(signed_scale(x, 32, kind == 2 ? 8 : 16, L, w)));
    if (kind == 6) fifth_bits(L, out + 2);
    nibbles(L, out + (kind == 2 ? 2 : 6));
    return;
  }
  float minus;  // Q4_1, Q5_1: d, m, (qh,) nibbles
  const float d = scale_and_min(x, w, 32, kind == 3 ? 15 : 31, -0.9f, 0.05f, 36, L, &minus);
  put_half(out, half_bits(d));
  put_half(out + 2, half_bits(-minus));
  if (kind == 7) fifth_bits(L, out + 4);
  nibbles(L, out + (kind == 3 ? 4 : 8));
}

// rows w (N, K) fp32 and the importance of their K inputs -> (N, row bytes) uint8 blocks of ggml type `kind`
// (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K, 20 IQ4_NL, 23 IQ4_XS), by weighted.py's rules
torch::Tensor quantize_weighted(const torch::Tensor& w, int64_t kind, const torch::Tensor& importance) {
  check_cpu(w, "w");
  check_cpu(importance, "importance");
  LLMKIT_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be (N, K) fp32");
  const int64_t N = w.size(0), K = w.size(1);
  LLMKIT_CHECK(importance.dim() == 1 && importance.size(0) == K && importance.scalar_type() == torch::kFloat32 &&
                   importance.is_contiguous(),
               "importance must be (K,) fp32");
  void (*super)(const float*, const float*, uint8_t*) = nullptr;
  int64_t unit = 32, bytes = 0;
  switch (kind) {
    case 2: bytes = 18; break;
    case 3: bytes = 20; break;
    case 6: bytes = 22; break;
    case 7: bytes = 24; break;
    case 10: super = q2_k_weighted, unit = QK, bytes = 84; break;
    case 11: super = q3_k_weighted, unit = QK, bytes = 110; break;
    case 12: super = q4_k_weighted, unit = QK, bytes = 144; break;
    case 13: super = q5_k_weighted, unit = QK, bytes = 176; break;
    case 14: super = q6_k_weighted, unit = QK, bytes = 210; break;
    case 20: super = iq4_nl_weighted, bytes = 18; break;
    case 23: super = iq4_xs_weighted, unit = QK, bytes = 136; break;
    default: check_failed("quantize_weighted: ggml type ", kind, " is not weighted by an importance matrix");
  }
  LLMKIT_CHECK(K % unit == 0, "a row of ", K, " weights is not whole blocks of ", unit);
  const int64_t units = K / unit;
  auto out = torch::empty({N, units * bytes}, w.options().dtype(torch::kUInt8));
  const float *X = w.data_ptr<float>(), *Q = importance.data_ptr<float>();
  uint8_t* Y = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = X + r * K;
      uint8_t* y = Y + r * units * bytes;
      if (super != nullptr) {
        for (int64_t u = 0; u < units; ++u) super(x + u * unit, Q + u * unit, y + u * bytes);
        continue;
      }
      const float sigma2 = sum_squares(x, static_cast<int>(K)) / static_cast<float>(K);
      for (int64_t u = 0; u < units; ++u) q32_weighted(static_cast<int>(kind), x + u * 32, Q + u * 32, sigma2, y + u * bytes);
    }
  });
  return out;
}

// x (B, 32 or 256) fp32 -> (B, bytes) uint8 blocks of ggml type `kind` (20 IQ4_NL, 23 IQ4_XS)
torch::Tensor quantize_iq4(const torch::Tensor& x, int64_t kind) {
  check_cpu(x, "x");
  LLMKIT_CHECK(kind == 20 || kind == 23, "quantize_iq4: ggml type ", kind, " is not IQ4_NL or IQ4_XS");
  const int64_t n = kind == 20 ? 32 : QK, bytes = kind == 20 ? 18 : 136;
  LLMKIT_CHECK(x.dim() == 2 && x.size(1) == n && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
               "x must be (B, ", n, ") fp32, contiguous");
  auto out = torch::empty({x.size(0), bytes}, x.options().dtype(torch::kUInt8));
  const float* X = x.data_ptr<float>();
  uint8_t* Y = out.data_ptr<uint8_t>();
  at::parallel_for(0, x.size(0), 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) (kind == 20 ? iq4_nl : iq4_xs)(X + b * n, Y + b * bytes);
  });
  return out;
}

// x (B, 256) fp32 -> (B, bytes) uint8 blocks of ggml type `kind` (10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K)
torch::Tensor quantize_k(const torch::Tensor& x, int64_t kind) {
  check_cpu(x, "x");
  LLMKIT_CHECK(x.dim() == 2 && x.size(1) == QK && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
               "x must be (B, 256) fp32, contiguous");
  void (*fn)(const float*, uint8_t*) = nullptr;
  int64_t bytes = 0;
  switch (kind) {
    case 10: fn = q2_k, bytes = 84; break;
    case 11: fn = q3_k, bytes = 110; break;
    case 12: fn = q4_k, bytes = 144; break;
    case 13: fn = q5_k, bytes = 176; break;
    case 14: fn = q6_k, bytes = 210; break;
    default: check_failed("quantize_k: ggml type ", kind, " is not Q2_K, Q3_K, Q4_K, Q5_K or Q6_K");
  }
  auto out = torch::empty({x.size(0), bytes}, x.options().dtype(torch::kUInt8));
  const float* X = x.data_ptr<float>();
  uint8_t* Y = out.data_ptr<uint8_t>();
  at::parallel_for(0, x.size(0), 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn(X + b * QK, Y + b * bytes);
  });
  return out;
}

}  // namespace

void bind_kquants(pybind11::module& m) {
  m.def("quantize_k", &quantize_k, pybind11::arg("x"), pybind11::arg("kind"),
        "super-blocks x (B, 256) fp32 -> (B, bytes) uint8 blocks of K-quant `kind` (kquants.py's rules)");
  m.def("quantize_iq4", &quantize_iq4, pybind11::arg("x"), pybind11::arg("kind"),
        "blocks x (B, 32 / 256) fp32 -> (B, bytes) uint8 blocks of IQ4_NL / IQ4_XS (iquants.py's rules)");
  m.def("quantize_weighted", &quantize_weighted, pybind11::arg("w"), pybind11::arg("kind"),
        pybind11::arg("importance"),
        "rows w (N, K) fp32, importance (K,) -> (N, row bytes) uint8 blocks of `kind`, weighted (weighted.py's rules)");
}

}  // namespace llmkit
