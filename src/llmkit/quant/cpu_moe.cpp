// A mixture-of-experts feed-forward inside the C++ decode step (cpu_decode.cpp's blocks call it; the PyTorch
// module it computes is llmkit/layers/moe.py's MoE, which stays the reference).
//
//   h (M, C) ─► router logits (M, E) ─► per row: scores, (groups,) top-k experts and their gates
//            ─► one job per expert some row chose: its rows gathered, [w1_e | w3_e], act(gate) * up, w2_e
//            ─► x[row] += gate * job output          (and the shared experts as one more job over every row)
//
// Experts are stored stacked (w1, w3 (E I, C), w2 (E C, I)), fp32 or int4 / int8 codes, so an expert is a run of
// rows of one matrix: a step reads only the chosen experts' weights, which is what makes a mixture of experts cheap
// to decode. The products of all the jobs of a phase are split over the team by output columns in one pass (one
// barrier per phase, not per expert).
//
// Routing is the Router's (moe.py): softmax or sigmoid scores; a score bias that changes the choice but not the
// gates (DeepSeek-V3); the best `topk_groups` groups of experts ranked by their best score (DeepSeek-V2) or their
// two best summed (DeepSeek-V3); gates renormalised (norm_topk) and scaled (routed_scale). Equal scores go to the
// lower expert index; the result equals the module's up to float rounding (tests/quant/test_native_decode.py).

#include "cpu_step.h"

#include <limits>
#include <numeric>

