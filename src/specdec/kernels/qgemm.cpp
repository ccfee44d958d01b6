// Matrix products of float32 activations with GGUF block weights (Q4_1, Q8_0), on the CPU.
//
//   y (M, N) = x (M, K) @ W.T, W (N, K) held as the file's own blocks of 32 weights:
//   Q4_1: 20 bytes a block: fp16 d, fp16 m, 16 bytes qs; w[j] = fma(d, qs[j] & 15, m), w[j+16] = fma(d, qs[j] >> 4, m)
//   Q8_0: 34 bytes a block: fp16 d, 32 int8 q;           w[j] = d * q[j]
//
// Every weight block is de-quantized (float32, d and m converted from fp16 exactly) once per tile of up to
// 6 activation rows and applied to all of them (Q4_1 through a 16-entry table lut[v] = fma(d, v, m) and
// vpermps), so a product of a few rows pays for the unpacking once; what remains per row is 2 FMAs a block.
// On AVX2, a product of more tiles (a batch's verification pass) de-quantizes a few weight rows at a time into a
// panel in L1 and applies it to every tile, so each weight is unpacked once per product; on AVX2 and AVX-512 a
// product of many rows (a prompt's chunk, a large batch) runs a register-blocked kernel over transposed panels (lanes across weight
// rows: 12 FMAs for 8 loads) that computes the same partial sums in the same order.
//
// Exactness. Each output element is computed by one fixed sequence of float operations, whatever M, the
// other rows, the tiling, the thread count or the instruction set (scalar, AVX2, AVX-512: all three give
// the same bits):
//   32 partial sums S[l] (one per position l of a block), S[l] = fma(x[32b + l], w[32b + l], S[l]) over the
//   blocks b in order, from S = 0; then T[l] = S[l] + S[l+16] (l < 16), U[l] = T[l] + T[l+8] (l < 8),
//   V[l] = U[l] + U[l+4] (l < 4), y = (V[0] + V[2]) + (V[1] + V[3]).
// Rows are only ever tiled (never treated differently by count), and the work is split over N only.
// Build with -ffp-contract=off so that the scalar code is not contracted differently from the intrinsics.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// The implementations this build compiles (1) or leaves out (0), by what the compiler targets.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMM_AVX2 1
#else
#define QGEMM_AVX2 0
#endif
#if defined(__AVX512F__) && QGEMM_AVX2
#define QGEMM_AVX512 1
#else
#define QGEMM_AVX512 0
#endif

#include "qgemm_common.h"

namespace {

// One product. The activations are repacked by tiles of rows: a tile of mt rows starting at row r0 lies at
// xp + r0 * K as (K/32, mt, 32) floats, so that the rows of a block are contiguous (fixed offsets, one stream).
struct Args {
  const float* xp;   // (M, K) repacked by tiles
  const uint8_t* w;  // (N, K/32, bytes)
  float* out;        // (M, N)
  int64_t K;
  int64_t N;
  int64_t row_bytes;  // K/32 * bytes
};

// The tile of rows at x row r0 (mt rows, (K/32, mt, 32)) into xp.
inline void pack_tile(const float* x, int64_t K, int64_t r0, int mt, float* xp) {
  const int64_t KB = K / QK;
  float* dst = xp + r0 * K;
  for (int64_t b = 0; b < KB; ++b)
    for (int r = 0; r < mt; ++r) std::memcpy(dst + (b * mt + r) * QK, x + (r0 + r) * K + b * QK, QK * sizeof(float));
}

// ------------------------------------------------------------------------------------------------ scalar

// The tree that reduces an output's 32 partial sums (see Exactness), for scalars or for vectors of outputs:
// partial(l) gives S[l], add adds two values.
template <class Value, class Partial, class Add>
inline Value reduce_tree(Partial partial, Add add) {
  Value T[16], U[8], V[4];
  for (int l = 0; l < 16; ++l) T[l] = add(partial(l), partial(l + 16));
  for (int l = 0; l < 8; ++l) U[l] = add(T[l], T[l + 8]);
  for (int l = 0; l < 4; ++l) V[l] = add(U[l], U[l + 4]);
  return add(add(V[0], V[2]), add(V[1], V[3]));
}

inline float reduce32(const float* S) {
  return reduce_tree<float>([S](int l) { return S[l]; }, [](float a, float b) { return a + b; });
}

template <Fmt F>
inline void dequant_scalar(const uint8_t* blk, float* w) {
  if constexpr (F == Q4_1) {
    const float d = half_to_float(blk);
    const float m = half_to_float(blk + 2);
    const uint8_t* qs = blk + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = std::fma(d, static_cast<float>(qs[j] & 15), m);
      w[j + 16] = std::fma(d, static_cast<float>(qs[j] >> 4), m);
    }
  } else {
    const float d = half_to_float(blk);
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
  }
}

