// What both kernels of specdec.qgemm share: the block formats, implementation ids, fp16 loads and the tiling of
// rows. Included by qgemm.cpp (float32 activations) and qgemm8.cpp (int8 activations); internal to each.
#pragma once

#include <c10/util/Half.h>

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

}  // namespace