namespace llmkit::step {

// The rows of the step one expert (or the shared experts) takes, and its buffers.
struct Job {
  int64_t expert = -1;          // -1: the shared experts
  std::vector<int64_t> rows;    // which of the step's rows
  std::vector<float> gates;     // each one's gate
  std::vector<float> x, up, hidden, y;  // its rows of h (n, C); w1 | w3 (n, width); act (n, I_e); w2 (n, C)
  ProjectionGroup group;        // the product of the current phase, into `out` (n, width)
  float* out = nullptr;
  int64_t width = 0;
};

struct MoEWorkspace {
  std::vector<float> logits;  // (M, E)
  std::vector<Job> jobs;      // the first n_jobs are this step's (kept between steps for their buffers)
  size_t n_jobs = 0;
};

std::shared_ptr<MoEWorkspace> moe_workspace() { return std::make_shared<MoEWorkspace>(); }

namespace {

// One row's choice: (expert, gate) pairs from its router logits (E).
void route(const MoEFeedForward& f, const float* logits, std::vector<std::pair<int64_t, float>>& out) {
  const int64_t E = f.experts();
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  std::vector<float> s(E), c(E);
  if (f.softmax) {
    float top = NEG, total = 0.f;
    for (int64_t e = 0; e < E; ++e) top = std::max(top, logits[e]);
    for (int64_t e = 0; e < E; ++e) total += (s[e] = std::exp(logits[e] - top));
    for (int64_t e = 0; e < E; ++e) s[e] /= total;
  } else {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.f / (1.f + std::exp(-logits[e]));
  }
  const float* bias = f.score_bias ? f.score_bias->data_ptr<float>() : nullptr;
  for (int64_t e = 0; e < E; ++e) {
    c[e] = s[e] + (bias ? bias[e] : 0.f);
    if (std::isnan(c[e])) c[e] = NEG;  // a NaN never wins (the step's logits report it)
  }
  const auto better = [&](const std::vector<float>& v) {
    return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  if (f.n_groups > 1) {  // only the topk_groups best groups stay eligible
    const int64_t per = E / f.n_groups;
    std::vector<float> score(f.n_groups);
    for (int64_t g = 0; g < f.n_groups; ++g) {
      float first = NEG, second = NEG;
      for (int64_t e = g * per; e < (g + 1) * per; ++e) {
        if (c[e] > first)
          second = first, first = c[e];
        else if (c[e] > second)
          second = c[e];
      }
      score[g] = f.group_max || per < 2 ? first : first + second;
    }
    std::vector<int64_t> groups(f.n_groups);
    std::iota(groups.begin(), groups.end(), 0);
    std::sort(groups.begin(), groups.end(), better(score));
    for (int64_t i = f.topk_groups; i < f.n_groups; ++i)
      std::fill(c.begin() + groups[i] * per, c.begin() + (groups[i] + 1) * per, NEG);
  }
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + f.top_k, order.end(), better(c));
  float total = 0.f;
  out.clear();
  for (int64_t i = 0; i < f.top_k; ++i) out.emplace_back(order[i], s[order[i]]), total += s[order[i]];
  for (auto& [e, g] : out) {
    if (f.norm_topk) g /= total + 1e-20f;
    g *= static_cast<float>(f.routed_scale);
  }
}

// every job's product of this phase: the team splits the jobs' output columns, taken end to end
void compute_jobs(const Team& team, MoEWorkspace& w) {
  int64_t total = 0;
  for (size_t i = 0; i < w.n_jobs; ++i) total += w.jobs[i].width;
  const auto [j0, j1] = team.share(total);
  int64_t offset = 0;
  for (size_t i = 0; i < w.n_jobs; ++i) {
    const Job& job = w.jobs[i];
    const int64_t a = std::max(j0, offset) - offset, e = std::min(j1, offset + job.width) - offset;
    if (a < e) job.group.compute(a, e, job.out, job.width);
    offset += job.width;
  }
}

}  // namespace

void moe_forward(const MoEFeedForward& f, const Team& team, MoEWorkspace& w, const float* h, float* X, int64_t M,
                 int64_t C) {
  const int64_t E = f.experts(), I = f.hidden();
  const bool lead = team.id == 0;
  if (lead) w.logits.resize(M * E);
#pragma omp barrier
  {
    const auto [a, e] = team.share(E);
    float_columns(h, M, f.router.data_ptr<float>(), C, a, e, w.logits.data(), E);
  }
#pragma omp barrier
  if (lead) {  // route; one job per chosen expert (in order of first choice), one for the shared experts
    std::vector<int64_t> job_of(E, -1);
    std::vector<std::pair<int64_t, float>> choice;
    w.n_jobs = 0;
    const auto add_job = [&](int64_t expert) {
      if (w.jobs.size() <= w.n_jobs) w.jobs.emplace_back();
      Job& job = w.jobs[w.n_jobs++];
      job.expert = expert, job.rows.clear(), job.gates.clear();
      return w.n_jobs - 1;
    };
    for (int64_t m = 0; m < M; ++m) {
      route(f, w.logits.data() + m * E, choice);
      for (const auto& [e, g] : choice) {
        if (job_of[e] < 0) job_of[e] = static_cast<int64_t>(add_job(e));
        w.jobs[job_of[e]].rows.push_back(m), w.jobs[job_of[e]].gates.push_back(g);
      }
    }
    if (f.s1) {
      Job& job = w.jobs[add_job(-1)];
      const float* gate = f.shared_gate ? f.shared_gate->data_ptr<float>() : nullptr;
      for (int64_t m = 0; m < M; ++m)
        job.rows.push_back(m), job.gates.push_back(gate ? 1.f / (1.f + std::exp(-dot(h + m * C, gate, C))) : 1.f);
    }
    for (size_t i = 0; i < w.n_jobs; ++i) {  // gather each job's rows; the first products: w1 | w3
      Job& job = w.jobs[i];
      const int64_t n = static_cast<int64_t>(job.rows.size()), e = job.expert;
      const int64_t Ie = e >= 0 ? I : f.s1->N;
      job.x.resize(n * C);
      for (int64_t r = 0; r < n; ++r) std::copy(h + job.rows[r] * C, h + (job.rows[r] + 1) * C, job.x.data() + r * C);
      std::vector<Matrix> ms{e >= 0 ? f.w1->rows(e * I, (e + 1) * I) : f.s1->all()};
      if (f.gated) ms.push_back(e >= 0 ? f.w3->rows(e * I, (e + 1) * I) : f.s3->all());
      job.width = f.gated ? 2 * Ie : Ie;
      job.up.resize(n * job.width);
      job.group.prepare(ms, job.x.data(), n);
      job.out = job.up.data();
    }
  }
#pragma omp barrier
  compute_jobs(team, w);
#pragma omp barrier
  if (lead)
    for (size_t i = 0; i < w.n_jobs; ++i) {  // act(gate) * up; the second products: w2
      Job& job = w.jobs[i];
      const int64_t n = static_cast<int64_t>(job.rows.size()), e = job.expert;
      const int64_t Ie = e >= 0 ? I : f.s1->N;
      job.hidden.resize(n * Ie), job.y.resize(n * C);
      for (int64_t r = 0; r < n; ++r) {
        const float* row = job.up.data() + r * job.width;
        activate_rows(row, f.gated ? row + Ie : nullptr, job.hidden.data() + r * Ie, Ie, f.activation);
      }
      job.group.prepare({e >= 0 ? f.w2->rows(e * C, (e + 1) * C) : f.s2->all()}, job.hidden.data(), n);
      job.width = C, job.out = job.y.data();
    }
#pragma omp barrier
  compute_jobs(team, w);
#pragma omp barrier
  if (lead)
    for (size_t i = 0; i < w.n_jobs; ++i) {
      const Job& job = w.jobs[i];
      for (size_t r = 0; r < job.rows.size(); ++r) {
        float* x = X + job.rows[r] * C;
        const float* y = job.y.data() + r * C;
        for (int64_t c = 0; c < C; ++c) x[c] += job.gates[r] * y[c];
      }
    }
}

void moe_check(const MoEFeedForward& f, int64_t C) {
  const Tensor& r = f.router;
  LLMKIT_CHECK(r.dim() == 2 && r.size(0) > 0 && r.size(1) == C && r.scalar_type() == torch::kFloat32 &&
                  r.is_contiguous(),
              "the router must be (E, C) fp32");
  const int64_t E = r.size(0);
  if (f.score_bias)
    LLMKIT_CHECK(f.score_bias->dim() == 1 && f.score_bias->size(0) == E &&
                    f.score_bias->scalar_type() == torch::kFloat32 && f.score_bias->is_contiguous(),
                "the score bias must be (E,) fp32");
  LLMKIT_CHECK(f.n_groups >= 1 && E % f.n_groups == 0 && f.topk_groups >= 1 && f.topk_groups <= f.n_groups,
              "bad expert groups");
  LLMKIT_CHECK(f.top_k >= 1 && f.top_k <= f.topk_groups * (E / f.n_groups), "top_k exceeds the eligible experts");
  LLMKIT_CHECK(f.w1 && f.w2 && (!f.gated || f.w3), "an expert projection is missing");
  LLMKIT_CHECK(f.w1->N % E == 0 && f.w1->K == C, "w1 must be (E I, C)");
  const int64_t I = f.w1->N / E;
  LLMKIT_CHECK(f.w2->N == E * C && f.w2->K == I, "w2 must be (E C, I)");
  LLMKIT_CHECK(!f.gated || (f.w3->N == f.w1->N && f.w3->K == C), "w3 must be (E I, C)");
  LLMKIT_CHECK(!f.w1->bias && !f.w2->bias && (!f.w3 || !f.w3->bias), "experts have no biases");
  if (f.s1) {
    LLMKIT_CHECK(f.s2 && (!f.gated || f.s3), "a shared-expert projection is missing");
    LLMKIT_CHECK(f.s1->K == C && f.s2->N == C && f.s2->K == f.s1->N &&
                    (!f.gated || (f.s3->K == C && f.s3->N == f.s1->N)),
                "shared-expert projections do not match");
    LLMKIT_CHECK(!f.s1->bias && !f.s2->bias && (!f.s3 || !f.s3->bias), "shared experts have no biases");
  }
  if (f.shared_gate)
    LLMKIT_CHECK(f.s1 && f.shared_gate->dim() == 1 && f.shared_gate->size(0) == C &&
                    f.shared_gate->scalar_type() == torch::kFloat32 && f.shared_gate->is_contiguous(),
                "the shared gate must be (C,) fp32, with shared experts");
}

void bind_moe(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<MoEFeedForward, std::shared_ptr<MoEFeedForward>>(m, "MoEFeedForward")
      .def(py::init<>())
      .def_readwrite("router", &MoEFeedForward::router)
      .def_readwrite("score_bias", &MoEFeedForward::score_bias)
      .def_readwrite("softmax", &MoEFeedForward::softmax)
      .def_readwrite("top_k", &MoEFeedForward::top_k)
      .def_readwrite("n_groups", &MoEFeedForward::n_groups)
      .def_readwrite("topk_groups", &MoEFeedForward::topk_groups)
      .def_readwrite("group_max", &MoEFeedForward::group_max)
      .def_readwrite("norm_topk", &MoEFeedForward::norm_topk)
      .def_readwrite("routed_scale", &MoEFeedForward::routed_scale)
      .def_readwrite("gated", &MoEFeedForward::gated)
      .def_readwrite("activation", &MoEFeedForward::activation)
      .def_readwrite("w1", &MoEFeedForward::w1)
      .def_readwrite("w3", &MoEFeedForward::w3)
      .def_readwrite("w2", &MoEFeedForward::w2)
      .def_readwrite("s1", &MoEFeedForward::s1)
      .def_readwrite("s3", &MoEFeedForward::s3)
      .def_readwrite("s2", &MoEFeedForward::s2)
      .def_readwrite("shared_gate", &MoEFeedForward::shared_gate);
}

}  // namespace llmkit::step