constexpr int SCALAR_TILE = 8;

template <Fmt F>
void tile_scalar(const Args& a, int64_t r0, int mt, int64_t n) {
  constexpr int64_t BB = block_bytes<F>();
  const int64_t KB = a.K / QK;
  float S[SCALAR_TILE][32] = {};
  float w[32];
  const uint8_t* row = a.w + n * a.row_bytes;
  for (int64_t b = 0; b < KB; ++b) {
    dequant_scalar<F>(row + b * BB, w);
    const float* xb = a.xp + r0 * a.K + b * mt * QK;
    for (int r = 0; r < mt; ++r)
      for (int l = 0; l < 32; ++l) S[r][l] = std::fma(xb[r * QK + l], w[l], S[r][l]);
  }
  for (int r = 0; r < mt; ++r) a.out[(r0 + r) * a.N + n] = reduce32(S[r]);
}

// ------------------------------------------------------------------------------------------------ AVX2

#if QGEMM_AVX2

// A Q4_1 block's d and m (its first 4 bytes) as floats [d, m, 0, 0]: one load and one conversion.
inline __m128 load_dm(const uint8_t* blk) {
  uint32_t v;
  std::memcpy(&v, blk, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(v)));
}

// V[l] = U[l] + U[l+4], then (V0 + V2) + (V1 + V3).
inline float reduce_u8(__m256 u) {
  const __m128 v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
  const __m128 w = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
}

// The 16 weights of half h (h = 0: positions 0..15, h = 1: 16..31) of one block, as two vectors of 8.
template <Fmt F>
inline void dequant_avx2(const uint8_t* blk, int h, __m256& w0, __m256& w1) {
  if constexpr (F == Q4_1) {
    const __m128 dm = load_dm(blk);
    const __m256 d = _mm256_broadcastss_ps(dm);
    const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    __m256i q0 = _mm256_cvtepu8_epi32(raw);
    __m256i q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
    if (h == 0) {
      const __m256i mask = _mm256_set1_epi32(15);
      q0 = _mm256_and_si256(q0, mask);
      q1 = _mm256_and_si256(q1, mask);
    } else {
      q0 = _mm256_srli_epi32(q0, 4);
      q1 = _mm256_srli_epi32(q1, 4);
    }
    w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q0), m);
    w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q1), m);
  } else {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
    const uint8_t* q = blk + 2 + 16 * h;
    const __m256i q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    w0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q0));
    w1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q1));
  }
}

constexpr int AVX2_TILE = 5;  // rows a tile: 2 accumulators a row and a pass (positions 0..15, then 16..31)

// A whole block's 32 weights as four vectors of 8 (positions 0..7, 8..15, 16..23, 24..31): the values
// dequant_avx2 gives for h = 0 and h = 1, with the block's bytes loaded once.
template <Fmt F>
inline void dequant_block_avx2(const uint8_t* blk, __m256 w[4]) {
  if constexpr (F == Q4_1) {
    const __m128 dm = load_dm(blk);
    const __m256 d = _mm256_broadcastss_ps(dm);
    const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m256i q0 = _mm256_cvtepu8_epi32(raw);
    const __m256i q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
    const __m256i mask = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q0, mask)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q1, mask)), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), m);
  } else {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
    for (int i = 0; i < 4; ++i) {
      const auto* q = reinterpret_cast<const __m128i*>(blk + 2 + 8 * i);
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q))));
    }
  }
}

