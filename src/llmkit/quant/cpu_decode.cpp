// Pre-norm decoder blocks' decode step in one C++ call (llmkit/quant/native_step.py drives it).
//
// Decoding one token runs about twenty small operations per block (norm, three projections, RoPE, a cache write,
// attention over the cached keys, the output projection, a residual, norm, the feed-forward's three projections, a
// residual). From Python each costs 5-50 us of dispatch, so a 30-layer model at batch 1 spends more time calling
// than computing. Here the same arithmetic runs in one call for all the blocks, over fp32 activations:
//
//   x (B, C) ─► norm ─► [wq | wk | wv] (one pass) ─► (QK-norm,) RoPE on q, k ─► k, v into each row's cache slot
//            ─► each query head attends to its kv head's visible slots ─► wo ─► + x
//            ─► norm ─► [w1 | w3] (one pass) ─► act(gate) * up ─► w2 ─► + x
//                       (or a mixture of experts: the router's top-k experts per row, each as above; cpu_moe.cpp)
//
// Projections are int4 or int8 codes (cpu_kernel.cpp's Product, x quantized once per group of projections) or
// fp32 matrices (cpu_kernel.cpp's float_columns).
//
// Threads: a step runs inside one OpenMP parallel region of torch's thread count, as llama.cpp's graph does. The
// serial parts (norms, RoPE, residuals, quantizing x) run on thread 0; products and attention split their output
// columns / heads over every thread; barriers separate the phases. Starting the threads once per step instead of
// once per product saves ~150 fork-joins per token on a 30-layer model.
//
// Caches: a contiguous KVCache (generate) or the serving engine's paged pools with a block table (KVLayout), of
// fp32 entries or int8 codes with a scale each (the serving engine's --kv-dtype int8).
// Query rows and cache rows: each of the step's M query rows reads and writes one cache row. Usually M = B, one new
// token per sequence; a contiguous cache also takes T > 1 new tokens per sequence (M = B T, query row b T + t in
// slot `slot + t` of cache row b), the few tokens a speculative round verifies: each weight is read once for all of
// them, and token t sees tokens < t of its own round through the cache, as the causal rule says.
// The result equals the PyTorch modules' up to float rounding (tests/quant/test_native_decode.py).
// Shapes: M query rows, B cache rows, C model width, H query heads, KH kv heads, D head dim, Dv value head dim,
// S logical cache slots a row, F feed-forward width, N blocks in a pool of blocks of bs slots.

#include "cpu_step.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include <omp.h>

namespace {

using namespace llmkit::step;

// Where a layer's cached keys and values live: row b's slot s of kv head g is entry index(b, g, s): element
// index * D of k (index * Dv of v). Either a contiguous cache, k (B, KH, S, D), or a paged pool, k (KH, N, bs, D)
// with a block table (B, nb) of each row's physical blocks (llmkit/serve/paged.py's heads-first layout). The
// entries are fp32, or int8 codes with one fp32 scale an entry (k8, ks: (.., D) and (..) of the same layout), the
// codes round(x / scale) with scale = max |x| / 127 (llmkit/layers/attention/cache.py's quantize_kv, which the
// PyTorch paths write with: a key gets the same codes from either).
struct KVLayout {
  float* k = nullptr;
  float* v = nullptr;
  int64_t KH = 0, S = 0;                                // contiguous
  const int64_t* table = nullptr;                       // paged
  int64_t N = 0, bs = 1, nb = 0;
  int8_t* k8 = nullptr;                                 // int8 entries (then k, v are null)
  int8_t* v8 = nullptr;
  float* ks = nullptr;
  float* vs = nullptr;

  int64_t index(int64_t b, int64_t g, int64_t s) const {
    if (table == nullptr) return (b * KH + g) * S + s;
    return (g * N + table[b * nb + s / bs]) * bs + s % bs;
  }

  // a new token's key (D) and value (Dv) into entry `at`
  void put(int64_t at, const float* key, int64_t D, const float* value, int64_t Dv) const {
    if (k8 == nullptr) {
      std::memcpy(k + at * D, key, D * sizeof(float));
      std::memcpy(v + at * Dv, value, Dv * sizeof(float));
      return;
    }
    ks[at] = quantize_row(key, D, k8 + at * D);
    vs[at] = quantize_row(value, Dv, v8 + at * Dv);
  }

  // q . the key of entry `at`
  float key_dot(const float* q, int64_t at, int64_t D) const {
    return k8 == nullptr ? dot(q, k + at * D, D) : dot_codes(q, k8 + at * D, D) * ks[at];
  }

  // acc (8 NV) += p times the value of entry `at`
  template <int NV>
  void add_value(__m256* acc, float p, int64_t at) const {
    if (k8 == nullptr) {
      const __m256 w = _mm256_set1_ps(p);
      const float* row = v + at * (8 * NV);
      for (int d = 0; d < NV; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * d), acc[d]);
      return;
    }
    const __m256 w = _mm256_set1_ps(p * vs[at]);
    const int8_t* row = v8 + at * (8 * NV);
    for (int d = 0; d < NV; ++d) acc[d] = _mm256_fmadd_ps(w, codes8(row + 8 * d), acc[d]);
  }

  // the value of entry `at`, element d (the paths for value heads other than 64 or 128 wide)
  float value(int64_t at, int64_t Dv, int64_t d) const {
    return k8 == nullptr ? v[at * Dv + d] : vs[at] * static_cast<float>(v8[at * Dv + d]);
  }

  // x (n) -> codes round(x / scale) (ties to even, as torch.round), returns scale = max |x| / 127 (0 for zeros)
  static float quantize_row(const float* x, int64_t n, int8_t* codes) {
    float top = 0.f;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, std::fabs(x[i]));
    const float scale = top / 127.f, d = scale > 0.f ? scale : 1.f;
    for (int64_t i = 0; i < n; ++i)
      codes[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / d), -127.f, 127.f));
    return scale;
  }

  // the codes (width each) of entries at[0 .. n) of `codes` as floats, one entry after another, into out
  static void codes_of(const int8_t* codes, int64_t width, const int64_t* at, int64_t n, std::vector<float>& out) {
    out.resize(n * width);
    for (int64_t j = 0; j < n; ++j) {
      const int8_t* c = codes + at[j] * width;
      float* o = out.data() + j * width;
      int64_t d = 0;
      for (; d + 8 <= width; d += 8) _mm256_storeu_ps(o + d, codes8(c + d));
      for (; d < width; ++d) o[d] = static_cast<float>(c[d]);
    }
  }

  // 8 int8 codes as floats
  static __m256 codes8(const int8_t* c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
  }

  // a . codes (n), summed as `dot` sums
  static float dot_codes(const float* a, const int8_t* c, int64_t n) {
    return dot_of(a, n, [c](int64_t i) { return codes8(c + i); }, [c](int64_t i) { return static_cast<float>(c[i]); });
  }
};

