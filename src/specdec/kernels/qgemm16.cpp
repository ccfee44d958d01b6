// Matrix products of activations rounded to bfloat16 with GGUF block weights (Q4_1, Q8_0), on CPUs with
// AVX-512 BF16 (vdpbf16ps: 32 multiply-adds an instruction, twice float32's 16).
//
//   y (M, N) = bf16(x) (M, K) @ bf16(W).T, W (N, K) held as the file's own blocks of 32 weights, each block
//   de-quantized as the float kernel does (Q4_1: w = fma(d, q, m); Q8_0: w = d * q, in float32) and rounded to
//   bfloat16 (round to nearest even): a relative 2^-9 a weight, against Q4's own step of a sixteenth of a block's
//   range. The activations are rounded to bfloat16 likewise, as PyTorch's int4 kernel does with them.
//
// Exactness. Each output element is computed by one fixed sequence of operations, whatever M, the other rows,
// the tiling or the thread count:
//   16 partial sums S[i] (one per pair of positions 2i, 2i+1 of a block), S[i] = vdpbf16ps(S[i], x pair, w pair)
//   over the blocks b in order, from S = 0 (one lane of the instruction: S + x[2i+1] w[2i+1] + x[2i] w[2i]);
//   then T[i] = S[i] + S[i+8] (i < 8), U[i] = T[i] + T[i+4] (i < 4), V[i] = U[i] + U[i+2] (i < 2), y = V[0] + V[1].
// A few rows (a decode step, a verification pass) run tiles with lanes across a block's pairs; many rows (a
// prompt's chunk, a large batch) run a register-blocked kernel with lanes across weight rows, the same
// instruction on the same pairs in the same order: the same bits. Only built where the compiler targets
// AVX-512 BF16 (-march=native on such a CPU); elsewhere `impls16` is empty and the kernel is not offered.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define QGEMM16 1
#endif

#include "qgemm_common.h"

namespace {
namespace mm16 {

#ifdef QGEMM16

// Rows a tile below BLOCKED_MIN_ROWS: all of them up to SINGLE, else tiles of at most TILE.
constexpr int SINGLE = 8;
constexpr int TILE = 8;
// From this many rows on, the register-blocked kernel (lanes across weight rows). Measured on a 2-core AMD
// EPYC Zen 4 (avx512_bf16), microseconds a row of SmolLM2's gate/up (3072 x 576), qkv (960 x 576) and down
// (576 x 1536) products, tiles against blocked: 32 rows 22.3 / 6.5 / 9.9 against 21.9 / 6.7 / 12.6; 64 rows
// 21.9 / 6.6 / 9.9 against 16.4 / 5.0 / 8.9; 256 rows 21.8 / 6.8 / 10.3 against 13.2 / 3.9 / 6.2.
constexpr int64_t BLOCKED_MIN_ROWS = 48;
// The blocked kernel's tile: NR weight rows (NV vectors of 16 lanes) by MR activation rows, MR * NV accumulators.
// (Four vectors, 24 dot products for 10 loads, ran slower on a 2-core Zen 4: 0.52-0.74x the float kernel's time
// at 256 rows against 0.52-0.56x with two, measured alternately.)
constexpr int NV = 2;
constexpr int64_t NR = 16 * NV;
constexpr int MR = 6;

// One block of weights as 32 bfloat16 words (position l in word l).
template <Fmt F>
inline __m512i dequant16(const uint8_t* blk) {
  if constexpr (F == Q4_1) {
    // lut[v] = fma(d, v, m) for v in 0..15 (float32), each weight a look-up of its code (vpermps reads the low 4
    // bits of an index), both halves rounded to bfloat16 in one conversion.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint32_t dm_bits;
    std::memcpy(&dm_bits, blk, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm_bits)));  // d, m (fp16 -> float32, exact)
    const __m512 lut = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), iota, _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 4)));
    const __m512 w0 = _mm512_permutexvar_ps(q, lut);                       // positions 0..15 (low nibbles)
    const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);  // positions 16..31 (high nibbles)
    return (__m512i)(_mm512_cvtne2ps_pbh(w1, w0));
  } else {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(blk)));
    const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))));
    const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))));
    return (__m512i)(_mm512_cvtne2ps_pbh(w1, w0));  // words 0..15 from w0, 16..31 from w1
  }
}

inline __m512 dot(__m512 acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)(x), (__m512bh)(w));
}

