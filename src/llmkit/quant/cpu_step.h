// What a decode step's parts share (cpu_decode.cpp: the blocks; cpu_moe.cpp: a mixture-of-experts feed-forward):
// the linear layers as the step reads them, the team of threads running the step, and products of several
// matrices over one input computed by that team.

#pragma once

#include "cpu_blocks.h"
#include "cpu_kernel.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace llmkit::step {

using torch::Tensor;

// A matrix a product reads: fp32 rows (N, K), int4 / int8 codes, or GGUF blocks. A linear layer's whole matrix, or
// a run of its rows (one expert's, in the stacked expert weights).
struct Matrix {
  int kind = 0;             // Projection::Kind
  const float* w = nullptr;  // FLOAT: (N, K) row-major
  QuantizedMatrix q;         // INT4 / INT8
  BlockMatrix b;             // BLOCKS
  int64_t N = 0, K = 0;
};

// (N, G) fp32 -> (ceil(N / 16) * 16, G) holding, for each tile of 16 rows, (G, 16): group g's values of the tile's
// rows side by side (rows past N: 0).
inline Tensor tile_rows(const Tensor& t) {
  const int64_t N = t.size(0), G = t.size(1), tiles = (N + VNNI_TILE - 1) / VNNI_TILE;
  Tensor out = torch::zeros({tiles * VNNI_TILE, G}, t.options());
  const float* in = t.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) o[((n / VNNI_TILE) * G + g) * VNNI_TILE + n % VNNI_TILE] = in[n * G + g];
  return out;
}

// A linear layer as the step reads it: an fp32 matrix (N, K), int4 / int8 codes, or rows of GGUF blocks
// (cpu_blocks.h); and an optional bias (N,).
struct Projection {
  enum Kind { FLOAT = 0, INT4 = 1, INT8 = 2, BLOCKS = 3 };

  int kind = FLOAT;
  Tensor weight, scales, zeros;  // FLOAT: weight (N, K); INT4 / INT8: weight = the codes (formats.py)
  std::optional<Tensor> bias;
  mutable QuantizedMatrix matrix;           // (its tiled scales follow refresh_tiles)
  mutable Tensor tiled_scales, tiled_zeros;  // (ceil(N / 16) * 16, G) as tiles of (G, 16)
  mutable int64_t tiles_version = -1;
  int64_t N = 0, K = 0;

  BlockMatrix blocks;  // BLOCKS

  // rows of GGUF blocks of ggml type block_kind, K inputs each (weight: the (N, row bytes) uint8 blocks)
  Projection(Tensor weight_, int block_kind, int64_t K_, std::optional<Tensor> bias_)
      : kind(BLOCKS), weight(std::move(weight_)), bias(std::move(bias_)) {
    blocks = block_matrix(weight, block_kind, K_);
    N = blocks.N, K = K_;
    check_bias();
  }

  Projection(int kind_, Tensor weight_, std::optional<Tensor> scales_, std::optional<Tensor> zeros_,
             std::optional<Tensor> bias_)
      : kind(kind_), weight(std::move(weight_)), bias(std::move(bias_)) {
    LLMKIT_CHECK(kind >= FLOAT && kind <= INT8, "unknown projection kind ", kind);
    if (kind == FLOAT) {
      LLMKIT_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(),
                  "a float projection's weight must be (N, K) fp32");
      N = weight.size(0), K = weight.size(1);
    } else {
      LLMKIT_CHECK(scales_.has_value(), "a quantized projection needs scales");
      scales = *scales_;
      if (kind == INT4) {
        LLMKIT_CHECK(zeros_.has_value(), "an int4 projection needs zeros");
        zeros = *zeros_;
        matrix = int4_matrix(weight, scales, zeros);
      } else {
        matrix = int8_matrix(weight, scales);
      }
      N = matrix.N, K = matrix.K;
      refresh_tiles();
    }
    check_bias();
  }

  void check_bias() const {
    if (bias) LLMKIT_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat32 &&
                              bias->is_contiguous(),
                          "the bias must be (N,) fp32");
  }

  // rows [r0, r1) of the matrix (the bias is not part of it)
  Matrix rows(int64_t r0, int64_t r1) const {
    Matrix m{kind, nullptr, matrix, blocks, r1 - r0, K};
    if (kind == FLOAT) {
      m.w = weight.data_ptr<float>() + r0 * K;
    } else if (kind == BLOCKS) {
      m.b = blocks.rows(r0, r1);
    } else {
      const int64_t row_bytes = matrix.int4 ? K / 2 : K;
      m.q.codes += r0 * row_bytes, m.q.scales += r0 * matrix.G, m.q.N = r1 - r0;
      if (matrix.zeros) m.q.zeros += r0 * matrix.G;
      const bool tiled = matrix.tiled_scales != nullptr && r0 % VNNI_TILE == 0;
      m.q.tiled_scales = tiled ? matrix.tiled_scales + r0 * matrix.G : nullptr;
      m.q.tiled_zeros = tiled && matrix.tiled_zeros ? matrix.tiled_zeros + r0 * matrix.G : nullptr;
    }
    return m;
  }

  // The scales (and zeros) by tiles of rows for the AVX512-VNNI kernel (QuantizedMatrix::tiled_scales), where it
  // runs: made when the projection is built and again whenever the scales or zeros were changed in place since
  // (their version counters; the step calls this before each run). A decoding step at one row otherwise transposes
  // them for every tile, a third of its products' time with a scale per block of 32. Costs their size again
  // (SmolLM2's Q4_1 file: 30 MB beside 112). Inference-mode tensors keep no version, and get no copy.
  void refresh_tiles() const {
    if (kind == FLOAT || kind == BLOCKS || !vnni_selected() || scales.is_inference() || (zeros.defined() && zeros.is_inference())) {
      matrix.tiled_scales = matrix.tiled_zeros = nullptr;
      return;
    }
    const int64_t version = scales._version() + (zeros.defined() ? zeros._version() : 0);
    if (tiled_scales.defined() && version == tiles_version) {
      matrix.tiled_scales = tiled_scales.data_ptr<float>();
      matrix.tiled_zeros = zeros.defined() ? tiled_zeros.data_ptr<float>() : nullptr;
      return;
    }
    tiled_scales = tile_rows(scales);
    if (zeros.defined()) tiled_zeros = tile_rows(zeros);
    tiles_version = version;
    matrix.tiled_scales = tiled_scales.data_ptr<float>();
    matrix.tiled_zeros = zeros.defined() ? tiled_zeros.data_ptr<float>() : nullptr;
  }

  Matrix all() const { return rows(0, N); }
};