// Per-request LoRA adapters in a step (llmkit/serve/adapters.py): for each projection that an adapter of the step
// targets, the step's k adapters' A (k + 1, r, K) and B (k + 1, N, r) stacked (B times alpha / r, ranks padded with
// zeros, the last pair zero), and each query row's adapter which[m] (k: the base's rows, which are skipped). A
// block's projections in the order wq, wk, wv, wo, w1, w3, w2; a = nullptr where no adapter targets one.
struct LowRank {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t r = 0;
};
enum Target { Q = 0, K_ = 1, V_ = 2, O = 3, UP = 4, GATE_UP = 5, DOWN = 6, TARGETS = 7 };
struct Adapted {
  const int64_t* which = nullptr;  // (M,)
  int64_t base = 0;                // k
  std::vector<std::array<LowRank, TARGETS>> blocks;
};

struct DecodeBlock {
  // norms before attention (1) and the feed-forward (2): RMSNorm, or LayerNorm (bias optional)
  bool rms = true;
  double eps = 1e-6;
  Tensor norm1_weight, norm2_weight;
  std::optional<Tensor> norm1_bias, norm2_bias;
  // attention
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0, v_head_dim = 0;
  int64_t rope_dim = 0;           // the first rope_dim dims of each q / k head rotate (0: no RoPE)
  bool rope_interleaved = false;  // pairs (2i, 2i + 1); else (i, i + rope_dim / 2)
  int64_t window = 0;             // sliding window in slots (0: none)
  double scale = 1.0;
  ProjectionPtr wq, wk, wv, wo;
  // QK-norm (Qwen3): an RMSNorm over each query / key head's D dims, one gain (D,) per projection, before RoPE
  std::optional<Tensor> q_norm_weight, k_norm_weight;
  double qk_eps = 1e-6;
  // feed-forward: w2(act(w1 x) * w3 x) when gated (SwiGLU / GeGLU), else w2(act(w1 x)); or, when `moe` is set,
  // a mixture of experts (cpu_moe.cpp) and no w1, w2, w3
  bool gated = true;
  int activation = SILU;
  ProjectionPtr w1, w2, w3;
  std::shared_ptr<MoEFeedForward> moe;