// Where a tile's weights come from: a weight row's blocks, de-quantized as the tile reads them (`FromBlocks`), or a
// panel the row was de-quantized into beforehand (`FromPanel`: the same values). Either gives, for block b, its
// half h (positions 16h..16h+15) as two vectors, or all four vectors of 8.
// FromBlocks prefetches PREFETCH bytes ahead of the block it reads (the weight rows a thread reads are contiguous;
// a prefetch past the end of the weights is a hint that never faults). Measured on a 2-core AMD EPYC (Zen 3, AVX2),
// SmolLM2's products of one row streamed from memory at 2 threads: 0.86-0.99x the time (256-8192 bytes tried).
constexpr int64_t PREFETCH = 2048;

template <Fmt F>
struct FromBlocks {
  const uint8_t* row;
  void half(int64_t b, int h, __m256& w0, __m256& w1) const {
    const uint8_t* blk = row + b * block_bytes<F>();
    if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    dequant_avx2<F>(blk, h, w0, w1);
  }
  void block(int64_t b, __m256 w[4]) const {
    const uint8_t* blk = row + b * block_bytes<F>();
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    dequant_block_avx2<F>(blk, w);
  }
};

struct FromPanel {
  const float* panel;
  void half(int64_t b, int h, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(panel + b * QK + 16 * h);
    w1 = _mm256_loadu_ps(panel + b * QK + 16 * h + 8);
  }
  void block(int64_t b, __m256 w[4]) const {
    for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps(panel + b * QK + 8 * j);
  }
};

// Up to five rows a tile in two passes over the blocks (positions 0..15, then 16..31), two accumulators a row.
template <int MT, class W>
void tile_avx2(const Args& a, int64_t r0, int64_t n, const W& weights) {
  const int64_t KB = a.K / QK;
  const float* x = a.xp + r0 * a.K;
  __m256 first[MT][2];
  __m256 acc[MT][2];
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
      __m256 w0, w1;
      weights.half(b, h, w0, w1);
      const float* xb = x + b * MT * QK + 16 * h;
      for (int r = 0; r < MT; ++r) {
        acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + r * QK), w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + r * QK + 8), w1, acc[r][1]);
      }
    }
    if (h == 0) {
      for (int r = 0; r < MT; ++r) {
        first[r][0] = acc[r][0];
        first[r][1] = acc[r][1];
      }
    }
  }
  for (int r = 0; r < MT; ++r) {
    const __m256 t_lo = _mm256_add_ps(first[r][0], acc[r][0]);  // T[0..7]
    const __m256 t_hi = _mm256_add_ps(first[r][1], acc[r][1]);  // T[8..15]
    a.out[(r0 + r) * a.N + n] = reduce_u8(_mm256_add_ps(t_lo, t_hi));
  }
}

// One or two rows a tile in one pass over the blocks, with four accumulators a row (one per 8 positions of a
// block): the same multiply-adds in the same order as tile_avx2's two passes (accumulator j here is tile_avx2's
// accumulator j % 2 of pass j / 2), so the same bits, with four independent chains instead of two (a one-row
// product is bound by the multiply-add's latency, not by its throughput).
template <int MT, class W>
void tile_avx2_one_pass(const Args& a, int64_t r0, int64_t n, const W& weights) {
  const int64_t KB = a.K / QK;
  const float* x = a.xp + r0 * a.K;
  __m256 acc[MT][4];
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m256 w[4];
    weights.block(b, w);
    const float* xb = x + b * MT * QK;
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + r * QK + 8 * j), w[j], acc[r][j]);
  }
  for (int r = 0; r < MT; ++r) {
    const __m256 t_lo = _mm256_add_ps(acc[r][0], acc[r][2]);  // T[0..7]
    const __m256 t_hi = _mm256_add_ps(acc[r][1], acc[r][3]);  // T[8..15]
    a.out[(r0 + r) * a.N + n] = reduce_u8(_mm256_add_ps(t_lo, t_hi));
  }
}

