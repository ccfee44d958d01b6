// The layer loop of specdec's lean Llama path (BatchLlama.forward_fused for rows without token trees), in C++.
//
// It calls the same ATen operations, in the same order and on the same shapes, as the Python loop in
// src/specdec/fastllama.py (`_attention`, `_mlp`, `_norm`, `exact_attention`, `Int4Weight.mm`), so its results
// are bit for bit the Python loop's (tests/test_step.py checks that); what it removes is the interpreter's work
// around each operation (~50 Python calls a layer). The products run on the kernel each weight was loaded for:
// PyTorch's int4 kernel (bfloat16 activations), specdec.qgemm's block kernels, or a float matrix.
#include <torch/extension.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

// specdec.qgemm's products (qgemm.cpp, qgemm8.cpp): x (M, K) float32 contiguous @ blocks.T, fmt 0 Q4_1, 1 Q8_0.
torch::Tensor qgemm_blocks_mm(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt);
torch::Tensor qgemm_blocks_mm8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt);

namespace {

constexpr int64_t GROUP = 32;  // the int4 kernel's group size (specdec.int4.GROUP)

enum Kind : int64_t { FLOAT = 0, INT4_TORCH = 1, BLOCKS = 2, BLOCKS8 = 3 };

// One product x @ W.T of a layer, as `LlamaWeights._mm` computes it for that weight.
struct Product {
  int64_t kind = FLOAT;
  torch::Tensor weight;                     // FLOAT: (N, K); BLOCKS, BLOCKS8: GGUF blocks (N, K/32, bytes)
  int64_t fmt = 0;                          // BLOCKS, BLOCKS8: 0 Q4_1, 1 Q8_0
  std::vector<torch::Tensor> packed;        // INT4_TORCH: each plane's packed codes
  std::vector<torch::Tensor> scales_zeros;  // INT4_TORCH: each plane's (K/32, N, 2) bfloat16
  int64_t out_rows = 0;                     // the rows a product returns (N, or fewer: a head sliced)
  int64_t in_features = 0;                  // K
  bool solo = false;                        // each activation row multiplied alone (int4 row policy "solo")

  // flat (M, K) in the kernel's activation dtype, contiguous -> (M, out_rows) float32 (`Int4Weight._product`)
  torch::Tensor product(const torch::Tensor& flat) const {
    if (kind == BLOCKS) return qgemm_blocks_mm(flat, weight, fmt);
    if (kind == BLOCKS8) return qgemm_blocks_mm8(flat, weight, fmt);
    torch::Tensor out;
    for (size_t p = 0; p < packed.size(); ++p) {
      auto part = at::_weight_int4pack_mm_for_cpu(flat, packed[p], GROUP, scales_zeros[p]).to(at::kFloat);
      out = p == 0 ? part : out + part;
    }
    return out.size(1) == out_rows ? out : out.slice(1, 0, out_rows);
  }

  // x (..., K) -> (..., out_rows) in x's dtype (`LlamaWeights._mm` / `Int4Weight.mm`)
  torch::Tensor mm(const torch::Tensor& x) const {
    if (kind == FLOAT) return at::matmul(x, weight.t());
    const auto act = kind == INT4_TORCH ? at::kBFloat16 : at::kFloat;
    auto flat = x.reshape({-1, in_features}).to(act).contiguous();
    torch::Tensor out;
    if (flat.size(0) == 0) {
      out = at::zeros({0, out_rows}, flat.options().dtype(at::kFloat));
    } else if (solo) {
      std::vector<torch::Tensor> rows;
      rows.reserve(flat.size(0));
      for (int64_t i = 0; i < flat.size(0); ++i) rows.push_back(product(flat.slice(0, i, i + 1)));
      out = at::cat(rows);
    } else {
      out = product(flat);
    }
    if (out.scalar_type() != x.scalar_type()) out = out.to(x.scalar_type());
    auto shape = x.sizes().vec();
    shape.back() = out_rows;
    return out.view(shape);
  }
};

struct Layer {
  torch::Tensor in_norm, post_norm;
  Product qkv, o, gate_up, down;
};

// The model's layers and shapes, built once per model (`specdec.step.stack_for`).
class Stack {
 public:
  Stack(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, int64_t chunk, bool exact_rows)
      : n_heads_(n_heads), n_kv_(n_kv), head_dim_(head_dim), eps_(eps), chunk_(chunk), exact_rows_(exact_rows) {}

