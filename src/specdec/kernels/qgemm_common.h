// What the kernels of specdec.qgemm share: the block formats, implementation ids, fp16 loads, the tiling of rows
// and the block products' argument checks. Included by qgemm.cpp (float32 activations), qgemm8.cpp (int8
// activations) and qgemm16.cpp (bfloat16 activations, Q4_1 in panels); internal to each.
#pragma once

#include <c10/util/Half.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // weights a block

enum Fmt : int64_t { Q4_1 = 0, Q8_0 = 1 };
enum Impl : int64_t { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3 };

template <Fmt F>
constexpr int64_t block_bytes() {
  return F == Q4_1 ? 20 : 34;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

inline float half_to_float(const uint8_t* p) {
  return c10::detail::fp16_ieee_to_fp32_value(load_u16(p));
}

// Tiles of rows: all M rows in one tile up to `single`, else ceil(M / tile) tiles of near-equal height.
std::vector<std::pair<int64_t, int>> row_tiles(int64_t M, int single, int tile) {
  std::vector<std::pair<int64_t, int>> tiles;
  if (M <= single) {
    if (M > 0) tiles.emplace_back(0, static_cast<int>(M));
    return tiles;
  }
  const int64_t count = (M + tile - 1) / tile;
  int64_t r0 = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r1 = M * (i + 1) / count;
    tiles.emplace_back(r0, static_cast<int>(r1 - r0));
    r0 = r1;
  }
  return tiles;
}

// The checks the block products' entry points (qmm, qmm8) make of x (M, K) float32 and blocks (N, K/32, bytes):
// errors named after the entry point `name`.
inline void check_product_args(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt, const char* name) {
  const int64_t bytes = fmt == Q4_1 ? 20 : 34;
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), name, ": tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, name, ": x must be 2-D (M, K), got ", x.dim(), " dimensions");
  TORCH_CHECK(x.is_contiguous(), name, ": x must be contiguous");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8, name, ": blocks must be uint8, got ", blocks.scalar_type());
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == bytes, name, ": blocks must have shape (N, K/32, ", bytes,
              "), got ", blocks.sizes());
  TORCH_CHECK(blocks.is_contiguous(), name, ": blocks must be contiguous");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % QK == 0, name, ": K (", K, ") must be a multiple of 32");
  TORCH_CHECK(blocks.size(1) * QK == K, name, ": blocks hold K = ", blocks.size(1) * QK,
              " inputs a row, x has K = ", K);
}

}  // namespace