  void norm(const float* x, float* h, int64_t M, int64_t C, const Tensor& w, const std::optional<Tensor>& b) const {
    const float* W = w.data_ptr<float>();
    const float* Bv = b ? b->data_ptr<float>() : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * C;
      float* hr = h + m * C;
      if (rms) {
        double ss = 0;
        for (int64_t c = 0; c < C; ++c) ss += static_cast<double>(xr[c]) * xr[c];
        const float r = 1.f / std::sqrt(static_cast<float>(ss / C) + static_cast<float>(eps));
        for (int64_t c = 0; c < C; ++c) hr[c] = W[c] * (xr[c] * r);
      } else {
        double s = 0, ss = 0;
        for (int64_t c = 0; c < C; ++c) s += xr[c];
        const double mean = s / C;
        for (int64_t c = 0; c < C; ++c) ss += (xr[c] - mean) * (xr[c] - mean);
        const float r = 1.f / std::sqrt(static_cast<float>(ss / C) + static_cast<float>(eps));
        for (int64_t c = 0; c < C; ++c)
          hr[c] = (xr[c] - static_cast<float>(mean)) * r * W[c] + (Bv ? Bv[c] : 0.f);
      }
    }
  }

  // RMSNorm of one head's D values in place, gain g (D,) (QK-norm)
  void head_norm(float* v, const float* g) const {
    const int64_t D = head_dim;
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(v[d]) * v[d];
    const float r = 1.f / std::sqrt(static_cast<float>(ss / D) + static_cast<float>(qk_eps));
    for (int64_t d = 0; d < D; ++d) v[d] = g[d] * (v[d] * r);
  }

  // rotate the first rope_dim dims of one head by the angles whose cos and sin are c, s (rope_dim / 2 each)
  void rotate(float* v, const float* c, const float* s) const {
    const int64_t F = rope_dim / 2;
    for (int64_t i = 0; i < F; ++i) {
      const int64_t ia = rope_interleaved ? 2 * i : i, ib = rope_interleaved ? 2 * i + 1 : i + F;
      const float a = v[ia], b = v[ib];
      v[ia] = a * c[i] - b * s[i];
      v[ib] = b * c[i] + a * s[i];
    }
  }

  // Arguments of one step, checked before the threads start: x (M, C), k and v caches of B rows (contiguous
  // (B, KH, S, D) or, with `paged`, pools (KH, N, bs, D)), fp32 or int8 codes with scales ks, vs (k's and v's shape
  // without D), allowed (B, S) over each row's S logical slots, cos and sin (1 | M, rope_dim / 2).
  void check_step(const Tensor& x, int64_t B, const Tensor& k, const Tensor& v, const Tensor* ks, const Tensor* vs,
                  bool paged, int64_t S, const Tensor& allowed, const std::optional<Tensor>& cos,
                  const std::optional<Tensor>& sin) const {
    LLMKIT_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                    x.size(1) == norm1_weight.size(0),
                "x must be (M, C) fp32");
    const int64_t M = x.size(0);
    const auto entry = ks != nullptr ? torch::kInt8 : torch::kFloat32;
    for (const Tensor* t : {&k, &v})
      LLMKIT_CHECK(t->dim() == 4 && t->scalar_type() == entry && t->is_contiguous() &&
                      t->size(paged ? 0 : 1) == n_kv_heads && (paged || (t->size(0) == B && t->size(2) == S)),
                  paged ? "the pools must be (KH, N, bs, D) contiguous, fp32 (int8 with scales)"
                        : "the caches must be (B, KH, S, D) contiguous, fp32 (int8 with scales)");
    if (ks != nullptr)
      for (const auto& [t, s] : {std::pair{&k, ks}, std::pair{&v, vs}})
        LLMKIT_CHECK(s->dim() == 3 && s->scalar_type() == torch::kFloat32 && s->is_contiguous() &&
                        s->sizes().equals(t->sizes().slice(0, 3)),
                    "an int8 cache's scales must be its shape without the head dim, fp32, contiguous");
    LLMKIT_CHECK(k.size(3) == head_dim && v.size(3) == v_head_dim, "cache head dims do not match the layer");
    LLMKIT_CHECK(allowed.dim() == 2 && allowed.size(0) == B && allowed.size(1) == S &&
                    allowed.scalar_type() == torch::kBool && allowed.is_contiguous(),
                "allowed must be (B, S) bool");
    if (rope_dim)
      LLMKIT_CHECK(cos && sin && cos->dim() == 2 && cos->sizes() == sin->sizes() && cos->size(1) == rope_dim / 2 &&
                      (cos->size(0) == 1 || cos->size(0) == M) && cos->is_contiguous() && sin->is_contiguous() &&
                      cos->scalar_type() == torch::kFloat32 && sin->scalar_type() == torch::kFloat32,
                  "cos and sin must be (1 | M, rope_dim / 2) fp32");
  }

  // Buffers one step of a block passes between its phases (shared by the threads).
  struct Workspace {
    std::vector<float> h, qkv, att, y, gate_up, hidden, low;  // low: adapters' A x (add_low_rank)
    ProjectionGroup group, given;  // the step's generated tokens' rows, and its given ones' (a prompt's)
    std::shared_ptr<MoEWorkspace> moe = moe_workspace();
  };

  // x (M, C) += this block's output, for query row m's new token in logical slot slots[m] of cache row rows[m] of
  // `kv`; A (B, S): the slots each cache row may see; rows from `given_from` on hold given tokens (a prompt's),
  // whose products are integer panels. Called by every thread of the team (the barriers are the team's); thread 0
  // does the serial parts.
  void forward(const Team& team, Workspace& w, float* X, int64_t M, int64_t given_from, const KVLayout& kv,
               const int64_t* rows, const int64_t* slots, int64_t S, const bool* A, const std::optional<Tensor>& cos,
               const std::optional<Tensor>& sin, const Adapted* adapted, const LowRank* low) const {
    const int64_t C = norm1_weight.size(0), H = n_heads, KH = n_kv_heads, D = head_dim, Dv = v_head_dim;
    const int64_t Nq = H * D, Nqkv = Nq + KH * D + KH * Dv;
    const bool lead = team.id == 0;
    // ---- attention: norm, q | k | v
    if (lead) {
      w.h.resize(M * C), w.qkv.resize(M * Nqkv), w.att.assign(M * H * Dv, 0.f), w.y.resize(M * C);
      norm(X, w.h.data(), M, C, norm1_weight, norm1_bias);
    }
    project(team, w, {wq.get(), wk.get(), wv.get()}, w.h, M, given_from, w.qkv, Nqkv);
    if (adapted) add_low_rank(team, w, *adapted, {low[Q], low[K_], low[V_]}, {wq->N, wk->N, wv->N}, w.h.data(), C, M,
                              w.qkv.data(), Nqkv);
    if (lead) {  // (QK-norm,) RoPE on q and k, k and v into the cache
      for (int64_t b = 0; b < M; ++b) {
        float* row = w.qkv.data() + b * Nqkv;
        if (q_norm_weight) {
          const float* gq = q_norm_weight->data_ptr<float>();
          const float* gk = k_norm_weight->data_ptr<float>();
          for (int64_t hh = 0; hh < H + KH; ++hh) head_norm(row + hh * D, hh < H ? gq : gk);
        }
        if (rope_dim) {
          const int64_t r = cos->size(0) == 1 ? 0 : b;
          const float* c = cos->data_ptr<float>() + r * (rope_dim / 2);
          const float* s = sin->data_ptr<float>() + r * (rope_dim / 2);
          for (int64_t hh = 0; hh < H + KH; ++hh) rotate(row + hh * D, c, s);  // q heads, then k heads
        }
        for (int64_t g = 0; g < KH; ++g) {
          kv.put(kv.index(rows[b], g, slots[b]), row + Nq + g * D, D, row + Nq + KH * D + g * Dv, Dv);
        }
      }
    }
#pragma omp barrier
    {  // each (row, query head) pair over the visible slots of its kv head: softmax(q k / sqrt(D)) v; the rows of
       // one cache row (a prompt's chunk, a round's drafts) a tile at a time, with the same bits (attend_tile)
      thread_local std::vector<float> p;
      thread_local std::vector<int64_t> seen;
      const std::vector<AttentionUnit> units = attention_units(kv, rows, M, S, A);
      const auto [u0, u1] = team.share(static_cast<int64_t>(units.size()));
      for (int64_t u = u0; u < u1; ++u) {
        const AttentionUnit& unit = units[u];
        if (unit.head < 0) {
          attend_tile(w.qkv.data(), Nqkv, kv, rows[unit.b0], unit.g, unit.b0, unit.b1, slots, A + rows[unit.b0] * S,
                      w.att.data());
          continue;
        }
        const int64_t b = unit.b0, r = rows[b], hh = unit.head, g = hh / (H / KH), slot = slots[b];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, slot - window + 1) : 0, n = slot - lo + 1;
        p.resize(n), seen.resize(n);
        const float* q = w.qkv.data() + b * Nqkv + hh * D;
        float* o = w.att.data() + (b * H + hh) * Dv;
        attend(q, kv, r, g, lo, n, A + r * S, p.data(), seen.data(), o);
      }
    }
#pragma omp barrier
    project(team, w, {wo.get()}, w.att, M, given_from, w.y, C);
    if (adapted) add_low_rank(team, w, *adapted, {low[O]}, {C}, w.att.data(), H * Dv, M, w.y.data(), C);
    // ---- feed-forward: residual, norm, w1 | w3, act(gate) * up (or act(h)), w2, residual
    if (lead) {
      for (int64_t i = 0; i < M * C; ++i) X[i] += w.y[i];
      norm(X, w.h.data(), M, C, norm2_weight, norm2_bias);
    }
    if (moe) {
#pragma omp barrier
      moe_forward(*moe, team, *w.moe, w.h.data(), X, M, C);
#pragma omp barrier
      return;
    }
    const int64_t Fw = w1->N, width = gated ? 2 * Fw : Fw;
    if (lead) w.gate_up.resize(M * width), w.hidden.resize(M * Fw);
    if (gated)
      project(team, w, {w1.get(), w3.get()}, w.h, M, given_from, w.gate_up, width);
    else
      project(team, w, {w1.get()}, w.h, M, given_from, w.gate_up, width);
    if (adapted)
      add_low_rank(team, w, *adapted, {low[UP], gated ? low[GATE_UP] : LowRank{}}, {Fw, gated ? Fw : 0}, w.h.data(), C,
                   M, w.gate_up.data(), width);
    {  // act(gate) * up, each thread its share of the rows' columns (project's barrier made gate_up visible)
      const auto [f0, f1] = team.share(Fw);
      for (int64_t b = 0; b < M; ++b) {
        const float* row = w.gate_up.data() + b * width;
        activate_rows(row + f0, gated ? row + Fw + f0 : nullptr, w.hidden.data() + b * Fw + f0, f1 - f0, activation);
      }
    }
