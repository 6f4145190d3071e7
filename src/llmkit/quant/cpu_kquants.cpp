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
LLMKIT_EXACT void fit_levels(const float* x, int n, int nmax, float iscale, int8_t* levels, float& sum_lx,
                             float& sum_l2) {
  sum_lx = 0;
  sum_l2 = 0;
  for (int i = 0; i < n; ++i) {
    const float l = std::clamp(nearest(iscale * x[i]), static_cast<float>(-nmax), static_cast<float>(nmax - 1));
    levels[i] = static_cast<int8_t>(l);
    const float w = x[i] * x[i];
    sum_lx += w * x[i] * l;
    sum_l2 += w * l * l;
  }
}

// make_qx_quants, rmse_type 1: codes 0..2 nmax - 1 of w = scale (q - nmax); returns scale
LLMKIT_EXACT float signed_scale(const float* x, int n, int nmax, uint8_t* L) {
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
  int8_t levels[16], trial[16];
  float sum_lx, sum_l2;
  fit_levels(x, n, nmax, static_cast<float>(-nmax) / peak, levels, sum_lx, sum_l2);
  float scale = sum_l2 != 0 ? sum_lx / sum_l2 : 0.f;
  float best = scale * sum_lx;
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    fit_levels(x, n, nmax, -(static_cast<float>(nmax) + 0.1f * static_cast<float>(step)) / peak, trial, sum_lx, sum_l2);
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
  const uint16_t d16 = half_bits(max_scale / 15.f), dmin16 = half_bits(max_min / 15.f);
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

// Q3_K (kquants._q3_k): 16 sub-blocks of 16, signed 6-bit scales against one fp16 d, 3-bit codes (a high bit apart)
LLMKIT_EXACT void q3_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  float scales[16], amax = 0, peak = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = q3_search(x + 16 * j, L + 16 * j);
    if (std::fabs(scales[j]) > amax) amax = std::fabs(scales[j]), peak = scales[j];
  }
  std::memset(out, 0, 110);
  uint8_t *hmask = out, *sc = out + 96;
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
  const uint16_t d16 = half_bits(max_scale / 63.f), dmin16 = half_bits(max_min / 63.f);
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

void q4_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  k4(x, 15, -1.f, 20, out, L);
  uint8_t* qs = out + 16;
  for (int run = 0; run < 4; ++run) {
    for (int l = 0; l < 32; ++l) qs[32 * run + l] = L[64 * run + l] | (L[64 * run + 32 + l] << 4);
  }
}

void q5_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  k4(x, 31, -0.5f, 15, out, L);
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

LLMKIT_EXACT void q6_k(const float* x, uint8_t* out) {
  uint8_t L[QK];
  float scales[16];
  float peak = 0, amax = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = signed_scale(x + 16 * j, 16, 32, L + 16 * j);
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

// a block of 32's least-squares scale after the 15 tries (iquants._block_scales)
LLMKIT_EXACT float iq4_scale(const float* x) {
  float w[32], amax = 0.f, top = 0.f;
  for (int j = 0; j < 32; ++j) {
    w[j] = x[j] * x[j];
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

LLMKIT_EXACT void iq4_xs(const float* x, uint8_t* out) {  // 256 weights -> fp16 d, 2 + 4 bytes of scales, 128
  float scales[8], top = 0.f, amax = 0.f;
  for (int b = 0; b < 8; ++b) {
    scales[b] = iq4_scale(x + 32 * b);
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
}

}  // namespace llmkit