// The tree T, U, V, y over the 16 lanes of one output's partial sums.
inline float reduce16(__m512 s) {
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// x (M, K) float32 -> bfloat16 words (M, K), rounded to nearest even.
void to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, (__m512i)(v));
  }
  for (; i < n; ++i) {  // the same rounding (K is a multiple of 32: only for odd sizes)
    const __m128bh v = _mm_cvtneps_pbh(_mm_set_ss(x[i]));
    out[i] = static_cast<uint16_t>(_mm_extract_epi16((__m128i)(v), 0));
  }
}

// One product's weights and output (the activations, in bfloat16, are passed beside it: row-major or repacked).
struct Args {
  const uint8_t* w;    // (N, K/32, bytes)
  float* out;          // (M, N)
  int64_t K;
  int64_t N;
  int64_t row_bytes;
};

// The tile of rows at r0 (mt rows) as (K/32, mt, 32) words at dst + r0 * K: a block's rows contiguous.
inline void pack_tile16(const uint16_t* xb, int64_t K, int64_t r0, int mt, uint16_t* dst) {
  const int64_t KB = K / QK;
  uint16_t* d = dst + r0 * K;
  for (int64_t b = 0; b < KB; ++b)
    for (int r = 0; r < mt; ++r) std::memcpy(d + (b * mt + r) * QK, xb + (r0 + r) * K + b * QK, QK * 2);
}

// MT activation rows (a packed tile) against NB weight rows from n0.
template <Fmt F, int MT, int NB>
void tile16(const Args& a, const uint16_t* xp, int64_t r0, int64_t n0) {
  constexpr int64_t BB = block_bytes<F>();
  const int64_t KB = a.K / QK;
  const uint8_t* rows[NB];
  for (int j = 0; j < NB; ++j) rows[j] = a.w + (n0 + j) * a.row_bytes;
  __m512 acc[MT][NB];
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m512i w[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = rows[j] + b * BB;
      _mm_prefetch(reinterpret_cast<const char*>(blk + NB * a.row_bytes), _MM_HINT_T0);
      w[j] = dequant16<F>(blk);
    }
    const uint16_t* xk = xp + r0 * a.K + b * MT * QK;  // the tile's rows (see pack_tile16)
    for (int r = 0; r < MT; ++r) {
      const __m512i xv = _mm512_loadu_si512(xk + r * QK);
      for (int j = 0; j < NB; ++j) acc[r][j] = dot(acc[r][j], xv, w[j]);
    }
  }
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NB; ++j) a.out[(r0 + r) * a.N + n0 + j] = reduce16(acc[r][j]);
}

constexpr int nb16(int /*mt*/) { return 2; }  // two weight rows a group (one row alone: a vdpbf16ps chain, latency ~6)

template <Fmt F, int MT>
void rows16(const Args& a, const uint16_t* xp, int64_t r0, int64_t n0, int64_t n1) {
  constexpr int NB = nb16(MT);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile16<F, MT, NB>(a, xp, r0, n);
  for (; n < n1; ++n) tile16<F, MT, 1>(a, xp, r0, n);
}

template <Fmt F>
void dispatch16(const Args& a, const uint16_t* xp, int64_t r0, int mt, int64_t n0, int64_t n1) {
  switch (mt) {
    case 1: return rows16<F, 1>(a, xp, r0, n0, n1);
    case 2: return rows16<F, 2>(a, xp, r0, n0, n1);
    case 3: return rows16<F, 3>(a, xp, r0, n0, n1);
    case 4: return rows16<F, 4>(a, xp, r0, n0, n1);
    case 5: return rows16<F, 5>(a, xp, r0, n0, n1);
    case 6: return rows16<F, 6>(a, xp, r0, n0, n1);
    case 7: return rows16<F, 7>(a, xp, r0, n0, n1);
    default: return rows16<F, 8>(a, xp, r0, n0, n1);
  }
}

template <Fmt F>
void run_tiles(const uint16_t* xb, int64_t M, const Args& a) {
  const auto tiles = row_tiles(M, SINGLE, TILE);
  std::vector<uint16_t> xp(static_cast<size_t>(M * a.K));
  for (const auto& t : tiles) pack_tile16(xb, a.K, t.first, t.second, xp.data());
  constexpr int64_t N_UNIT = 16;
  const int64_t units = (a.N + N_UNIT - 1) / N_UNIT;
  const int64_t per_unit = N_UNIT * a.K * std::max<int64_t>(M, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_unit);  // small products on one thread
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * N_UNIT, n1 = std::min(a.N, u1 * N_UNIT);
    constexpr int64_t GROUP = 4;  // a few weight rows against every tile, their blocks in L1
    for (int64_t g = n0; g < n1; g += GROUP) {
      const int64_t g1 = std::min(n1, g + GROUP);
      for (const auto& t : tiles) dispatch16<F>(a, xp.data(), t.first, t.second, g, g1);
    }
  });
}