#pragma omp barrier
    project(team, w, {w2.get()}, w.hidden, M, given_from, w.y, C);
    if (adapted) add_low_rank(team, w, *adapted, {low[DOWN]}, {C}, w.hidden.data(), Fw, M, w.y.data(), C);
    if (lead)
      for (int64_t i = 0; i < M * C; ++i) X[i] += w.y[i];
#pragma omp barrier
  }

  // y (M, width) += the adapted rows' low-rank updates of projections side by side in y (as project wrote them,
  // widths Ns, each with its LowRank or none), over their input x (M, K): first h = A x for each (row, projection)
  // pair, shared by the team; then B h, the team splitting y's columns. A row's update is computed in the same
  // order whatever the rows beside it. Called after project's last barrier; ends with one.
  void add_low_rank(const Team& team, Workspace& w, const Adapted& ad, const std::vector<LowRank>& ranks,
                    const std::vector<int64_t>& Ns, const float* x, int64_t K, int64_t M, float* y,
                    int64_t width) const {
    const int64_t P = static_cast<int64_t>(ranks.size());
    int64_t R = 0;
    for (const LowRank& lr : ranks) R = std::max(R, lr.a ? lr.r : 0);
    if (R == 0) return;  // no adapter of the step targets these projections
    thread_local std::vector<int64_t> adapted;  // the rows with an adapter
    adapted.clear();
    for (int64_t m = 0; m < M; ++m)
      if (ad.which[m] != ad.base) adapted.push_back(m);
    const int64_t n = static_cast<int64_t>(adapted.size());
    if (n == 0) return;
    if (team.id == 0) w.low.resize(n * P * R);
#pragma omp barrier
    {  // h[(i P + p) R + j] = A_p[which] row j . x[row i]
      const auto [u0, u1] = team.share(n * P);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t i = u / P, p = u % P, m = adapted[i];
        const LowRank& lr = ranks[p];
        if (!lr.a) continue;
        const float* a = lr.a + ad.which[m] * lr.r * K;
        for (int64_t j = 0; j < lr.r; ++j) w.low[u * R + j] = dot(a + j * K, x + m * K, K);
      }
    }
#pragma omp barrier
    {  // y[m, column] += B_p[which] row (column - offset_p) . h
      const auto [c0, c1] = team.share(width);
      int64_t offset = 0;
      for (int64_t p = 0; p < P; offset += Ns[p], ++p) {
        const LowRank& lr = ranks[p];
        const int64_t lo = std::max(c0, offset), hi = std::min(c1, offset + Ns[p]);
        if (!lr.a || lo >= hi) continue;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t m = adapted[i];
          const float* b = lr.b + ad.which[m] * Ns[p] * lr.r;
          const float* h = w.low.data() + (i * P + p) * R;
          for (int64_t c = lo; c < hi; ++c) y[m * width + c] += dot(b + (c - offset) * lr.r, h, lr.r);
        }
      }
    }