// One tile of mt rows against weight row n.
template <class W>
void dispatch_avx2(const Args& a, int64_t r0, int mt, int64_t n, const W& weights) {
  with_rows<AVX2_TILE>(mt, [&](auto rows) {
    constexpr int MT = decltype(rows)::value;
    if constexpr (MT <= 2)
      tile_avx2_one_pass<MT>(a, r0, n, weights);
    else
      tile_avx2<MT>(a, r0, n, weights);
  });
}

// Weight row n's K weights, de-quantized as dequant_block_avx2 does, into panel.
template <Fmt F>
void dequant_row_avx2(const Args& a, int64_t n, float* panel) {
  const FromBlocks<F> blocks{a.w + n * a.row_bytes};
  for (int64_t b = 0; b < a.K / QK; ++b) {
    __m256 w[4];
    blocks.block(b, w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(panel + b * QK + 8 * j, w[j]);
  }
}

// Products of more than one tile of rows de-quantize PANEL_ROWS weight rows at a time into a panel (in L1) and run
// every tile against it: each weight row is de-quantized once for the product instead of once a tile, with the
// same multiply-adds in the same order (the same bits). On a 2-core AMD EPYC with AVX2 only (SmolLM2's products, 1
// thread, in cache) they took 0.6-0.8x the time at 16-128 rows, which now run the register-blocked kernel below
// (BLOCKED_MIN_ROWS), so panels serve 8-15 rows (Q4_1; Q8_0: 11-15). Below that the weights are de-quantized as
// each tile reads them, a full tile of 5 rows first and the rest in one more (6 = 5 + 1, 7 = 5 + 2): the 5-row
// tile costs least a row. Measured there (2 threads, the same run alternating, median of 60): a product of 6
// rows took 3.0-3.5 times one row's through panels and two tiles of 3, 2.6-3.3 times this way (7 rows: 3.4-5.3
// against 2.7-4.2); a verification pass scores K + 1 rows, so these are rounds of K = 5 and 6.
constexpr int64_t PANEL_ROWS = 8;
constexpr int64_t PANEL_MIN_ROWS_Q4_1 = 8;

// Products of many rows (a prompt's chunk, a large batch) run a register-blocked kernel instead: each output
// element's 32 partial sums S[l] are the same chains over the blocks in the same order as above, but computed
// with lanes across weight rows instead of across positions. NR = 16 weight rows are de-quantized and
// transposed into a panel wt[l][b][c] (position l of block b of weight row c), and a tile of up to MR = 6
// activation rows, repacked as xt[l][b][r], runs one position l at a time: for each block b, two loads of 8
// weights (16 rows) and one broadcast a row feed 12 accumulators (12 FMAs for 8 loads, instead of 10 FMAs for 12
// loads). S[l] of each (row, weight row) is stored, then reduced by the same tree (T, U, V, y), lanes across
// weight rows. The same operations on the same values in the same order: the same bits.
constexpr int64_t NR = 16;
constexpr int MR = 6;

// Weight rows [n0, n0 + NR) (rows at or past N read as zeros) into wt[l][b][c], de-quantized as
// dequant_block_avx2 does. rows: scratch of 8 * K floats.
template <Fmt F>
void dequant_panel_t(const Args& a, int64_t n0, float* wt, float* rows) {
  const int64_t KB = a.K / QK;
  for (int64_t c8 = 0; c8 < NR; c8 += 8) {
    for (int64_t c = 0; c < 8; ++c) {
      if (n0 + c8 + c < a.N)
        dequant_row_avx2<F>(a, n0 + c8 + c, rows + c * a.K);
      else
        std::memset(rows + c * a.K, 0, a.K * sizeof(float));
    }
    for (int64_t b = 0; b < KB; ++b) {
      for (int j = 0; j < 4; ++j) {  // positions 8j..8j+7 of block b, 8 weight rows: an 8x8 transpose
        __m256 v[8];
        for (int c = 0; c < 8; ++c) v[c] = _mm256_loadu_ps(rows + c * a.K + b * QK + 8 * j);
        const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
        const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
        const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
        const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        const __m256 col[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                               _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                               _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                               _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(wt + ((8 * j + i) * KB + b) * NR + c8, col[i]);
      }
    }
  }
}

// Activation rows [r0, r0 + mt) of x (M, K) into xt[l][b][r] (MR slots a (l, b); rows past mt are not read).
inline void pack_rows_t(const float* x, int64_t K, int64_t r0, int mt, float* xt) {
  const int64_t KB = K / QK;
  for (int r = 0; r < mt; ++r) {
    const float* xr = x + (r0 + r) * K;
    for (int64_t b = 0; b < KB; ++b)
      for (int l = 0; l < QK; ++l) xt[(l * KB + b) * MR + r] = xr[b * QK + l];
  }
}

// One tile of MT activation rows against one panel of NR weight rows: out[(r0 + r) * N + n0 + c] for c < nc.
template <int MT>
void tile_t(const float* xt, const float* wt, int64_t KB, float* out, int64_t N, int64_t r0, int64_t n0, int64_t nc) {
  alignas(32) float S[QK][MT][NR];
  for (int l = 0; l < QK; ++l) {
    __m256 acc[MT][2];
    for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* wl = wt + l * KB * NR;
    const float* xl = xt + l * KB * MR;
    for (int64_t b = 0; b < KB; ++b) {
      const __m256 w0 = _mm256_loadu_ps(wl + b * NR);
      const __m256 w1 = _mm256_loadu_ps(wl + b * NR + 8);
      for (int r = 0; r < MT; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xl + b * MR + r);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < MT; ++r) {
      _mm256_store_ps(S[l][r], acc[r][0]);
      _mm256_store_ps(S[l][r] + 8, acc[r][1]);
    }
  }
  for (int r = 0; r < MT; ++r) {
    for (int h = 0; h < 2; ++h) {  // weight rows 8h..8h+7 of the panel, one per lane
      alignas(32) float y[8];
      _mm256_store_ps(y, reduce_tree<__m256>([&](int l) { return _mm256_load_ps(S[l][r] + 8 * h); },
                                             [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }));
      for (int c = 0; c < 8 && 8 * h + c < nc; ++c) out[(r0 + r) * N + n0 + 8 * h + c] = y[c];
    }
  }
}

inline void dispatch_t(int mt, const float* xt, const float* wt, int64_t KB, float* out, int64_t N, int64_t r0,
                       int64_t n0, int64_t nc) {
  with_rows<MR>(mt, [&](auto rows) { tile_t<decltype(rows)::value>(xt, wt, KB, out, N, r0, n0, nc); });
}

#endif  // QGEMM_AVX2

// ------------------------------------------------------------------------------------------------ AVX-512

#if QGEMM_AVX512

inline float reduce512(__m512 s_lo, __m512 s_hi) {
  const __m512 t = _mm512_add_ps(s_lo, s_hi);
  const __m256 t_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
  const __m256 u = _mm256_add_ps(_mm512_castps512_ps256(t), t_hi);
  const __m128 v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
  const __m128 w = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
}

template <Fmt F>
inline void dequant512(const uint8_t* blk, __m512& w_lo, __m512& w_hi) {
  if constexpr (F == Q4_1) {
    // lut[v] = fma(d, v, m) for v in 0..15, then each weight is a look-up of its code (the same value as
    // fma(d, q, m) computed per weight). vpermps reads the low 4 bits of each index.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128 dm = load_dm(blk);
    const __m512 d = _mm512_broadcastss_ps(dm);
    const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    const __m512 lut = _mm512_fmadd_ps(d, iota, m);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    w_lo = _mm512_permutexvar_ps(q, lut);
    w_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
  } else {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(blk)));
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
    w_lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0));
    w_hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1));
  }
}

