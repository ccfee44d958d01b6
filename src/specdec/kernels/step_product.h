// One product of a layer (`Product`: x @ W.T on the kernel its weight was loaded for) and a feature prophet's
// residual MLPs, for the layer loop (step.cpp). Included by step.cpp only.
#pragma once

#include <torch/extension.h>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <vector>

// specdec.qgemm's products (qgemm.cpp, qgemm8.cpp, qgemm16.cpp): x (M, K) float32 contiguous @ blocks.T, fmt 0 Q4_1,
// 1 Q8_0 (qgemm16: + 2 on the AMX tile unit).
torch::Tensor qgemm_blocks_mm(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt);
torch::Tensor qgemm_blocks_mm8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt);
torch::Tensor qgemm_blocks_mm16(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt);
// The same products into a buffer (x (M, K) and out (M, N) dense float32 rows), for the layer loop's raw layers.
void qgemm_blocks_into(const float* x, int64_t M, const uint8_t* blocks, int64_t fmt, int64_t K, int64_t N, float* out);
void qgemm16_into(const float* x, int64_t M, const uint8_t* panels, int64_t fmt, int64_t K, int64_t N,
                  float* out);
// x (..., K) float32 @ w.T, rows invariant up to f32_rows() rows (f32mm.cpp)
torch::Tensor f32_product(const torch::Tensor& x, const torch::Tensor& w);

namespace {

constexpr int64_t GROUP = 32;  // the int4 kernel's group size (specdec.int4.GROUP)

enum Kind : int64_t { FLOAT = 0, INT4_TORCH = 1, BLOCKS = 2, BLOCKS8 = 3, BLOCKS16 = 4 };

// One product x @ W.T of a layer, as `LlamaWeights._mm` computes it for that weight.
struct Product {
  int64_t kind = FLOAT;
  torch::Tensor weight;                     // FLOAT: (N, K); BLOCKS, BLOCKS8, BLOCKS16: GGUF blocks (N, K/32, bytes)
  int64_t fmt = 0;                          // BLOCKS, BLOCKS8, BLOCKS16: 0 Q4_1, 1 Q8_0 (BLOCKS16: + 2 on AMX)
  std::vector<torch::Tensor> packed;        // INT4_TORCH: each plane's packed codes
  std::vector<torch::Tensor> scales_zeros;  // INT4_TORCH: each plane's (K/32, N, 2) bfloat16
  int64_t out_rows = 0;                     // the rows a product returns (N, or fewer: a head sliced)
  int64_t in_features = 0;                  // K
  bool solo = false;                        // each activation row multiplied alone (int4 row policy "solo")

  // flat (M, K) in the kernel's activation dtype, contiguous -> (M, out_rows) float32 (`Int4Weight._product`)
  torch::Tensor product(const torch::Tensor& flat) const {
    torch::Tensor out;
    if (kind == BLOCKS || kind == BLOCKS8 || kind == BLOCKS16) {
      RECORD_FUNCTION("specdec_qgemm", std::vector<c10::IValue>());  // named for scripts/step-profile
      if (kind == BLOCKS16)
        out = qgemm_blocks_mm16(flat, weight, fmt);  // panels: rows of zeros up to a multiple of 16
      else
        out = kind == BLOCKS ? qgemm_blocks_mm(flat, weight, fmt) : qgemm_blocks_mm8(flat, weight, fmt);
    } else {
      for (size_t p = 0; p < packed.size(); ++p) {
        auto part = at::_weight_int4pack_mm_for_cpu(flat, packed[p], GROUP, scales_zeros[p]).to(at::kFloat);
        out = p == 0 ? part : out + part;
      }
    }
    return out.size(1) == out_rows ? out : out.slice(1, 0, out_rows);
  }

  // Whether `into` computes this product: a blocks kernel (float32 or bfloat16 activations) whose rows are all
  // returned, every activation row in one product.
  bool has_into() const {
    if (solo || !weight.defined() || weight.dim() != 3) return false;
    if (kind == BLOCKS16) return weight.size(0) * 16 == out_rows;
    return kind == BLOCKS && weight.size(0) == out_rows;
  }

  // x (M, K) dense float32 rows @ W.T into out (M, out_rows): what `product` computes, without tensors.
  void into(const float* x, int64_t M, float* out) const {
    RECORD_FUNCTION("specdec_qgemm", std::vector<c10::IValue>());  // named for scripts/step-profile
    const auto* w = weight.data_ptr<uint8_t>();
    if (kind == BLOCKS16)
      qgemm16_into(x, M, w, fmt, in_features, out_rows, out);
    else
      qgemm_blocks_into(x, M, w, fmt, in_features, out_rows, out);
  }

  // x (..., K) -> (..., out_rows) in x's dtype (`LlamaWeights._mm` / `Int4Weight.mm`)
  torch::Tensor mm(const torch::Tensor& x) const {
    if (kind == FLOAT) return f32_product(x, weight);  // as LlamaWeights._mm (kernels/f32mm.cpp)
    const auto act = kind == INT4_TORCH ? at::kBFloat16 : at::kFloat;
    auto flat = x.dim() == 2 ? x : x.reshape({-1, in_features});
    if (flat.scalar_type() != act) flat = flat.to(act);
    if (!flat.is_contiguous()) flat = flat.contiguous();
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

// A feature prophet's residual MLPs in one call (specdec.prophets.feature: `FeatureHead.step` of an eagle whose
// blocks multiply on the block kernels): block i maps x to x + down_i(silu(up_i(i == 0 ? [x; extra] : x))), with
// the ATen calls and products `ResidualMLP.forward` makes, in its order, so the same bits, without its ~10
// interpreter round trips a draft step (an eagle's step after a target pass: 176 us, most of it the calls).
torch::Tensor residual_mlps(const std::vector<Product>& ups, const std::vector<Product>& downs, torch::Tensor x,
                            const torch::Tensor& extra) {
  TORCH_CHECK(!ups.empty() && ups.size() == downs.size(), "one down product per up product");
  for (size_t i = 0; i < ups.size(); ++i) {
    const auto inp = i == 0 ? at::cat({x, extra}, -1) : x;
    x = x + downs[i].mm(at::silu(ups[i].mm(inp)));
  }
  return x;
}

}  // namespace
