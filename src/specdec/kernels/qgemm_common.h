// What the kernels of specdec.qgemm share: the block formats, implementation ids, fp16 loads, the tiling of rows,
// and one driver: the entry points' checks and outputs, the split of weight rows over threads, the loop of weight
// rows against tiles of rows, and the dispatch of a tile's row count to its kernel. Included by qgemm.cpp (float32
// activations), qgemm8.cpp (int8 activations) and qgemm16.cpp (bfloat16 activations, weights in panels); internal
// to each.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
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

// The implementations a kernel has compiled in (scalar always; AVX2 and its AVX-512 one where the compiler targets
// them): `impl` 0 asks for the best.
struct Impls {
  bool avx2, avx512;
  const char* avx512_name;  // how impls() names the AVX-512 implementation
  Impl best() const { return avx512 ? AVX512 : (avx2 ? AVX2 : SCALAR); }
  bool has(Impl impl) const { return impl == SCALAR || (impl == AVX2 && avx2) || (impl == AVX512 && avx512); }
  Impl resolve(int64_t impl) const { return impl == AUTO ? best() : static_cast<Impl>(impl); }
  std::vector<std::string> names() const {  // worst to best
    std::vector<std::string> out{"scalar"};
    if (avx2) out.emplace_back("avx2");
    if (avx512) out.emplace_back(avx512_name);
    return out;
  }
};

// The checks an entry point `name` makes of x (M, K) float32 and its weights, `what` (uint8 (`rows`, K/32, bytes),
// `how`: what makes them).
inline void check_product_args(const torch::Tensor& x, const torch::Tensor& w, int64_t bytes, const std::string& name,
                               const char* what = "blocks", const char* rows = "N", const char* how = "") {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, name, ": x must be 2-D (M, K), got ", x.dim(), " dimensions");
  TORCH_CHECK(x.is_contiguous(), name, ": x must be contiguous");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 3 && w.size(2) == bytes && w.is_contiguous(), name, ": ",
              what, " must be contiguous uint8 of shape (", rows, ", K/32, ", bytes, ")", how, ", got ",
              w.scalar_type(), " ", w.sizes(), w.is_contiguous() ? "" : " (not contiguous)");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % QK == 0, name, ": K (", K, ") must be a multiple of 32");
  TORCH_CHECK(w.size(1) * QK == K, name, ": ", what, " hold K = ", w.size(1) * QK, " inputs a row, x has K = ", K);
}

// An entry point's product once its arguments are checked: the (M, N) float32 output of x (M, K), empty products
// answered here, run(x, M, K, out) for the rest.
template <class Run>
torch::Tensor product(const torch::Tensor& x, int64_t N, const Run& run) {
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  run(x.data_ptr<float>(), M, K, out.data_ptr<float>());
  return out;
}

// The float and int8 kernels' entry point: x (M, K) float32 @ blocks (N, K/32, bytes of `fmt`) on implementation
// `impl` (0: the best of `impls`), named q4_1_mm<suffix> / q8_0_mm<suffix> in its errors;
// run(Fmt constant, x, M, K, out, impl) computes a product that is not empty.
template <class Run>
torch::Tensor block_product(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt, int64_t impl_arg,
                            const Impls& impls, const char* suffix, const Run& run) {
  TORCH_CHECK(fmt == Q4_1 || fmt == Q8_0, "qgemm: unknown format ", fmt, " (0: Q4_1, 1: Q8_0)");
  const std::string name = std::string(fmt == Q4_1 ? "q4_1_mm" : "q8_0_mm") + suffix;
  check_product_args(x, blocks, fmt == Q4_1 ? block_bytes<Q4_1>() : block_bytes<Q8_0>(), name);
  const Impl impl = impls.resolve(impl_arg);
  TORCH_CHECK(impls.has(impl), name, ": implementation ", impl_arg, " is not compiled in this build");
  return product(x, blocks.size(0), [&](const float* xp, int64_t M, int64_t K, float* out) {
    if (fmt == Q4_1)
      run(std::integral_constant<Fmt, Q4_1>{}, xp, M, K, out, impl);
    else
      run(std::integral_constant<Fmt, Q8_0>{}, xp, M, K, out, impl);
  });
}

// Weight rows [0, N) split over torch's threads in units of `unit` rows, at least ~64K weight-row products (K
// inputs, M activation rows) a task so that small products stay on one thread: body(n0, n1) for each task's rows.
template <class Body>
void split_rows(int64_t N, int64_t unit, int64_t K, int64_t M, const Body& body) {
  const int64_t units = (N + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (unit * K * std::max<int64_t>(M, 1)));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) { body(u0 * unit, std::min(N, u1 * unit)); });
}

// One task's weight rows [n0, n1), `group` rows at a time, each group against every tile of rows:
// tile(r0, mt, g0, g1).
template <class Tile>
void groups_by_tiles(const std::vector<std::pair<int64_t, int>>& tiles, int64_t n0, int64_t n1, int64_t group,
                     const Tile& tile) {
  for (int64_t g = n0; g < n1; g += group) {
    const int64_t g1 = std::min(n1, g + group);
    for (const auto& t : tiles) tile(t.first, t.second, g, g1);
  }
}

constexpr int64_t N_UNIT = 16;  // weight rows a unit of the float and int8 kernels' split over threads

// The float and int8 kernels' loop: weight rows [0, N) split over threads, each task's rows against every tile of
// rows, 4 weight rows at a time on AVX-512 (their blocks stay in L1), else one: tile(r0, mt, g0, g1).
template <class Tile>
void rows_by_tiles(Impl impl, const std::vector<std::pair<int64_t, int>>& tiles, int64_t N, int64_t K, int64_t M,
                   const Tile& tile) {
  const int64_t group = impl == AVX512 ? 4 : 1;
  split_rows(N, N_UNIT, K, M, [&](int64_t n0, int64_t n1) { groups_by_tiles(tiles, n0, n1, group, tile); });
}

// body(std::integral_constant<int, MT>{}) for MT = mt, at most MAX (mt >= 1): a tile's row count as the
// compile-time constant its kernel is instantiated for (mt above MAX runs the MAX-row kernel).
template <int MAX, class Body>
inline void with_rows(int mt, const Body& body) {
  if constexpr (MAX > 1) {
    if (mt < MAX) return with_rows<MAX - 1>(mt, body);
  }
  body(std::integral_constant<int, MAX>{});
}

}  // namespace