#pragma omp barrier
  }

  // What the team's threads share out in attention: one (row, query head) pair (head >= 0), or a tile (head -1):
  // rows [b0, b1) of one cache row against kv head g, every query head of the group.
  struct AttentionUnit {
    int64_t b0, b1, g, head;
  };

  // Consecutive query rows that read one cache (up to about 32 queries a tile) where there is no window and the
  // value heads are 64 or 128 wide (weigh_values'); the other rows a pair at a time. The same for every thread.
  std::vector<AttentionUnit> attention_units(const KVLayout& kv, const int64_t* rows, int64_t M, int64_t S,
                                             const bool* A) const {
    const int64_t H = n_heads, KH = n_kv_heads, group = H / KH;
    const int64_t most = std::max<int64_t>(1, 32 / group);  // rows a tile
    const bool tiles = window == 0 && (v_head_dim == 64 || v_head_dim == 128);
    // the same cache: one cache row, or (the serving engine's tokens, each a row of its own) the same blocks and
    // the same visible slots
    const auto same = [&](int64_t a, int64_t b) {
      const int64_t ra = rows[a], rb = rows[b];
      if (ra == rb) return true;
      if (kv.table == nullptr) return false;
      return std::memcmp(kv.table + ra * kv.nb, kv.table + rb * kv.nb, kv.nb * sizeof(int64_t)) == 0 &&
             std::memcmp(A + ra * S, A + rb * S, S * sizeof(bool)) == 0;
    };
    std::vector<AttentionUnit> units;
    for (int64_t b = 0; b < M;) {
      int64_t e = b + 1;
      while (tiles && e < M && e - b < most && same(b, e)) ++e;
      if (e - b > 1) {
        for (int64_t g = 0; g < KH; ++g) units.push_back({b, e, g, -1});
      } else {
        for (int64_t hh = 0; hh < H; ++hh) units.push_back({b, b + 1, hh / group, hh});
      }
      b = e;
    }
    return units;
  }

  // Query rows [b0, b1), all of cache row r, each query head of kv head g: what `attend` gives each (row, head) pair,
  // to the bit, with each key and value read once for the tile instead of once a query (a prompt's chunk at a long
  // context read them again for every token, from memory). Each query's scores, maximum, exponentials, sums and
  // weighted values are computed in attend's order: the tile only shares the loads. Window 0 (lo = 0) and Dv 64 or
  // 128 (attention_units).
  void attend_tile(const float* qkv, int64_t Nqkv, const KVLayout& kv, int64_t r, int64_t g, int64_t b0, int64_t b1,
                   const int64_t* slots, const bool* allowed, float* att) const {
    const int64_t H = n_heads, D = head_dim, Dv = v_head_dim, group = H / n_kv_heads, Q = (b1 - b0) * group;
    const float sc = static_cast<float>(scale);
    thread_local std::vector<int64_t> seen, at;  // visible slots (cache indices, slot numbers), in slot order
    thread_local std::vector<float> p, acc;
    thread_local std::vector<int64_t> m;  // per query: how many of them it sees
    int64_t last = 0;
    for (int64_t b = b0; b < b1; ++b) last = std::max(last, slots[b]);
    seen.clear(), at.clear();
    for (int64_t s = 0; s <= last; ++s)
      if (allowed[s]) seen.push_back(kv.index(r, g, s)), at.push_back(s);
    const int64_t n = static_cast<int64_t>(seen.size());
    p.resize(Q * n), m.resize(Q), acc.assign(Q * Dv, 0.f);
    const auto query = [&](int64_t i) { return qkv + (b0 + i / group) * Nqkv + (g * group + i % group) * D; };
    for (int64_t i = 0; i < Q; ++i)
      m[i] = std::upper_bound(at.begin(), at.end(), slots[b0 + i / group]) - at.begin();
    constexpr int64_t KEYS = 16;  // keys (then values) in L1 for every query of the tile
    // an int8 cache's codes of those keys (values) as floats, converted once for the tile's queries: exact, and
    // multiplied in key_dot's (add_value's) order, so the bits stay attend's
    thread_local std::vector<float> codes;
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
      const int64_t j1 = std::min(j0 + KEYS, n);
      if (kv.k8) kv.codes_of(kv.k8, D, seen.data() + j0, j1 - j0, codes);
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t j = j0; j < std::min(j1, m[i]); ++j)
          p[i * n + j] = (kv.k8 ? dot(query(i), codes.data() + (j - j0) * D, D) * kv.ks[seen[j]]
                                : dot(query(i), kv.k + seen[j] * D, D)) * sc;
    }
    std::vector<float> total(Q, 0.f);
    for (int64_t i = 0; i < Q; ++i) {
      if (m[i] == 0) continue;  // no visible key: zeros
      float* pi = p.data() + i * n;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < m[i]; ++j) top = std::max(top, pi[j]);
      total[i] = softmax_weights(pi, m[i], top);
    }
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
      if (kv.v8) kv.codes_of(kv.v8, Dv, seen.data() + j0, std::min(j0 + KEYS, n) - j0, codes);
      const float* values = kv.v8 ? codes.data() : nullptr;
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t j1 = std::min(j0 + KEYS, m[i]);
        if (Dv == 64)
          weigh_block<8>(kv, seen.data(), j0, j1, p.data() + i * n, acc.data() + i * Dv, values);
        else
          weigh_block<16>(kv, seen.data(), j0, j1, p.data() + i * n, acc.data() + i * Dv, values);
      }
    }
    const int NV = static_cast<int>(Dv / 8);
    for (int64_t i = 0; i < Q; ++i) {
      if (m[i] == 0) continue;
      const __m256 inv = _mm256_set1_ps(1.f / total[i]);
      float* o = att + ((b0 + i / group) * H + g * group + i % group) * Dv;
      const float* a = acc.data() + i * Dv;
      for (int d = 0; d < NV; ++d) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(a + 8 * d), inv));
    }
  }

  // a (8 NV) += sum_j p[j] v_j over entries [j0, j1), in order, in registers: weigh_values' operations, resumed.
  // `codes`: an int8 cache's codes of entries j0 .. as floats (codes_of), else null.
  template <int NV>
  static void weigh_block(const KVLayout& kv, const int64_t* seen, int64_t j0, int64_t j1, const float* p, float* a,
                          const float* codes) {
    if (j0 >= j1) return;
    __m256 acc[NV];
    for (int d = 0; d < NV; ++d) acc[d] = _mm256_loadu_ps(a + 8 * d);
    if (codes == nullptr) {
      for (int64_t j = j0; j < j1; ++j) kv.add_value<NV>(acc, p[j], seen[j]);
    } else {
      for (int64_t j = j0; j < j1; ++j) {  // add_value's int8 arithmetic
        const __m256 w = _mm256_set1_ps(p[j] * kv.vs[seen[j]]);
        const float* row = codes + (j - j0) * (8 * NV);
        for (int d = 0; d < NV; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * d), acc[d]);
      }
    }
    for (int d = 0; d < NV; ++d) _mm256_storeu_ps(a + 8 * d, acc[d]);
  }

  // p[j] = exp(p[j] - top) for the m scores; returns their sum (8 lanes, then the rest, then the lanes' sum)
  static float softmax_weights(float* p, int64_t m, float top) {
    const __m256 t8 = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), t8));
      _mm256_storeu_ps(p + j, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float total = 0.f;
    for (; j < m; ++j) total += (p[j] = std::exp(p[j] - top));
    alignas(32) float parts[8];
    _mm256_store_ps(parts, sum8);
    for (const float v : parts) total += v;
    return total;
  }

  // o (Dv) = softmax over the slots lo..lo + n - 1 of cache row r, kv head g, that `allowed` (S, the row's mask)
  // lets it see, of q . k / sqrt(D), times their values; p and seen: buffers of n. The visible slots are gathered
  // first, so the arithmetic (which keys share a lane of the vector sums) depends only on the visible keys in order:
  // left padding, the slots of rejected drafts and the window's start change nothing. A query then gets the same bits
  // decoded alone, in a batch, in a prompt's chunk or among a round's drafts. No visible slot: zeros.
  void attend(const float* q, const KVLayout& kv, int64_t r, int64_t g, int64_t lo, int64_t n, const bool* allowed,
              float* p, int64_t* seen, float* o) const {
    const int64_t D = head_dim, Dv = v_head_dim;
    const float sc = static_cast<float>(scale);
    float top = -std::numeric_limits<float>::infinity();
    int64_t m = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = lo + j;
      if (!allowed[s]) continue;
      seen[m] = kv.index(r, g, s);
      p[m] = kv.key_dot(q, seen[m], D) * sc;
      top = std::max(top, p[m++]);
    }
    if (m == 0) return;  // no visible key: zeros
    const float total = softmax_weights(p, m, top);
    if (Dv == 64) return weigh_values<8>(kv, seen, m, p, total, o);
    if (Dv == 128) return weigh_values<16>(kv, seen, m, p, total, o);
    for (int64_t jj = 0; jj < m; ++jj)
      for (int64_t d = 0; d < Dv; ++d) o[d] += p[jj] * kv.value(seen[jj], Dv, d);
    const float inv = 1.f / total;
    for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
  }

  // o (8 NV) = sum_j p[j] v_j / total over the m visible entries (value rows seen[j]; NV accumulators in registers)
  template <int NV>
  static void weigh_values(const KVLayout& kv, const int64_t* seen, int64_t m, const float* p, float total, float* o) {
    __m256 acc[NV];
    for (int d = 0; d < NV; ++d) acc[d] = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; ++j) kv.add_value<NV>(acc, p[j], seen[j]);
    const __m256 inv = _mm256_set1_ps(1.f / total);
    for (int d = 0; d < NV; ++d) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(acc[d], inv));
  }

  // y (B, width) = the projections ps of x (B rows), side by side, by the whole team: thread 0 prepares (quantizes
  // x), every thread computes its share of the columns, thread 0 adds the biases. Rows from `given_from` on in
  // integer panels (ProjectionGroup), the others in the decoding kernels. Only thread 0 touches y after it returns,
  // until the next barrier. The buffers are read after the barrier: thread 0 may have just resized them.
  void project(const Team& team, Workspace& w, const std::vector<const Projection*>& ps, const std::vector<float>& x,
               int64_t B, int64_t given_from, std::vector<float>& y, int64_t width) const {
    if (team.id == 0) {
      std::vector<Matrix> ms;
      for (const Projection* p : ps) ms.push_back(p->all());
      if (given_from > 0) w.group.prepare(ms, x.data(), given_from);
      if (given_from < B) w.given.prepare(ms, x.data() + given_from * ps[0]->K, B - given_from, true);
    }
#pragma omp barrier
    if (given_from > 0) w.group.compute(team, y.data(), width);
    if (given_from < B) w.given.compute(team, y.data() + given_from * width, width);
#pragma omp barrier
    bool biased = false;
    for (const Projection* p : ps) biased = biased || p->bias.has_value();
    if (!biased) return;
    if (team.id == 0) {  // the biases
      int64_t offset = 0;
      for (const Projection* p : ps) {
        if (p->bias) {
          const float* b = p->bias->data_ptr<float>();
          for (int64_t m = 0; m < B; ++m)
            for (int64_t n = 0; n < p->N; ++n) y[m * width + offset + n] += b[n];
        }
        offset += p->N;
      }
    }
    // every thread waits for them: the feed-forward's activation reads its share of y at once on every thread (a
    // biased w1, GPT-2's, was read half without its bias before this barrier; the same for every projection)
#pragma omp barrier
  }

  // every projection's tiled scales up to date (Projection::refresh_tiles), before a step
  void refresh_tiles() const {
    for (const ProjectionPtr& p : {wq, wk, wv, wo, w1, w2, w3})
      if (p) p->refresh_tiles();
    if (moe)
      for (const ProjectionPtr& p : {moe->w1, moe->w3, moe->w2, moe->s1, moe->s3, moe->s2})
        if (p) p->refresh_tiles();
  }

  // the shapes the projections must have, checked once when the block is built
  void check() const {
    LLMKIT_CHECK(wq && wk && wv && wo && (moe || (w1 && w2 && (!gated || w3))), "a projection is missing");
    LLMKIT_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, "bad head counts");
    LLMKIT_CHECK(rope_dim % 2 == 0 && rope_dim <= head_dim, "bad rope_dim");
    LLMKIT_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(), "QK-norm needs both gains");
    for (const auto* g : {&q_norm_weight, &k_norm_weight})
      if (g->has_value())
        LLMKIT_CHECK((*g)->dim() == 1 && (*g)->size(0) == head_dim && (*g)->scalar_type() == torch::kFloat32 &&
                        (*g)->is_contiguous(),
                    "a QK-norm gain must be (head_dim,) fp32");
    const int64_t C = norm1_weight.size(0);
    LLMKIT_CHECK(wq->N == n_heads * head_dim && wk->N == n_kv_heads * head_dim && wv->N == n_kv_heads * v_head_dim,
                "q, k, v widths do not match the heads");
    LLMKIT_CHECK(wq->K == C && wk->K == C && wv->K == C && wo->K == n_heads * v_head_dim && wo->N == C,
                "attention projections do not match the model width");
    if (moe)
      moe_check(*moe, C);
    else
      LLMKIT_CHECK(w1->K == C && w2->N == C && w2->K == w1->N && (!gated || (w3->K == C && w3->N == w1->N)),
                  "feed-forward projections do not match");
  }
};