// Weight rows a group, by tile height. Measured on Zen 4 with the weights streamed from DRAM (a model's
// matrices, all layers, do not stay in cache): one stream of blocks reads fastest, two rows a group pay off
// only from 4 rows a tile (fewer loads of x a multiply-add).
constexpr int nb512(int mt) { return mt <= 3 ? 1 : 2; }
// Rows a tile: all of them up to AVX512_SINGLE, else tiles of at most AVX512_TILE (measured on Zen 4: taller
// tiles run slower than two tiles of two weight rows).
constexpr int AVX512_SINGLE = 6;
constexpr int AVX512_TILE = 5;

template <Fmt F, int MT, int NB>
void tile512(const Args& a, int64_t r0, int64_t n0) {
  constexpr int64_t BB = block_bytes<F>();
  const int64_t KB = a.K / QK;
  const float* x = a.xp + r0 * a.K;
  const uint8_t* rows[NB];
  for (int j = 0; j < NB; ++j) rows[j] = a.w + (n0 + j) * a.row_bytes;
  __m512 lo[MT][NB], hi[MT][NB];
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NB; ++j) lo[r][j] = hi[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const float* xb = x + b * MT * QK;
    __m512 w_lo[NB], w_hi[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = rows[j] + b * BB;
      // The same place in the next group's rows: a group ahead of where the hardware prefetcher is.
      _mm_prefetch(reinterpret_cast<const char*>(blk + NB * a.row_bytes), _MM_HINT_T0);
      dequant512<F>(blk, w_lo[j], w_hi[j]);
    }
    for (int r = 0; r < MT; ++r) {
      const __m512 x_lo = _mm512_loadu_ps(xb + r * QK);
      const __m512 x_hi = _mm512_loadu_ps(xb + r * QK + 16);
      for (int j = 0; j < NB; ++j) {
        lo[r][j] = _mm512_fmadd_ps(x_lo, w_lo[j], lo[r][j]);
        hi[r][j] = _mm512_fmadd_ps(x_hi, w_hi[j], hi[r][j]);
      }
    }
  }
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NB; ++j) a.out[(r0 + r) * a.N + n0 + j] = reduce512(lo[r][j], hi[r][j]);
}