  void add_layer(const torch::Tensor& in_norm, const torch::Tensor& post_norm, const std::vector<Product>& products) {
    TORCH_CHECK(products.size() == 4, "a layer has four products (qkv, o, gate_up, down)");
    layers_.push_back(Layer{in_norm, post_norm, products[0], products[1], products[2], products[3]});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x (B, n, D) float32 after the embedding; cos and sin_signed (B, 1, n, hd) at each row's positions; per row its
  // slot's keys and values (L, Hkv, T, hd), start, new tokens and scored tokens. Runs the first n_layers layers,
  // writing each row's new keys and values into its slot, and returns the residual stream after them, with the
  // residual stream after each layer in `capture` (in order).
  std::pair<torch::Tensor, std::vector<torch::Tensor>> run(torch::Tensor x, const torch::Tensor& cos,
                                                           const torch::Tensor& sin_signed,
                                                           const std::vector<torch::Tensor>& keys,
                                                           const std::vector<torch::Tensor>& values,
                                                           const std::vector<int64_t>& starts,
                                                           const std::vector<int64_t>& n_new,
                                                           const std::vector<int64_t>& scored, int64_t n_layers,
                                                           const std::vector<int64_t>& capture) const {
    const auto rows = static_cast<int64_t>(keys.size());
    TORCH_CHECK(static_cast<int64_t>(values.size()) == rows && static_cast<int64_t>(starts.size()) == rows &&
                    static_cast<int64_t>(n_new.size()) == rows && static_cast<int64_t>(scored.size()) == rows,
                "one key buffer, value buffer, start, count of new and of scored tokens per row");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == rows, "x must be (rows, n, D)");
    const int64_t count = n_layers < 0 ? size() : std::min(n_layers, size());
    std::vector<torch::Tensor> kept;
    c10::InferenceMode guard;
    for (int64_t i = 0; i < count; ++i) {
      const Layer& w = layers_[i];
      x = x + attention(i, norm(x, w.in_norm), cos, sin_signed, keys, values, starts, n_new, scored);
      x = x + mlp(x, w);
      for (int64_t c : capture)
        if (c == i) kept.push_back(x);
    }
    return {x, kept};
  }

 private:
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight) const {
    return at::rms_norm(x, {x.size(-1)}, weight, eps_);
  }

  torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed) const {
    return x * cos + at::roll(x, {x.size(-1) / 2}, {-1}) * sin_signed;
  }

  torch::Tensor mlp(const torch::Tensor& x, const Layer& w) const {
    auto halves = w.gate_up.mm(norm(x, w.post_norm)).chunk(2, -1);
    return w.down.mm(at::silu(halves[0]) * halves[1]);
  }

  // `exact_attention`: the leading n - solo queries in causal blocks ending at multiples of the chunk, then each
  // of the last `solo` queries alone.
  torch::Tensor exact_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                int64_t start, int64_t solo, bool gqa) const {
    const int64_t n = q.size(2), lead = n - solo;
    std::vector<torch::Tensor> parts;
    for (int64_t a = 0; a < lead;) {
      const int64_t b = std::min(lead, (start + a) / chunk_ * chunk_ + chunk_ - start);
      std::optional<torch::Tensor> mask;
      if (b - a != 1)
        mask = at::ones({b - a, start + b}, q.options().dtype(at::kBool)).tril(start + a);
      parts.push_back(at::scaled_dot_product_attention(q.slice(2, a, b), keys.slice(2, 0, start + b),
                                                       values.slice(2, 0, start + b), mask, 0.0, false,
                                                       std::nullopt, gqa));
      a = b;
    }
    for (int64_t j = lead; j < n; ++j)
      parts.push_back(at::scaled_dot_product_attention(q.slice(2, j, j + 1), keys.slice(2, 0, start + j + 1),
                                                       values.slice(2, 0, start + j + 1), std::nullopt, 0.0, false,
                                                       std::nullopt, gqa));
    return parts.size() == 1 ? parts[0] : at::cat(parts, 2);
  }

  torch::Tensor attention(int64_t i, const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                          const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& n_new,
                          const std::vector<int64_t>& scored) const {
    const int64_t rows = h.size(0), n = h.size(1), hd = head_dim_;
    const Layer& w = layers_[i];
    auto heads = w.qkv.mm(h).view({rows, n, -1, hd}).transpose(1, 2);  // (B, Hq + 2 Hkv, n, hd)
    auto qk = rope(heads.slice(1, 0, n_heads_ + n_kv_), cos, sin_signed);
    auto q = qk.slice(1, 0, n_heads_), k = qk.slice(1, n_heads_);
    auto v = heads.slice(1, n_heads_ + n_kv_);
    const bool gqa = n_kv_ != n_heads_;
    torch::Tensor out;
    if (rows > 1) out = at::zeros_like(q);
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t start = starts[b], count = n_new[b];
      auto layer_keys = keys[b].select(0, i), layer_values = values[b].select(0, i);
      layer_keys.slice(1, start, start + count).copy_(k.select(0, b).slice(1, 0, count));
      layer_values.slice(1, start, start + count).copy_(v.select(0, b).slice(1, 0, count));
      const int64_t solo = exact_rows_ && count > 1 ? std::min(scored[b], count) : 0;
      auto one = exact_attention(q.slice(0, b, b + 1).slice(2, 0, count), layer_keys.unsqueeze(0),
                                 layer_values.unsqueeze(0), start, solo, gqa);
      if (rows == 1)
        out = one;
      else
        out.slice(0, b, b + 1).slice(2, 0, count).copy_(one);
    }
    return w.o.mm(out.transpose(1, 2).reshape({rows, n, n_heads_ * hd}));
  }

  int64_t n_heads_, n_kv_, head_dim_;
  double eps_;
  int64_t chunk_;
  bool exact_rows_;
  std::vector<Layer> layers_;
};

}  // namespace

// The layer loop's entry points, added to the extension's module by qgemm.cpp.
void register_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Product>(m, "Product")
      .def(py::init([](int64_t kind, torch::Tensor weight, int64_t fmt, std::vector<torch::Tensor> packed,
                       std::vector<torch::Tensor> scales_zeros, int64_t out_rows, int64_t in_features, bool solo) {
             TORCH_CHECK(kind >= FLOAT && kind <= BLOCKS8, "unknown product kind ", kind);
             TORCH_CHECK(packed.size() == scales_zeros.size(), "one scales_zeros per packed plane");
             TORCH_CHECK(kind != INT4_TORCH || !packed.empty(), "an int4 product needs its planes");
             return Product{kind, weight, fmt, packed, scales_zeros, out_rows, in_features, solo};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("fmt"), py::arg("packed"), py::arg("scales_zeros"),
           py::arg("out_rows"), py::arg("in_features"), py::arg("solo"))
      .def("mm", &Product::mm, "x (..., K) @ W.T -> (..., out_rows), as LlamaWeights._mm computes it");
  py::class_<Stack>(m, "Stack")
      .def(py::init<int64_t, int64_t, int64_t, double, int64_t, bool>(), py::arg("n_heads"), py::arg("n_kv"),
           py::arg("head_dim"), py::arg("eps"), py::arg("chunk"), py::arg("exact_rows"))
      .def("add_layer", &Stack::add_layer)
      .def("__len__", &Stack::size)
      .def("run", &Stack::run, py::arg("x"), py::arg("cos"), py::arg("sin_signed"), py::arg("keys"),
           py::arg("values"), py::arg("starts"), py::arg("n_new"), py::arg("scored"), py::arg("n_layers"),
           py::arg("capture"), py::call_guard<py::gil_scoped_release>());
}