// x (M, C) through every block, query row m's new token in logical slot slots[m] of cache row rows[m] of
// layouts[i] (block i's cache); allowed (B, S): the slots each cache row may attend to (besides the causal rule and
// the window); cos, sin (1 | M, rope_dim / 2) for the new tokens' positions; rows from `given_from` on hold given
// tokens (a prompt's: their products in integer panels, see ProjectionGroup), the ones before generated tokens.
// Returns the last block's output (M, C).
Tensor run(const std::vector<DecodeBlock*>& blocks, const Tensor& x, const std::vector<KVLayout>& layouts,
           const std::vector<int64_t>& rows, const std::vector<int64_t>& slots, int64_t S, const Tensor& allowed,
           const std::optional<Tensor>& cos, const std::optional<Tensor>& sin, int64_t given_from,
           const Adapted* adapted = nullptr) {
  for (int64_t s : slots) LLMKIT_CHECK(s >= 0 && s < S, "slot ", s, " is outside the cache's ", S, " slots");
  LLMKIT_CHECK(given_from >= 0 && given_from <= x.size(0), "given_from must be in [0, ", x.size(0), "]");
  Tensor out = x.clone();  // the residual stream
  float* X = out.data_ptr<float>();
  const bool* A = allowed.data_ptr<bool>();
  const int64_t M = x.size(0);  // query rows
  DecodeBlock::Workspace w;
  for (const DecodeBlock* block : blocks) block->refresh_tiles();
  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads()};
    for (size_t i = 0; i < blocks.size(); ++i)
      blocks[i]->forward(team, w, X, M, given_from, layouts[i], rows.data(), slots.data(), S, A, cos, sin, adapted,
                         adapted ? adapted->blocks[i].data() : nullptr);
  }
  return out;
}

using Caches = std::vector<Tensor>;
using Scales = std::optional<std::vector<Tensor>>;