// Weight rows [n0, n1) against one tile of rows: groups of nb512(MT) rows, then single rows.
template <Fmt F, int MT>
void rows512(const Args& a, int64_t r0, int64_t n0, int64_t n1) {
  constexpr int NB = nb512(MT);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile512<F, MT, NB>(a, r0, n);
  for (; n < n1; ++n) tile512<F, MT, 1>(a, r0, n);
}

template <Fmt F>
void dispatch512(const Args& a, int64_t r0, int mt, int64_t n0, int64_t n1) {
  with_rows<AVX512_SINGLE>(mt, [&](auto rows) { rows512<F, decltype(rows)::value>(a, r0, n0, n1); });
}

#endif  // QGEMM_AVX512

// ------------------------------------------------------------------------------------------------ driver

constexpr Impls IMPLS{QGEMM_AVX2, QGEMM_AVX512, "avx512"};

#if QGEMM_AVX2
// Products of at least this many rows run the register-blocked kernel (tile_t). Measured on a 2-core AMD EPYC
// (Zen 3, AVX2), SmolLM2's products in cache against the panels above: 12 rows 0.95-1.10x the time, 16 rows
// 0.80-1.05x, 32 rows 0.51-1.03x, 64 rows 0.42-0.90x (1 and 2 threads); a 671-token prompt reads 1.6x faster.
constexpr int64_t BLOCKED_MIN_ROWS = 16;
// On AVX-512 the tiles below keep up longer (a 5-row tile of zmm chains); measured on a 2-core AMD EPYC Zen 4
// (avx512_bf16), SmolLM2's four layer products summed, 2 threads: 24 rows 1.09x the tiles' time on this kernel,
// 32 rows 0.94x, 64 rows 0.80x, 256 rows 0.62x (gate/up 5.40 against 8.09 ms, level with MKL's float32 sgemm
// of the de-quantized matrix, 5.32 ms).
constexpr int64_t BLOCKED_MIN_ROWS_AVX512 = 32;