// ---- the register-blocked kernel: lanes across weight rows

// Weight rows [n0, n0 + NR) (rows past N read as zeros) into wt[i][b][c]: pair i (positions 2i, 2i+1) of block b of
// weight row c, as one 32-bit word. row: scratch of K words.
template <Fmt F>
void panel16(const Args& a, int64_t n0, uint32_t* wt, uint16_t* row) {
  constexpr int64_t BB = block_bytes<F>();
  const int64_t KB = a.K / QK;
  for (int64_t c = 0; c < NR; ++c) {
    if (n0 + c < a.N) {
      const uint8_t* w = a.w + (n0 + c) * a.row_bytes;
      for (int64_t b = 0; b < KB; ++b) _mm512_storeu_si512(row + b * QK, dequant16<F>(w + b * BB));
    } else {
      std::memset(row, 0, static_cast<size_t>(a.K) * 2);
    }
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(row);
    for (int64_t b = 0; b < KB; ++b)
      for (int64_t i = 0; i < QK / 2; ++i) wt[(i * KB + b) * NR + c] = pairs[b * (QK / 2) + i];
  }
}

// Activation rows [r0, r0 + mt) of xb (M, K) into xt[i][b][r] (MR slots a (i, b)).
inline void pack_rows_t16(const uint16_t* xb, int64_t K, int64_t r0, int mt, uint32_t* xt) {
  const int64_t KB = K / QK;
  for (int r = 0; r < mt; ++r) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(xb + (r0 + r) * K);
    for (int64_t b = 0; b < KB; ++b)
      for (int64_t i = 0; i < QK / 2; ++i) xt[(i * KB + b) * MR + r] = pairs[b * (QK / 2) + i];
  }
}

template <int MT>
void tile_t16(const uint32_t* xt, const uint32_t* wt, int64_t KB, float* out, int64_t N, int64_t r0, int64_t n0,
              int64_t nc) {
  alignas(64) float S[QK / 2][MT][NR];
  for (int i = 0; i < QK / 2; ++i) {
    __m512 acc[MT][NV];
    for (int r = 0; r < MT; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const uint32_t* wi = wt + i * KB * NR;
    const uint32_t* xi = xt + i * KB * MR;
    for (int64_t b = 0; b < KB; ++b) {
      __m512i w[NV];
      for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(wi + b * NR + 16 * v);
      for (int r = 0; r < MT; ++r) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xi[b * MR + r]));
        for (int v = 0; v < NV; ++v) acc[r][v] = dot(acc[r][v], xv, w[v]);
      }
    }
    for (int r = 0; r < MT; ++r)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(S[i][r] + 16 * v, acc[r][v]);
  }
  for (int r = 0; r < MT; ++r) {
    for (int h = 0; h < NV; ++h) {  // weight rows 16h..16h+15 of the panel, one a lane
      __m512 T[8], U[4], V[2];
      for (int i = 0; i < 8; ++i) T[i] = _mm512_add_ps(_mm512_load_ps(S[i][r] + 16 * h), _mm512_load_ps(S[i + 8][r] + 16 * h));
      for (int i = 0; i < 4; ++i) U[i] = _mm512_add_ps(T[i], T[i + 4]);
      for (int i = 0; i < 2; ++i) V[i] = _mm512_add_ps(U[i], U[i + 2]);
      alignas(64) float y[16];
      _mm512_store_ps(y, _mm512_add_ps(V[0], V[1]));
      for (int c = 0; c < 16 && 16 * h + c < nc; ++c) out[(r0 + r) * N + n0 + 16 * h + c] = y[c];
    }
  }
}

inline void dispatch_t16(int mt, const uint32_t* xt, const uint32_t* wt, int64_t KB, float* out, int64_t N,
                         int64_t r0, int64_t n0, int64_t nc) {
  switch (mt) {
    case 1: return tile_t16<1>(xt, wt, KB, out, N, r0, n0, nc);
    case 2: return tile_t16<2>(xt, wt, KB, out, N, r0, n0, nc);
    case 3: return tile_t16<3>(xt, wt, KB, out, N, r0, n0, nc);
    case 4: return tile_t16<4>(xt, wt, KB, out, N, r0, n0, nc);
    case 5: return tile_t16<5>(xt, wt, KB, out, N, r0, n0, nc);
    default: return tile_t16<6>(xt, wt, KB, out, N, r0, n0, nc);
  }
}