// Every block's cache, fp32 ks[i], vs[i] or int8 codes with scales kss[i], vss[i], checked against the step (B cache
// rows of S logical slots; `paged`: pools, whose table the caller sets).
std::vector<KVLayout> layouts_of(const std::vector<DecodeBlock*>& blocks, const Tensor& x, int64_t B, const Caches& ks,
                                 const Caches& vs, const Scales& kss, const Scales& vss, bool paged, int64_t S,
                                 const Tensor& allowed, const std::optional<Tensor>& cos,
                                 const std::optional<Tensor>& sin) {
  LLMKIT_CHECK(!blocks.empty() && ks.size() == blocks.size() && vs.size() == blocks.size(),
              "one k and one v cache per block");
  LLMKIT_CHECK(kss.has_value() == vss.has_value() && (!kss || (kss->size() == ks.size() && vss->size() == vs.size())),
              "int8 caches need the scales of every block's keys and values");
  std::vector<KVLayout> layouts;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Tensor* sk = kss ? &(*kss)[i] : nullptr;
    const Tensor* sv = vss ? &(*vss)[i] : nullptr;
    blocks[i]->check_step(x, B, ks[i], vs[i], sk, sv, paged, S, allowed, cos, sin);
    KVLayout kv;
    kv.KH = blocks[i]->n_kv_heads, kv.S = S;
    if (sk == nullptr) {
      kv.k = ks[i].data_ptr<float>(), kv.v = vs[i].data_ptr<float>();
    } else {
      kv.k8 = ks[i].data_ptr<int8_t>(), kv.v8 = vs[i].data_ptr<int8_t>();
      kv.ks = sk->data_ptr<float>(), kv.vs = sv->data_ptr<float>();
    }
    layouts.push_back(kv);
  }
  return layouts;
}

// Contiguous caches ks[i], vs[i] (B, KH, S, D) (int8: with scales (B, KH, S)); x (B T, C): T new tokens per row, row
// b's token t (x's row b T + t) in slot `slot + t`.
Tensor decode(const std::vector<DecodeBlock*>& blocks, const Tensor& x, const Caches& ks, const Caches& vs,
              int64_t slot, const Tensor& allowed, const std::optional<Tensor>& cos, const std::optional<Tensor>& sin,
              int64_t given_from, const Scales& kss, const Scales& vss) {
  const bool shaped = !ks.empty() && ks[0].dim() == 4;
  const int64_t S = shaped ? ks[0].size(2) : 0, B = shaped ? ks[0].size(0) : 0;
  LLMKIT_CHECK(x.dim() == 2 && B > 0 && x.size(0) % B == 0 && x.size(0) > 0,
              "x must be (B T, C): T new tokens for each of the caches' ", B, " rows");
  const int64_t M = x.size(0), T = M / B;
  const std::vector<KVLayout> layouts = layouts_of(blocks, x, B, ks, vs, kss, vss, false, S, allowed, cos, sin);
  std::vector<int64_t> rows(M), slots(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = m / T, slots[m] = slot + m % T;
  return run(blocks, x, layouts, rows, slots, S, allowed, cos, sin, given_from < 0 ? M : given_from);
}

using Stacks = std::optional<std::vector<std::vector<std::optional<Tensor>>>>;

// The step's adapters (Adapted) from Python's stacks: a[i][t], b[i][t] block i's A (k + 1, r, K) and B (k + 1, N, r)
// for target t (wq, wk, wv, wo, w1, w3, w2; None where no adapter of the step targets it), `which` (M,) each query
// row's adapter (k: the base's). Checked against the blocks' projections.
Adapted adapted_of(const std::vector<DecodeBlock*>& blocks, const Stacks& a, const Stacks& b, const Tensor& which,
                   int64_t M) {
  LLMKIT_CHECK(a && b && a->size() == blocks.size() && b->size() == blocks.size(),
              "adapters need A and B stacks for every block");
  LLMKIT_CHECK(which.dim() == 1 && which.size(0) == M && which.scalar_type() == torch::kInt64 && which.is_contiguous(),
              "adapter_rows must be (M,) int64");
  Adapted out;
  out.which = which.data_ptr<int64_t>();
  out.base = -1;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const DecodeBlock& blk = *blocks[i];
    LLMKIT_CHECK((*a)[i].size() == TARGETS && (*b)[i].size() == TARGETS, "7 targets a block (wq .. w2)");
    const ProjectionPtr* ps[TARGETS] = {&blk.wq, &blk.wk, &blk.wv, &blk.wo, &blk.w1, &blk.w3, &blk.w2};
    std::array<LowRank, TARGETS> ranks{};
    for (int t = 0; t < TARGETS; ++t) {
      const auto& at = (*a)[i][t];
      const auto& bt = (*b)[i][t];
      LLMKIT_CHECK(at.has_value() == bt.has_value(), "an adapter target needs both A and B");
      if (!at) continue;
      LLMKIT_CHECK(*ps[t] && !blk.moe, "an adapter targets a projection the block does not run here");
      const int64_t N = (*ps[t])->N, K = (*ps[t])->K;
      LLMKIT_CHECK(at->dim() == 3 && bt->dim() == 3 && at->scalar_type() == torch::kFloat32 &&
                      bt->scalar_type() == torch::kFloat32 && at->is_contiguous() && bt->is_contiguous() &&
                      at->size(2) == K && bt->size(1) == N && at->size(1) == bt->size(2) && at->size(0) == bt->size(0),
                  "adapter stacks must be A (k + 1, r, K) and B (k + 1, N, r) fp32 contiguous");
      LLMKIT_CHECK(out.base < 0 || out.base == at->size(0) - 1, "every stack must hold the same adapters");
      out.base = at->size(0) - 1;
      ranks[t] = {at->data_ptr<float>(), bt->data_ptr<float>(), at->size(1)};
    }
    out.blocks.push_back(ranks);
  }
  for (int64_t m = 0; m < M; ++m)
    LLMKIT_CHECK(out.base < 0 || (out.which[m] >= 0 && out.which[m] <= out.base), "adapter_rows out of range");
  if (out.base < 0) out.base = 0;  // no target at all: every row is skipped (which holds zeros)
  return out;
}