template <Fmt F>
void run_blocked(const float* x, int64_t M, const Args& a) {
  const int64_t KB = a.K / QK;
  const auto tiles = row_tiles(M, MR, MR);
  std::vector<float> xt(static_cast<size_t>(tiles.size() * QK * KB * MR));
  for (size_t i = 0; i < tiles.size(); ++i)
    pack_rows_t(x, a.K, tiles[i].first, tiles[i].second, xt.data() + i * QK * KB * MR);
  const int64_t panels = (a.N + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> wt(static_cast<size_t>(NR * a.K)), rows(static_cast<size_t>(8 * a.K));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR;
      dequant_panel_t<F>(a, n0, wt.data(), rows.data());
      for (size_t i = 0; i < tiles.size(); ++i)
        dispatch_t(tiles[i].second, xt.data() + i * QK * KB * MR, wt.data(), KB, a.out, a.N, tiles[i].first, n0,
                   std::min(NR, a.N - n0));
    }
  });
}
#endif

template <Fmt F>
void run(const float* x, int64_t M, Args a, Impl impl) {
  int single = SCALAR_TILE, tile = SCALAR_TILE;
#if QGEMM_AVX512
  if (impl == AVX512) single = AVX512_SINGLE, tile = AVX512_TILE;
#endif
#if QGEMM_AVX2
  if (impl == AVX2 && M >= BLOCKED_MIN_ROWS) return run_blocked<F>(x, M, a);
#if QGEMM_AVX512
  if (impl == AVX512 && M >= BLOCKED_MIN_ROWS_AVX512) return run_blocked<F>(x, M, a);
#endif
  // More than one tile (Q4_1) or two (Q8_0, whose blocks de-quantize in a few instructions): see PANEL_ROWS.
  const bool panels = impl == AVX2 && (F == Q4_1 ? M >= PANEL_MIN_ROWS_Q4_1 : M > 2 * AVX2_TILE);
  if (impl == AVX2) single = AVX2_TILE, tile = AVX2_TILE;
#endif
  auto tiles = row_tiles(M, single, tile);
#if QGEMM_AVX2
  if (impl == AVX2 && !panels && M > single) {  // full tiles first, then the rest (see PANEL_ROWS)
    tiles.clear();
    for (int64_t r0 = 0; r0 < M; r0 += tile) tiles.emplace_back(r0, static_cast<int>(std::min<int64_t>(tile, M - r0)));
  }
#endif
  std::vector<float> xp(static_cast<size_t>(M * a.K));
  for (const auto& t : tiles) pack_tile(x, a.K, t.first, t.second, xp.data());
  a.xp = xp.data();
#if QGEMM_AVX2
  if (panels) {
    return split_rows(a.N, N_UNIT, a.K, M, [&](int64_t n0, int64_t n1) {
      std::vector<float> panel(static_cast<size_t>(PANEL_ROWS * a.K));
      for (int64_t g = n0; g < n1; g += PANEL_ROWS) {
        const int64_t g1 = std::min(n1, g + PANEL_ROWS);
        for (int64_t n = g; n < g1; ++n) dequant_row_avx2<F>(a, n, panel.data() + (n - g) * a.K);
        for (const auto& t : tiles)
          for (int64_t n = g; n < g1; ++n)
            dispatch_avx2(a, t.first, t.second, n, FromPanel{panel.data() + (n - g) * a.K});
      }
    });
  }
#endif
  rows_by_tiles(impl, tiles, a.N, a.K, M, [&](int64_t r0, int mt, int64_t g0, int64_t g1) {
    switch (impl) {  // AVX-512: weight rows [g0, g1); the others one row, g0
#if QGEMM_AVX512
      case AVX512: return dispatch512<F>(a, r0, mt, g0, g1);
#endif
#if QGEMM_AVX2
      case AVX2: return dispatch_avx2(a, r0, mt, g0, FromBlocks<F>{a.w + g0 * a.row_bytes});
#endif
      default: return tile_scalar<F>(a, r0, mt, g0);
    }
  });
}