using ProjectionPtr = std::shared_ptr<Projection>;

// The threads of the step's parallel region, and each one's share of n items.
struct Team {
  int id = 0, size = 1;
  std::pair<int64_t, int64_t> share(int64_t n) const { return {n * id / size, n * (id + 1) / size}; }
};

// Matrices of one input side by side in one output (M, width): x @ W_i^T in columns [offset_i, offset_i + N_i).
// `prepare` (one thread) quantizes x once per run of quantized matrices of one kind; then any range of output
// columns can be computed on its own, so the team splits the columns as it likes. `panels`: GGUF block matrices in
// integer panels (BlockProduct), a prompt's tokens in the batch-invariant mode.
class ProjectionGroup {
 public:
  void prepare(const std::vector<Matrix>& ms, const float* x, int64_t M, bool panels = false) {
    x_ = x, M_ = M;
    next_.store(0, std::memory_order_relaxed);
    segments_.clear();
    int64_t offset = 0;
    for (size_t i = 0; i < ms.size();) {
      Segment seg;
      seg.offset = offset;
      if (ms[i].kind == Projection::FLOAT) {
        seg.fp32 = ms[i++];
        seg.width = seg.fp32.N;
      } else if (ms[i].kind == Projection::BLOCKS) {  // any block types: x is quantized once per group it needs
        std::vector<BlockMatrix> bs;
        for (; i < ms.size() && ms[i].kind == Projection::BLOCKS; ++i) bs.push_back(ms[i].b), seg.width += ms[i].N;
        seg.blocks = std::make_shared<BlockProduct>();
        seg.blocks->prepare(x, M, bs[0].K, bs, panels);
      } else {
        std::vector<QuantizedMatrix> qs;
        const int kind = ms[i].kind;
        for (; i < ms.size() && ms[i].kind == kind; ++i) qs.push_back(ms[i].q), seg.width += ms[i].N;
        seg.product = std::make_shared<Product>();
        seg.product->prepare(x, M, qs[0].K, qs);
      }
      offset += seg.width;
      segments_.push_back(std::move(seg));
    }
    width_ = offset;
  }

  int64_t width() const { return width_; }

  // output columns [j0, j1) into y (M, ldy)
  void compute(int64_t j0, int64_t j1, float* y, int64_t ldy) const {
    for (const Segment& seg : segments_) {
      const int64_t a = std::max(j0, seg.offset) - seg.offset, e = std::min(j1, seg.offset + seg.width) - seg.offset;
      if (a >= e) continue;
      if (seg.product)
        seg.product->columns(a, e, y + seg.offset, ldy);
      else if (seg.blocks)
        seg.blocks->columns(a, e, y + seg.offset, ldy);
      else
        float_columns(x_, M_, seg.fp32.w, seg.fp32.K, a, e, y + seg.offset, ldy);
    }
  }

  // The team's columns: each thread claims a run of the columns left (a half of its share of them, in multiples of
  // 16) until none are, so a thread slowed by the memory or by a neighbour on its core does less of the work
  // instead of keeping the others waiting at the barrier. A column's bits do not depend on which thread computes it.
  void compute(const Team& team, float* y, int64_t ldy) const {
    if (team.size == 1) return compute(0, width_, y, ldy);
    int64_t j0 = next_.load(std::memory_order_relaxed);
    while (j0 < width_) {
      const int64_t take = std::max<int64_t>(16, (width_ - j0) / (2 * team.size) / 16 * 16);
      if (next_.compare_exchange_weak(j0, j0 + take, std::memory_order_relaxed)) {
        compute(j0, std::min(width_, j0 + take), y, ldy);
        j0 = next_.load(std::memory_order_relaxed);
      }
    }
  }