// Paged pools ks[i], vs[i] (KH, N, bs, D) (int8: with scales (KH, N, bs)) and the block table (B, nb) of each row's
// physical blocks; row b's new token in its logical slot slots[b] (S = nb * bs logical slots a row); with
// adapter_rows, the rows' LoRA adapters (adapted_of).
Tensor decode_paged(const std::vector<DecodeBlock*>& blocks, const Tensor& x, const Caches& ks, const Caches& vs,
                    const Tensor& table, const Tensor& slots, const Tensor& allowed, const std::optional<Tensor>& cos,
                    const std::optional<Tensor>& sin, int64_t given_from, const Scales& kss, const Scales& vss,
                    const Stacks& lora_a, const Stacks& lora_b, const std::optional<Tensor>& adapter_rows) {
  const int64_t B = x.size(0);
  LLMKIT_CHECK(table.dim() == 2 && table.size(0) == B && table.scalar_type() == torch::kInt64 && table.is_contiguous(),
              "table must be (B, nb) int64");
  LLMKIT_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots must be (B,) int64");
  const bool shaped = !ks.empty() && ks[0].dim() == 4;
  const int64_t nb = table.size(1), N = shaped ? ks[0].size(1) : 0, bs = shaped ? ks[0].size(2) : 1;
  const int64_t* T = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * nb; ++i) LLMKIT_CHECK(T[i] >= 0 && T[i] < N, "block ", T[i], " is not in the pool");
  std::vector<KVLayout> layouts = layouts_of(blocks, x, B, ks, vs, kss, vss, true, nb * bs, allowed, cos, sin);
  for (size_t i = 0; i < blocks.size(); ++i) {
    LLMKIT_CHECK(ks[i].size(1) == N && ks[i].size(2) == bs && vs[i].size(1) == N && vs[i].size(2) == bs,
                "every pool has the same blocks");
    KVLayout& kv = layouts[i];
    kv.KH = 0, kv.S = 0, kv.table = T, kv.N = N, kv.bs = bs, kv.nb = nb;
  }
  const int64_t* sl = slots.data_ptr<int64_t>();
  std::vector<int64_t> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  std::optional<Adapted> adapted;
  if (adapter_rows) adapted = adapted_of(blocks, lora_a, lora_b, *adapter_rows, B);
  return run(blocks, x, layouts, rows, std::vector<int64_t>(sl, sl + B), nb * bs, allowed, cos, sin,
             given_from < 0 ? B : given_from, adapted ? &*adapted : nullptr);
}

}  // namespace

void bind_decode(pybind11::module& m) {
  namespace py = pybind11;
  llmkit::step::bind_moe(m);
  py::class_<Projection, ProjectionPtr>(m, "Projection")
      .def(py::init<int, Tensor, std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>>(),
           py::arg("kind"), py::arg("weight"), py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
           py::arg("bias") = py::none())
      .def(py::init<Tensor, int, int64_t, std::optional<Tensor>>(), py::arg("blocks"), py::arg("block_kind"),
           py::arg("k"), py::arg("bias") = py::none(), "rows of GGUF blocks of ggml type block_kind, k inputs each")
      .def_readonly("N", &Projection::N)
      .def_readonly("K", &Projection::K)
      .def("tiled", [](const Projection& p) { return p.matrix.tiled_scales != nullptr; },
           "whether the VNNI kernel reads this projection's scales from its tiled copy")
      .def(
          "product",
          [](const Projection& p, const Tensor& x) {  // as a step computes it (one thread), for tests
            LLMKIT_CHECK(x.dim() == 2 && x.size(1) == p.K && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                         "x must be (M, K) fp32");
            p.refresh_tiles();
            ProjectionGroup group;
            group.prepare({p.all()}, x.data_ptr<float>(), x.size(0));
            Tensor y = torch::empty({x.size(0), p.N}, x.options());
            group.compute(0, p.N, y.data_ptr<float>(), p.N);
            return y;
          },
          py::arg("x"), "x @ W^T (no bias), as the decode step's products compute it");
  py::class_<DecodeBlock>(m, "DecodeBlock")
      .def(py::init<>())
      .def_readwrite("rms", &DecodeBlock::rms)
      .def_readwrite("eps", &DecodeBlock::eps)
      .def_readwrite("norm1_weight", &DecodeBlock::norm1_weight)
      .def_readwrite("norm2_weight", &DecodeBlock::norm2_weight)
      .def_readwrite("norm1_bias", &DecodeBlock::norm1_bias)
      .def_readwrite("norm2_bias", &DecodeBlock::norm2_bias)
      .def_readwrite("n_heads", &DecodeBlock::n_heads)
      .def_readwrite("n_kv_heads", &DecodeBlock::n_kv_heads)
      .def_readwrite("head_dim", &DecodeBlock::head_dim)
      .def_readwrite("v_head_dim", &DecodeBlock::v_head_dim)
      .def_readwrite("rope_dim", &DecodeBlock::rope_dim)
      .def_readwrite("rope_interleaved", &DecodeBlock::rope_interleaved)
      .def_readwrite("window", &DecodeBlock::window)
      .def_readwrite("scale", &DecodeBlock::scale)
      .def_readwrite("q_norm_weight", &DecodeBlock::q_norm_weight)
      .def_readwrite("k_norm_weight", &DecodeBlock::k_norm_weight)
      .def_readwrite("qk_eps", &DecodeBlock::qk_eps)
      .def_readwrite("wq", &DecodeBlock::wq)
      .def_readwrite("wk", &DecodeBlock::wk)
      .def_readwrite("wv", &DecodeBlock::wv)
      .def_readwrite("wo", &DecodeBlock::wo)
      .def_readwrite("gated", &DecodeBlock::gated)
      .def_readwrite("activation", &DecodeBlock::activation)
      .def_readwrite("w1", &DecodeBlock::w1)
      .def_readwrite("w2", &DecodeBlock::w2)
      .def_readwrite("w3", &DecodeBlock::w3)
      .def_readwrite("moe", &DecodeBlock::moe)
      .def("check", &DecodeBlock::check);
  m.def("decode", &decode, py::arg("blocks"), py::arg("x"), py::arg("k_caches"), py::arg("v_caches"),
        py::arg("slot"), py::arg("allowed"), py::arg("cos") = py::none(), py::arg("sin") = py::none(),
        py::arg("given_from") = -1, py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        "x (B T, C) through the blocks for T new tokens per row; returns the last block's output (B T, C). Rows "
        "from given_from on (-1: none) are given tokens, multiplied in integer panels where the weights are GGUF "
        "blocks and the CPU has AVX512-VNNI. int8 caches come with their scales (k_scales, v_scales)");
  m.def("decode_paged", &decode_paged, py::arg("blocks"), py::arg("x"), py::arg("k_pools"), py::arg("v_pools"),
        py::arg("table"), py::arg("slots"), py::arg("allowed"), py::arg("cos") = py::none(),
        py::arg("sin") = py::none(), py::arg("given_from") = -1, py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(), py::arg("lora_a") = py::none(), py::arg("lora_b") = py::none(),
        py::arg("adapter_rows") = py::none(),
        "decode over paged pools (KH, N, bs, D) with a block table (B, nb); rows from given_from on are given "
        "tokens; int8 pools come with their scales (KH, N, bs); adapter_rows (B,) with lora_a, lora_b: each row's "
        "LoRA adapter among the stacks (per block: wq, wk, wv, wo, w1, w3, w2)");
}