// x (M, K) float32 rows @ blocks (N, K/32, bytes of F) into out (M, N) on `impl`.
template <Fmt F>
void run_format(const float* x, int64_t M, const uint8_t* blocks, int64_t K, int64_t N, float* out, Impl impl) {
  run<F>(x, M, Args{nullptr, blocks, out, K, N, K / QK * block_bytes<F>()}, impl);
}

torch::Tensor qmm(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt, int64_t impl) {
  return block_product(x, blocks, fmt, impl, IMPLS, "",
                       [&](auto f, const float* xp, int64_t M, int64_t K, float* out, Impl chosen) {
                         run_format<decltype(f)::value>(xp, M, blocks.data_ptr<uint8_t>(), K, blocks.size(0), out,
                                                        chosen);
                       });
}

torch::Tensor q4_1_mm(const torch::Tensor& x, const torch::Tensor& blocks) { return qmm(x, blocks, Q4_1, AUTO); }
torch::Tensor q8_0_mm(const torch::Tensor& x, const torch::Tensor& blocks) { return qmm(x, blocks, Q8_0, AUTO); }

std::vector<std::string> impls() { return IMPLS.names(); }

}  // namespace

// For the layer loop (step.cpp): x (M, K) float32 rows @ blocks (N, K/32, bytes) into out (M, N), no checks.
void qgemm_blocks_into(const float* x, int64_t M, const uint8_t* blocks, int64_t fmt, int64_t K, int64_t N,
                       float* out) {
  if (M <= 0 || N <= 0) return;
  if (fmt == Q4_1)
    run_format<Q4_1>(x, M, blocks, K, N, out, IMPLS.best());
  else
    run_format<Q8_0>(x, M, blocks, K, N, out, IMPLS.best());
}

// For the layer loop (step.cpp): the product as `q4_1_mm` / `q8_0_mm` computes it.
torch::Tensor qgemm_blocks_mm(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt) {
  return qmm(x, blocks, fmt, AUTO);
}

void register_mm8(pybind11::module& m);   // qgemm8.cpp
void register_mm16(pybind11::module& m);  // qgemm16.cpp
void register_step(pybind11::module& m);  // step.cpp
void register_lookup(pybind11::module& m);  // lookup.cpp
void register_f32(pybind11::module& m);     // f32mm.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "float32 x GGUF block weights (Q4_1, Q8_0) matrix products, row-invariant";
  m.def("q4_1_mm", &q4_1_mm, "x (M, K) float32 @ Q4_1 blocks (N, K/32, 20).T -> (M, N) float32");
  m.def("q8_0_mm", &q8_0_mm, "x (M, K) float32 @ Q8_0 blocks (N, K/32, 34).T -> (M, N) float32");
  m.def("qmm", &qmm, "qmm(x, blocks, fmt, impl): fmt 0 Q4_1, 1 Q8_0; impl 0 auto, 1 scalar, 2 avx2, 3 avx512");
  m.def("impls", &impls, "the implementations compiled in this build, worst to best");
  register_mm8(m);
  register_mm16(m);
  register_step(m);
  register_lookup(m);
  register_f32(m);
}