template <Fmt F>
void run_blocked(const uint16_t* xb, int64_t M, const Args& a) {
  const int64_t KB = a.K / QK;
  const auto tiles = row_tiles(M, MR, MR);
  const int64_t tile_words = (QK / 2) * KB * MR;
  std::vector<uint32_t> xt(static_cast<size_t>(tiles.size() * tile_words));
  for (size_t i = 0; i < tiles.size(); ++i)
    pack_rows_t16(xb, a.K, tiles[i].first, tiles[i].second, xt.data() + i * tile_words);
  const int64_t panels = (a.N + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint32_t> wt(static_cast<size_t>(NR * a.K / 2));
    std::vector<uint16_t> row(static_cast<size_t>(a.K));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR;
      panel16<F>(a, n0, wt.data(), row.data());
      for (size_t i = 0; i < tiles.size(); ++i)
        dispatch_t16(tiles[i].second, xt.data() + i * tile_words, wt.data(), KB, a.out, a.N, tiles[i].first, n0,
                     std::min(NR, a.N - n0));
    }
  });
}

template <Fmt F>
void run(const float* x, int64_t M, const Args& a) {
  std::vector<uint16_t> xb(static_cast<size_t>(M * a.K));
  to_bf16(x, M * a.K, xb.data());
  if (M >= BLOCKED_MIN_ROWS) return run_blocked<F>(xb.data(), M, a);
  run_tiles<F>(xb.data(), M, a);
}

#endif  // QGEMM16

}  // namespace mm16

bool compiled16() {
#ifdef QGEMM16
  return true;
#else
  return false;
#endif
}

torch::Tensor qmm16(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt) {
  TORCH_CHECK(fmt == Q4_1 || fmt == Q8_0, "qgemm: unknown format ", fmt, " (0: Q4_1, 1: Q8_0)");
  const char* name = fmt == Q4_1 ? "q4_1_mm16" : "q8_0_mm16";
  TORCH_CHECK(compiled16(), name, ": this build has no AVX-512 BF16 kernel (the CPU lacks avx512_bf16)");
  check_product_args(x, blocks, fmt, name);
  const int64_t bytes = fmt == Q4_1 ? 20 : 34;
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
#ifdef QGEMM16
  const mm16::Args a{blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), K, N, K / QK * bytes};
  if (fmt == Q4_1)
    mm16::run<Q4_1>(x.data_ptr<float>(), M, a);
  else
    mm16::run<Q8_0>(x.data_ptr<float>(), M, a);
#endif
  return out;
}

torch::Tensor q4_1_mm16(const torch::Tensor& x, const torch::Tensor& blocks) { return qmm16(x, blocks, Q4_1); }
torch::Tensor q8_0_mm16(const torch::Tensor& x, const torch::Tensor& blocks) { return qmm16(x, blocks, Q8_0); }

// bfloat16 words of x as the kernel rounds its activations (tests).
torch::Tensor round_bf16(const torch::Tensor& x) {
  TORCH_CHECK(compiled16(), "round_bf16: this build has no AVX-512 BF16 kernel");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "round_bf16: x must be contiguous float32");
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kBFloat16));
#ifdef QGEMM16
  mm16::to_bf16(x.data_ptr<float>(), x.numel(), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#endif
  return out;
}

std::vector<std::string> impls16() {
  std::vector<std::string> names;
  if (compiled16()) names.emplace_back("avx512bf16");
  return names;
}

}  // namespace

// For the layer loop (step.cpp): the product as `q4_1_mm16` / `q8_0_mm16` computes it.
torch::Tensor qgemm_blocks_mm16(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt) {
  return qmm16(x, blocks, fmt);
}

// The bfloat16 kernel's entry points, added to the extension's module by qgemm.cpp.
void register_mm16(pybind11::module& m) {
  m.def("q4_1_mm16", &q4_1_mm16, "bf16(x) (M, K) @ bf16(Q4_1 blocks (N, K/32, 20)).T -> (M, N) float32");
  m.def("q8_0_mm16", &q8_0_mm16, "bf16(x) (M, K) @ bf16(Q8_0 blocks (N, K/32, 34)).T -> (M, N) float32");
  m.def("qmm16", &qmm16, "qmm16(x, blocks, fmt): fmt 0 Q4_1, 1 Q8_0");
  m.def("round_bf16", &round_bf16, "x float32 -> bfloat16 as the kernel rounds its activations");
  m.def("impls16", &impls16, "['avx512bf16'] where this build has the kernel, else []");
}
