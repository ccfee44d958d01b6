// Lookups beside the products, each one call instead of a handful of small torch ops.
//
// A draw by inversion from rows of probabilities (specdec.sampling.sample), in two calls around the uniform the
// caller draws from its generator:
//
//   sample_totals(probs (R, V)) -> (cumulative block totals (R, nb) float64, single (R,) int64)
//   sample_pick(probs, totals, u (R,) float64) -> ids (R,) int64
//
// The arithmetic, which specdec.sampling's own path (torch and NumPy) repeats operation for operation (so that both give the
// same id from the same uniform, bit for bit): each mass converted to float64 (exact); blocks of BLOCK ids,
// each block's total summed in id order from 0 (a short last block as if padded with zeros);
// the cumulative totals summed in block order; x = u * (the last cumulative total); the block j is the first
// whose cumulative total exceeds x (the last block if none: u * total rounded up); within it, from the
// cumulative total before it (0 for the first), the masses added in id order until the sum exceeds x: that id.
// If none does (rounding), the last id with mass before the block's end. `single` is the row's one id with
// mass where exactly one has any (the caller then draws nothing), -1 where several have, -2 where none has.
// Eight blocks are summed side by side (each its own sequential sum, so the same bits), which lets the
// processor overlap their additions: a draw over SmolLM2's 49,152 ids ~25 us from Python with this, ~215 us
// without it (2-core AMD EPYC Zen 4, measured alone).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace {

constexpr int64_t BLOCK = 256;  // specdec.sampling.SAMPLE_BLOCK
constexpr int LANES = 8;

template <typename T>
void totals_row(const T* p, int64_t size, double* cum, int64_t* single) {
  const int64_t blocks = (size + BLOCK - 1) / BLOCK, full = size / BLOCK;
  double run = 0.0;
  int64_t b = 0;
  for (; b + LANES <= full; b += LANES) {
    double s[LANES] = {};
    const T* base = p + b * BLOCK;
    for (int64_t i = 0; i < BLOCK; ++i)
      for (int l = 0; l < LANES; ++l) s[l] += static_cast<double>(base[l * BLOCK + i]);
    for (int l = 0; l < LANES; ++l) cum[b + l] = run += s[l];
  }
  for (; b < blocks; ++b) {
    const int64_t lo = b * BLOCK, hi = std::min(size, lo + BLOCK);
    double s = 0.0;
    for (int64_t i = lo; i < hi; ++i) s += static_cast<double>(p[i]);
    cum[b] = run += s;
  }
  int64_t found = -2;
  for (int64_t i = 0; i < size; ++i) {
    if (p[i] > 0) {
      if (found >= 0) {
        found = -1;
        break;
      }
      found = i;
    }
  }
  *single = found;
}

template <typename T>
int64_t pick_row(const T* p, int64_t size, const double* cum, double u) {
  const int64_t blocks = (size + BLOCK - 1) / BLOCK;
  const double x = u * cum[blocks - 1];
  const int64_t j = std::min<int64_t>(std::upper_bound(cum, cum + blocks, x) - cum, blocks - 1);
  const int64_t lo = j * BLOCK, hi = std::min(size, lo + BLOCK);
  double c = j > 0 ? cum[j - 1] : 0.0;
  for (int64_t i = lo; i < hi; ++i) {
    c += static_cast<double>(p[i]);
    if (c > x) return i;
  }
  for (int64_t i = hi - 1; i >= 0; --i)
    if (p[i] > 0) return i;
  TORCH_CHECK(false, "cannot sample from a row without mass");
}

void check_rows(const torch::Tensor& probs) {
  TORCH_CHECK(probs.device().is_cpu() && probs.dim() == 2 && probs.is_contiguous() && probs.size(1) > 0,
              "probs must be contiguous (R, V) rows on the CPU");
  TORCH_CHECK(probs.scalar_type() == torch::kFloat32 || probs.scalar_type() == torch::kFloat64,
              "probs must be float32 or float64");
}

std::tuple<torch::Tensor, torch::Tensor> sample_totals(const torch::Tensor& probs) {
  check_rows(probs);
  const int64_t rows = probs.size(0), size = probs.size(1), blocks = (size + BLOCK - 1) / BLOCK;
  auto cum = torch::empty({rows, blocks}, torch::kFloat64);
  auto single = torch::empty({rows}, torch::kInt64);
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "sample_totals", [&] {
    const scalar_t* p = probs.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r)
      totals_row(p + r * size, size, cum.data_ptr<double>() + r * blocks, single.data_ptr<int64_t>() + r);
  });
  return {cum, single};
}

torch::Tensor sample_pick(const torch::Tensor& probs, const torch::Tensor& cum, const torch::Tensor& u) {
  check_rows(probs);
  const int64_t rows = probs.size(0), size = probs.size(1), blocks = (size + BLOCK - 1) / BLOCK;
  TORCH_CHECK(cum.scalar_type() == torch::kFloat64 && cum.is_contiguous() && cum.dim() == 2 &&
                  cum.size(0) == rows && cum.size(1) == blocks,
              "totals must be sample_totals' (R, blocks) float64");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 && u.is_contiguous() && u.numel() == rows,
              "u must be one float64 a row");
  auto ids = torch::empty({rows}, torch::kInt64);
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "sample_pick", [&] {
    const scalar_t* p = probs.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r)
      ids.data_ptr<int64_t>()[r] =
          pick_row(p + r * size, size, cum.data_ptr<double>() + r * blocks, u.data_ptr<double>()[r]);
  });
  return ids;
}

// Rows of a Q8_0 embedding table (specdec.int4.BlockEmbedding): out[r, k] = d[ids[r], k / 32] * q[ids[r], k] in
// float32, the one product torch's `q[ids].float() * d[ids][..., None]` computes (exact: an fp16 scale times a
// 7-bit integer), without its four calls and their temporaries (a one-token lookup from Python 15 us against 32,
// 42 against 68 right after a target pass).
torch::Tensor embed_q8_0(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& ids) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
              "q must be contiguous int8 (N, K) on the CPU");
  const int64_t n = q.size(0), k = q.size(1), groups = k / 32;
  TORCH_CHECK(k % 32 == 0 && d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == n && d.size(1) == groups,
              "d must be contiguous float32 (N, K/32)");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(), "ids must be int64 (R,)");
  const int64_t rows = ids.size(0);
  auto out = torch::empty({rows, k}, torch::kFloat32);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t id = ip[r] < 0 ? ip[r] + n : ip[r];  // as torch indexes
    TORCH_CHECK(id >= 0 && id < n, "index ", id, " is out of bounds for an embedding of ", n, " rows");
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = dp[id * groups + g];
      for (int j = 0; j < 32; ++j) op[r * k + g * 32 + j] = scale * static_cast<float>(qp[id * k + g * 32 + j]);
    }
  }
  return out;
}

}  // namespace

void register_lookup(pybind11::module& m) {
  m.def("embed_q8_0", &embed_q8_0, "rows ids of a Q8_0 table (int8 q (N, K), float32 d (N, K/32)) as float32",
        pybind11::arg("q"), pybind11::arg("d"), pybind11::arg("ids"));
  m.def("sample_totals", &sample_totals,
        "probs (R, V) -> (cumulative float64 totals of blocks of 256 ids (R, nb), the one id with mass or -1/-2)",
        pybind11::arg("probs"));
  m.def("sample_pick", &sample_pick, "the id where u times the row's total falls (specdec.sampling.sample)",
        pybind11::arg("probs"), pybind11::arg("totals"), pybind11::arg("u"));
}