 private:
  struct Segment {
    int64_t offset = 0, width = 0;
    std::shared_ptr<Product> product;     // quantized matrices, or
    std::shared_ptr<BlockProduct> blocks;  // GGUF block matrices, or
    Matrix fp32;                          // one fp32 matrix
  };
  std::vector<Segment> segments_;
  const float* x_ = nullptr;
  int64_t M_ = 0, width_ = 0;
  struct Counter : std::atomic<int64_t> {  // the next column to claim (a copy starts at 0: groups are copied only idle)
    Counter() : std::atomic<int64_t>(0) {}
    Counter(const Counter&) : std::atomic<int64_t>(0) {}
  };
  mutable Counter next_;
};

// a . b over n values, b read through `eight` (8 values from i, as floats) and `one` (the value at i): two chains of
// FMAs 16 values at a time, then 8, then the lanes' sum, then the rest. Every b's reader gets the same arithmetic.
template <class Eight, class One>
inline float dot_of(const float* a, int64_t n, Eight eight, One one) {
  __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();  // two chains of FMAs
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), eight(i), acc);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), eight(i + 8), acc2);
  }
  acc = _mm256_add_ps(acc, acc2);
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), eight(i), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float out = _mm_cvtss_f32(s);
  for (; i < n; ++i) out += a[i] * one(i);
  return out;
}

inline float dot(const float* a, const float* b, int64_t n) {
  return dot_of(a, n, [b](int64_t i) { return _mm256_loadu_ps(b + i); }, [b](int64_t i) { return b[i]; });
}

// e^x for 8 floats: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 7 (relative error
// below 3e-7, about 2 ulp), times 2^n built in the exponent bits. Inputs below -87 (e^x under the smallest normal
// float) and -inf give 0; inputs above 88.3 give e^88.3.
inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts, the first exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

enum Activation { RELU = 0, GELU = 1, GELU_TANH = 2, SILU = 3 };

inline float activate(float v, int act) {
  switch (act) {
    case RELU: return v > 0.f ? v : 0.f;
    case GELU: return 0.5f * v * (1.f + std::erf(v * static_cast<float>(M_SQRT1_2)));
    case GELU_TANH: {
      const float c = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * v * (1.f + std::tanh(c * (v + 0.044715f * v * v * v)));
    }
    default: return v / (1.f + std::exp(-v));  // silu
  }
}

// out[i] = act(gate[i]) * up[i] (or act(gate[i]) without up) for i < n; SiLU 8 at a time
inline void activate_rows(const float* gate, const float* up, float* out, int64_t n, int act) {
  int64_t i = 0;
  if (act == SILU)
    for (; i + 8 <= n; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      __m256 y = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
      if (up) y = _mm256_mul_ps(y, _mm256_loadu_ps(up + i));
      _mm256_storeu_ps(out + i, y);
    }
  for (; i < n; ++i) out[i] = up ? activate(gate[i], act) * up[i] : activate(gate[i], act);
}

// The mixture-of-experts feed-forward of a block's decode step (computed by cpu_moe.cpp).
struct MoEFeedForward {
  Tensor router;                      // (E, C) fp32
  std::optional<Tensor> score_bias;   // (E,) fp32: added to the scores to choose experts, not to weigh them
  bool softmax = true;                // scores: a softmax over the experts, else each one's sigmoid
  int64_t top_k = 2, n_groups = 1, topk_groups = 1;
  bool group_max = false;             // groups ranked by their best score, else by the sum of their two best
  bool norm_topk = true;              // the chosen experts' scores renormalised to sum to 1
  double routed_scale = 1.0;
  bool gated = true;                  // experts: w2(act(w1 x) * w3 x), else w2(act(w1 x))
  int activation = SILU;
  ProjectionPtr w1, w3, w2;           // the stacked experts: w1, w3 (E I, C), w2 (E C, I)
  ProjectionPtr s1, s3, s2;           // the shared experts as one feed-forward of the same kind (optional)
  std::optional<Tensor> shared_gate;  // (C,): the shared output scaled by sigmoid(h . gate) (Qwen2-MoE)

  int64_t experts() const { return router.size(0); }
  int64_t hidden() const { return w1->N / experts(); }
};


// Its buffers for one step, shared by the team (cpu_moe.cpp).
struct MoEWorkspace;

// x (M, C) += the MoE feed-forward of h (M, C), the block's normed states; called by every thread of the team.
void moe_forward(const MoEFeedForward& moe, const Team& team, MoEWorkspace& w, const float* h, float* X, int64_t M,
                 int64_t C);

std::shared_ptr<MoEWorkspace> moe_workspace();

// its shapes against the model width C, checked once when the block is built
void moe_check(const MoEFeedForward& moe, int64_t C);

void bind_moe(pybind11::module& m);

}  // namespace llmkit::step
