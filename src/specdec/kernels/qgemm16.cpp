// Matrix products of activations rounded to bfloat16 with Q4_1 or Q8_0 weights regrouped in panels of 16 rows, on CPUs
// with AVX-512 BF16 (vdpbf16ps: 32 multiply-adds an instruction, twice float32's 16).
//
// Layout (`qgemm.panel_q4_1`, made once when a model loads): the file's (N, K/32, 20) blocks regrouped by 16
// weight rows, N a multiple of 16. Panel g, block b is 320 bytes: the 16 rows' scales d (fp16), their minimums
// m (fp16), then for each two pairs of the block's positions, pair i = (2i, 2i+1) and pair i + 1 (i even), 32
// bytes, two a row: row r's bytes 2r and 2r + 1 are q[2i] | q[2i+2] << 4 and q[2i+1] | q[2i+3] << 4. The same
// bytes as the file's, in the order a product reads them: one weight row group's codes of two pairs in one 32-byte
// load, their scales in one conversion.
//
// Arithmetic. The weights are never rounded: w = d q + m. The codes enter as c = 128 + q, whose bfloat16 words are
// the codes' bits under a fixed exponent (0x4300 | q: 128..143 are exact in bfloat16), so x . w = sum over blocks
// of d (x . c) + (m - 128 d) (sum x). With x rounded to bfloat16 (round to nearest even, as PyTorch's int4 kernel
// does), each output element is computed by one fixed sequence of float32 operations, whatever M, the other rows,
// the tiling or the threads:
//   for each block b in order, E = 0, then for the even pairs i: E = (E + x[2i+1] c[2i+1]) + x[2i] c[2i]
//   (one lane of vdpbf16ps; the products of a bfloat16 value and an 8-bit c are exact), O likewise over the odd
//   pairs, and T = T + d_b (E + O) (from T = 0; a multiply, then an add);
//   then M = M + m'_b s_b over the blocks in order (from 0), m'_b = m_b - 128 d_b (the product exact, the
//   difference rounded), s_b = x[0] + x[1] + ... + x[31] of the block (the bfloat16 values added in float32 in
//   position order), and y = T + M.
// Every output is a lane of its own (lanes across weight rows), so rows are invariant by construction.
// Two pairs' codes for 16 rows are decoded at once (one load widening bytes to words, one bit operation a pair and
// a shift) and applied to every row of a tile of up to 8 activation rows; with more rows, every tile reads a pair of
// panels while it is in the L1 cache.
// Only built where the compiler targets AVX-512 BF16 (-march=native on such a CPU); elsewhere `impls16` is
// empty and the kernel is not offered.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define QGEMM16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define QGEMM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "qgemm_common.h"

namespace {

constexpr int64_t PANEL_ROWS = 16;   // weight rows a panel
constexpr int64_t PANEL_BLOCK = 320;  // bytes of one panel's block: 16 d, 16 m (fp16), 16 pairs x 16 rows of codes
constexpr int64_t PANEL_BLOCK8 = 544;  // bytes of one Q8_0 panel's block: 16 d (fp16), 16 pairs x 16 rows of 2 codes
constexpr int64_t CODES_AT = 64;      // the codes' offset in a panel's block
constexpr int64_t AMX_UNIT = 2;       // added to a format: the codes' dot products on the tile unit (AMX)

namespace mm16 {

#ifdef QGEMM16

// Rows a tile: each pair's codes are decoded once a tile, in registers, and applied to its rows.
constexpr int FEW = 8;

// Blocks ahead of the one a tile reads that it asks the L2 cache for (_mm_prefetch, T1): its own panels' blocks, and
// past their end the next NV panels' first blocks. Without it a one-row product of a layer's weights (0.2-1.1 MB,
// too short for the hardware prefetcher to reach speed) streamed ~12 GB/s on one core of a 2-core AMD EPYC (Zen 4);
// with it 8..48 blocks ahead gave the same 1.2-1.4x (two threads) and 1.6-1.8x (one) (scripts/qgemm-bench).
constexpr int64_t PREFETCH_BLOCKS = 16;

template <int64_t BYTES>
inline void prefetch_block(const uint8_t* q) {
  for (int64_t l = 0; l < BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(q + l), _MM_HINT_T1);
}

// The block PREFETCH_BLOCKS ahead of block b of panel g + v (of NV panels read together); past their end, the next
// NV panels' first blocks. A hint: past the weights' end it reads nothing and never faults.
template <int64_t BYTES, int NV>
inline void prefetch_ahead(const uint8_t* w, int64_t KB, int64_t g, int v, int64_t b) {
  const int64_t ahead = b + PREFETCH_BLOCKS;
  prefetch_block<BYTES>(w + ((ahead < KB ? g + v : g + NV + v) * KB + (ahead < KB ? ahead : ahead - KB)) * BYTES);
}

// The codes of pairs i and i + 1 (i even) for 16 weight rows (32 bytes: row r's bytes 2r and 2r + 1 hold q[2i] and
// q[2i+1] in their low halves, q[2i+2] and q[2i+3] in their high halves) -> for each pair 16 lanes of two bfloat16
// words, c = 128 + q (bits 0x4300 | q).
inline void codes_pairs(const uint8_t* p, __m512i& even, __m512i& odd) {
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i low = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
  even = _mm512_ternarylogic_epi32(c, low, magic, 0xEA);  // (c & low) | magic
  odd = _mm512_ternarylogic_epi32(_mm512_srli_epi32(c, 4), low, magic, 0xEA);
}

inline __m512 dot(__m512 acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)(x), (__m512bh)(w));
}

inline __m512 scales(const uint8_t* p) {  // 16 fp16 -> float32 (exact)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// ------------------------------------------------------------------------------------------------ Q8_0 panels
// Layout (`qgemm.panel_q8_0`): the file's (N, K/32, 34) blocks regrouped by 16 weight rows. Panel g, block b is 544
// bytes: the 16 rows' scales d (fp16), then for each pair i = (2i, 2i+1) of the block's positions 32 bytes, two a
// row: row r's bytes 2r and 2r + 1 are q[2i] and q[2i+1] (int8).
// Arithmetic: w = d q, every int8 code exact in bfloat16; per output, for each block b in order, E = 0, then for the
// even pairs i: E = (E + x[2i+1] q[2i+1]) + x[2i] q[2i] (one lane of vdpbf16ps; each product exact), O likewise
// over the odd pairs, and y = y + d_b (E + O) (from 0; a multiply, then an add). No minimums (Q8_0 has none).
// A pair's codes for 16 rows become bfloat16 words by widening to int32, converting to float32 (exact) and packing
// two vectors to bfloat16 (exact): five instructions for 32 codes, decoded once a tile of up to 8 activation rows
// (more rows: once a tile, a pair of panels at a time), as for Q4_1.

// 32 int8 codes (row r's pair at bytes 2r, 2r + 1) -> 32 bfloat16 words in the same order (16 lanes of a pair).
inline __m512i codes8(const uint8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return (__m512i)(_mm512_cvtne2ps_pbh(hi, lo));  // words 0..15 from lo, 16..31 from hi
}

// What the kernel needs of a weight format: its panel's block bytes, whether it has minimums (y = T + M), and the
// decoding of pairs i and i + 1 (i even) of one panel's block into bfloat16 words.
struct PanelsQ4_1 {
  static constexpr int64_t BLOCK = PANEL_BLOCK;
  static constexpr bool MINS = true;
  static void pairs(const uint8_t* block, int i, __m512i& even, __m512i& odd) {
    codes_pairs(block + CODES_AT + PANEL_ROWS * i, even, odd);
  }
};

struct PanelsQ8_0 {
  static constexpr int64_t BLOCK = PANEL_BLOCK8;
  static constexpr bool MINS = false;
  static void pairs(const uint8_t* block, int i, __m512i& even, __m512i& odd) {
    even = codes8(block + 32 + 32 * i);
    odd = codes8(block + 64 + 32 * i);
  }
};

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

inline float bf16_value(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One product: the panels, the activations as bfloat16 pairs (M, K/2) and their block sums (M, K/32), the output.
struct Args {
  const uint8_t* w;   // (N/16, K/32, F::BLOCK) panels
  const uint32_t* x;  // (M, K/2): pair i of block b of row r at r * K/2 + 16 b + i
  const float* sums;  // (M, K/32)
  float* out;         // (M, N)
  int64_t K, KB, N;
};

// y = T + M for rows [r0, r0 + MT) and weight rows 16 g .. 16 g + 16 NV of panels p[0..NV): the minimums' sums.
template <int MT, int NV>
// Each block's m - 128 d is computed once for the tile's rows.
inline void finish(const Args& a, const uint8_t* const* p, int64_t r0, int64_t n0, const __m512 (&T)[MT][NV]) {
  for (int v = 0; v < NV; ++v) {
    __m512 m[MT];
    for (int r = 0; r < MT; ++r) m[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.KB; ++b) {
      const uint8_t* pb = p[v] + b * PANEL_BLOCK;
      const __m512 shifted = _mm512_sub_ps(scales(pb + 32), _mm512_mul_ps(scales(pb), _mm512_set1_ps(128.0f)));
      for (int r = 0; r < MT; ++r)
        m[r] = _mm512_add_ps(m[r], _mm512_mul_ps(shifted, _mm512_set1_ps(a.sums[(r0 + r) * a.KB + b])));
    }
    for (int r = 0; r < MT; ++r)
      _mm512_storeu_ps(a.out + (r0 + r) * a.N + n0 + PANEL_ROWS * v, _mm512_add_ps(T[r][v], m[r]));
  }
}

// MT (<= FEW) activation rows from r0 against NV panels from panel g: each two pairs' codes decoded once, in
// registers, with the tile's partial sums E, O and running sums T.
template <class F, int MT, int NV>
void few(const Args& a, int64_t r0, int64_t g) {
  constexpr int64_t PB = F::BLOCK;
  const uint8_t* p[NV];
  for (int v = 0; v < NV; ++v) p[v] = a.w + (g + v) * a.KB * PB;
  const int64_t K2 = a.K / 2;
  __m512 T[MT][NV];
  for (int r = 0; r < MT; ++r)
    for (int v = 0; v < NV; ++v) T[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b) {
    for (int v = 0; v < NV; ++v) prefetch_ahead<PB, NV>(a.w, a.KB, g, v, b);
    __m512 E[MT][NV], O[MT][NV];
    for (int r = 0; r < MT; ++r)
      for (int v = 0; v < NV; ++v) E[r][v] = O[r][v] = _mm512_setzero_ps();
    const uint32_t* xb = a.x + r0 * K2 + b * (QK / 2);
    for (int i = 0; i < QK / 2; i += 2) {
      __m512i qe[NV], qo[NV];
      for (int v = 0; v < NV; ++v) F::pairs(p[v] + b * PB, i, qe[v], qo[v]);
      for (int r = 0; r < MT; ++r) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xb[r * K2 + i]));
        for (int v = 0; v < NV; ++v) E[r][v] = dot(E[r][v], xv, qe[v]);
      }
      for (int r = 0; r < MT; ++r) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xb[r * K2 + i + 1]));
        for (int v = 0; v < NV; ++v) O[r][v] = dot(O[r][v], xv, qo[v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512 d = scales(p[v] + b * PB);
      for (int r = 0; r < MT; ++r) T[r][v] = _mm512_add_ps(T[r][v], _mm512_mul_ps(d, _mm512_add_ps(E[r][v], O[r][v])));
    }
  }
  if constexpr (F::MINS) {
    finish<MT, NV>(a, p, r0, g * PANEL_ROWS, T);
  } else {
    for (int r = 0; r < MT; ++r)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(a.out + (r0 + r) * a.N + (g + v) * PANEL_ROWS, T[r][v]);
  }
}

// Panels [g0, g1) against MT rows from r0, NV panels at a time (then one at a time).
template <class F, int MT, int NV>
inline void few_panels(const Args& a, int64_t r0, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + NV <= g1; g += NV) few<F, MT, NV>(a, r0, g);
  for (; g < g1; ++g) few<F, MT, 1>(a, r0, g);
}

// Panels [g0, g1) for MT (1..FEW) rows from r0, NV panels at a time: four for one or two rows, else two. With one
// panel at a time, a tile of 4-8 rows ran at about half the speed of two (a 2-core AMD EPYC, Zen 4: 5 rows of
// SmolLM2's gate/up product 123 us against 60; the 3 sums a row and panel exceed the 32 registers for 5-8 rows
// with two, and the spills cost less than the lost overlap).
template <class F>
void tile(const Args& a, int64_t r0, int mt, int64_t g0, int64_t g1) {
  with_rows<FEW>(mt, [&](auto rows) {
    constexpr int MT = decltype(rows)::value;
    few_panels<F, MT, (MT <= 2 ? 4 : 2)>(a, r0, g0, g1);
  });
}

// Panels [g0, g1) for all M rows: up to FEW rows in one tile; more in tiles of near-equal heights, each pair of
// panels against every tile while its blocks are in the L1 cache (their codes decoded again for each tile).
template <class F>
void panels(const Args& a, int64_t M, int64_t g0, int64_t g1) {
  const auto tiles = row_tiles(M, FEW, FEW);
  if (tiles.size() == 1) return tile<F>(a, 0, tiles[0].second, g0, g1);
  for (int64_t g = g0; g < g1; g += 2) {
    const int64_t g2 = std::min(g1, g + 2);
    for (const auto& t : tiles) tile<F>(a, t.first, t.second, g, g2);
  }
}



#ifdef QGEMM_AMX
// ------------------------------------------------------------------------------------------------ AMX tiles
// The same panels and the same arithmetic outside the codes' dot products, whose block sums come from the CPU's tile
// unit (AMX: TDPBF16PS, a 16 x 32 bfloat16 tile of activations times a 32 x 16 tile of codes in one instruction):
// per output, for each block b in order, S = the tile unit's sum over the block's 32 positions (from 0), T = T +
// d_b S (a multiply, then an add), then y = T + M as above. A block of a panel decoded is exactly one tile of codes
// (pair i of the block = tile row i: 16 lanes of two bfloat16 words), decoded once for all the product's rows.
// The tile unit does not add in vdpbf16ps's order (on a Xeon Sapphire Rapids its sums differed from every
// sequential order in about 60% of random cases), but each row of a tile is computed alone: a row's bits are the
// same at any row count (tests/models/test_qgemm16.py). So a process uses one unit for all its products (the kernel
// "amx" or "blocks16", chosen once, see int4.kernel_choice): a one-token step and a verification pass agree.
namespace tiles {

constexpr int ROWS = 16;  // activation rows a tile (the last tile padded with rows of zeros)

// Linux gives a process the tile state only when asked (once): false where it refuses (a CPU or kernel without it).
bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile 0: the activations (rows x 32 bfloat16); 1, 2: two panels' codes (16 pairs x 16 rows); 4, 5: their sums.
inline void configure(int rows) {
  Config c;
  for (int t = 0; t < 6; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(t == 1 || t == 2 ? 16 : rows);
  }
  _tile_loadconfig(&c);
}

// One block of a panel -> its tile of codes (16 rows of 64 bytes).
template <class F>
inline void decode(const uint8_t* block, uint32_t (*codes)[16]) {
  for (int i = 0; i < QK / 2; i += 2) {
    __m512i e, o;
    F::pairs(block, i, e, o);
    _mm512_store_si512(codes[i], e);
    _mm512_store_si512(codes[i + 1], o);
  }
}

// Two panels a step: each block's two sums' tiles are independent, so the tile unit works on one while the other
// is stored. Four blocks a step: multiplied, then applied, so that the sums' tile stores are well before their
// loads; the next step's blocks are decoded between the tile instructions (their stores well before their tile loads,
// the decoding beside the tile unit's latency). On a 2-core Xeon (Sapphire Rapids) a one-row product of SmolLM2's
// gate/up and down weights took 1.00-1.05x the vdpbf16ps kernel's time (1.04-1.09x decoding each step's blocks
// before its tile instructions; 1.11-1.47x with one block a step, three panels, or eight blocks), a five-row product
// 0.45-0.55x.
constexpr int NV_MAX = 2;
constexpr int CHUNK = 4;

struct Buffers {  // a thread's: a step's tiles of codes and its block sums (one tile of rows)
  alignas(64) uint32_t codes[2][CHUNK][NV_MAX][16][16];  // this step's and the next's
  alignas(64) float sums[CHUNK][NV_MAX][ROWS][16];
};

// NV (1 or 2) panels from g against all rows: x (Mp, K) bfloat16 words, Mp a multiple of tr; T (Mp, NV, 16) the
// running sums (zeroed here), then y = T (+ M) into the output's first M rows. Each block's codes are decoded once,
// for every tile of rows.
template <class F, int NV>
void panels_at(const Args& a, const uint16_t* x, int64_t M, int64_t Mp, int tr, int64_t g, float* T, Buffers& buf) {
  constexpr int64_t PB = F::BLOCK;
  const uint8_t* p[NV];
  for (int v = 0; v < NV; ++v) p[v] = a.w + (g + v) * a.KB * PB;
  std::fill(T, T + Mp * NV * 16, 0.0f);
  const auto decode_block = [&](int64_t b, uint32_t (*codes)[16][16]) {
    for (int v = 0; v < NV; ++v) {
      prefetch_ahead<PB, NV>(a.w, a.KB, g, v, b);
      decode<F>(p[v] + b * PB, codes[v]);
    }
  };
  for (int c = 0; c < std::min<int64_t>(CHUNK, a.KB); ++c) decode_block(c, buf.codes[0][c]);
  int cur = 0;
  for (int64_t b0 = 0; b0 < a.KB; b0 += CHUNK, cur ^= 1) {
    const int nb = static_cast<int>(std::min<int64_t>(CHUNK, a.KB - b0));
    const int nb1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(CHUNK, a.KB - b0 - CHUNK)));
    for (int64_t r0 = 0; r0 < Mp; r0 += tr) {
      for (int c = 0; c < nb; ++c) {
        _tile_loadd(0, x + r0 * a.K + (b0 + c) * QK, a.K * 2);
        _tile_loadd(1, buf.codes[cur][c][0], 64);
        _tile_zero(4);
        _tile_dpbf16ps(4, 0, 1);
        if constexpr (NV >= 2) {
          _tile_loadd(2, buf.codes[cur][c][1], 64);
          _tile_zero(5);
          _tile_dpbf16ps(5, 0, 2);
        }
        if (r0 == 0 && c < nb1) decode_block(b0 + CHUNK + c, buf.codes[cur ^ 1][c]);  // beside the tile unit
        _tile_stored(4, buf.sums[c][0], 64);
        if constexpr (NV >= 2) _tile_stored(5, buf.sums[c][1], 64);
      }
      for (int v = 0; v < NV; ++v) {
        __m512 d[CHUNK];
        for (int c = 0; c < nb; ++c) d[c] = scales(p[v] + (b0 + c) * PB);
        for (int r = 0; r < tr; ++r) {  // the blocks in order: T = T + d S
          float* t = T + ((r0 + r) * NV + v) * 16;
          __m512 acc = _mm512_loadu_ps(t);
          for (int c = 0; c < nb; ++c) acc = _mm512_add_ps(acc, _mm512_mul_ps(d[c], _mm512_load_ps(buf.sums[c][v][r])));
          _mm512_storeu_ps(t, acc);
        }
      }
    }
  }
  // y = T (+ M): the dot kernel's own ending (`finish`: each block's m - 128 d once for a tile's rows), tile by tile
  for (int64_t r0 = 0; r0 < M; r0 += ROWS)
    with_rows<ROWS>(static_cast<int>(std::min<int64_t>(ROWS, M - r0)), [&](auto rows) {
      constexpr int MT = decltype(rows)::value;
      __m512 t[MT][NV];
      for (int r = 0; r < MT; ++r)
        for (int v = 0; v < NV; ++v) t[r][v] = _mm512_loadu_ps(T + ((r0 + r) * NV + v) * 16);
      if constexpr (F::MINS) {
        finish<MT, NV>(a, p, r0, g * PANEL_ROWS, t);
      } else {
        for (int r = 0; r < MT; ++r)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(a.out + (r0 + r) * a.N + (g + v) * PANEL_ROWS, t[r][v]);
      }
    });
}

// Panels [g0, g1) for all M rows (one thread's share), two at a time, then one; the thread's tiles configured for
// tr rows, and released after.
template <class F>
void panels(const Args& a, const uint16_t* x, int64_t M, int64_t Mp, int tr, int64_t g0, int64_t g1) {
  thread_local std::vector<float> T;
  thread_local std::unique_ptr<Buffers> buf;
  if (!buf) buf = std::make_unique<Buffers>();
  if (T.size() < static_cast<size_t>(Mp * NV_MAX * 16)) T.resize(Mp * NV_MAX * 16);
  configure(tr);
  int64_t g = g0;
  for (; g + NV_MAX <= g1; g += NV_MAX) panels_at<F, NV_MAX>(a, x, M, Mp, tr, g, T.data(), *buf);
  if (g < g1) panels_at<F, 1>(a, x, M, Mp, tr, g, T.data(), *buf);
  _tile_release();
}

}  // namespace tiles
#endif  // QGEMM_AMX

template <class F>
void run(const float* x, int64_t M, const uint8_t* w, float* out, int64_t K, int64_t N, bool amx) {
  const int64_t KB = K / QK;
  // on the tile unit, rows of zeros up to a whole number of tiles (of M rows where M < 16)
  const int tr = static_cast<int>(std::min<int64_t>(M, 16));
  const int64_t Mp = amx ? (M + tr - 1) / tr * tr : M;
  std::vector<uint16_t> xb(static_cast<size_t>(Mp * K), 0);
  std::vector<float> sums(static_cast<size_t>(F::MINS ? M * KB : 0));  // the blocks' activation sums (minimums)
  // each row's activations rounded and summed on its own (the same arithmetic at any row count), rows in
  // parallel where there are many (64 rows of SmolLM2's four products: ~0.1 ms a layer on one thread)
  const auto prepare = [&](int64_t r0, int64_t r1) {
    to_bf16(x + r0 * K, (r1 - r0) * K, xb.data() + r0 * K);
    for (int64_t r = r0; r < (F::MINS ? r1 : r0); ++r)
      for (int64_t b = 0; b < KB; ++b) {
        float s = 0.0f;
        for (int64_t l = 0; l < QK; ++l) s += bf16_value(xb[r * K + b * QK + l]);
        sums[r * KB + b] = s;
      }
  };
  if (M >= 16)
    at::parallel_for(0, M, 8, prepare);
  else
    prepare(0, M);
  const Args a{w, reinterpret_cast<const uint32_t*>(xb.data()), sums.data(), out, K, KB, N};
#ifdef QGEMM_AMX
  if (amx) {
    split_rows(N, PANEL_ROWS, K, M, [&](int64_t n0, int64_t n1) {
      tiles::panels<F>(a, xb.data(), M, Mp, tr, n0 / PANEL_ROWS, n1 / PANEL_ROWS);
    });
    return;
  }
#endif
  (void)amx;
  (void)tr;
  split_rows(N, PANEL_ROWS, K, M, [&](int64_t n0, int64_t n1) { panels<F>(a, M, n0 / PANEL_ROWS, n1 / PANEL_ROWS); });
}

#endif  // QGEMM16

}  // namespace mm16

}  // namespace

// x (M, K) float32 rows @ panels (N/16, K/32, 320 for Q4_1 (fmt 0), 544 for Q8_0 (fmt 1)) into out (M, N), no
// checks (qmm16; the layer loop's raw layers). fmt + 2 (AMX_UNIT): the codes' dot products on the tile unit.
void qgemm16_into(const float* x, int64_t M, const uint8_t* panels, int64_t fmt, int64_t K, int64_t N, float* out) {
#ifdef QGEMM16
  if (M > 0 && N > 0) {
    const bool amx = (fmt & AMX_UNIT) != 0;
    if ((fmt & ~AMX_UNIT) == 1)
      mm16::run<mm16::PanelsQ8_0>(x, M, panels, out, K, N, amx);
    else
      mm16::run<mm16::PanelsQ4_1>(x, M, panels, out, K, N, amx);
  }
#endif
}

namespace {

bool compiled16() {
#ifdef QGEMM16
  return true;
#else
  return false;
#endif
}

// Whether this build has the tile path and the system gives this process the tile state.
bool amx_ready() {
#ifdef QGEMM_AMX
  return mm16::tiles::permitted();
#else
  return false;
#endif
}

torch::Tensor qmm16(const torch::Tensor& x, const torch::Tensor& panels, int64_t fmt) {
  TORCH_CHECK(fmt >= 0 && fmt < 4, "qmm16: Q4_1 (format 0) or Q8_0 (format 1) weights, + 2 on the tile unit, got ", fmt);
  const bool q4 = (fmt & ~AMX_UNIT) == Q4_1;
  const std::string name = std::string(q4 ? "q4_1_mm" : "q8_0_mm") + (fmt & AMX_UNIT ? "_amx" : "16");
  TORCH_CHECK(compiled16(), name, ": this build has no AVX-512 BF16 kernel (the CPU lacks avx512_bf16)");
  TORCH_CHECK(!(fmt & AMX_UNIT) || amx_ready(), name, ": no AMX tile unit here (the CPU lacks amx_bf16, or the "
              "system refused this process the tile state)");
  check_product_args(x, panels, q4 ? PANEL_BLOCK : PANEL_BLOCK8, name, "panels", "N/16",
                     q4 ? " (qgemm.panel_q4_1)" : " (qgemm.panel_q8_0)");
  const int64_t N = panels.size(0) * PANEL_ROWS;
  return product(x, N, [&](const float* xp, int64_t M, int64_t K, float* out) {
    qgemm16_into(xp, M, panels.data_ptr<uint8_t>(), fmt, K, N, out);
  });
}

torch::Tensor q4_1_mm16(const torch::Tensor& x, const torch::Tensor& panels) { return qmm16(x, panels, Q4_1); }

torch::Tensor q8_0_mm16(const torch::Tensor& x, const torch::Tensor& panels) { return qmm16(x, panels, Q8_0); }

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
  if (amx_ready()) names.emplace_back("amx");
  return names;
}

}  // namespace

// For the layer loop (step.cpp): the product as `q4_1_mm16` computes it (weights in panels).
torch::Tensor qgemm_blocks_mm16(const torch::Tensor& x, const torch::Tensor& panels, int64_t fmt) {
  return qmm16(x, panels, fmt);
}

// The bfloat16 kernel's entry points, added to the extension's module by qgemm.cpp.
void register_mm16(pybind11::module& m) {
  m.def("q4_1_mm16", &q4_1_mm16, "bf16(x) (M, K) @ W.T -> (M, N) float32, W as Q4_1 panels (N/16, K/32, 320)");
  m.def("q8_0_mm16", &q8_0_mm16, "bf16(x) (M, K) @ W.T -> (M, N) float32, W as Q8_0 panels (N/16, K/32, 544)");
  m.def("qmm16", &qmm16, "qmm16(x, panels, fmt): fmt 0 (Q4_1) or 1 (Q8_0), + 2 on the AMX tile unit");
  m.def("round_bf16", &round_bf16, "x float32 -> bfloat16 as the kernel rounds its activations");
  m.def("impls16", &impls16, "['avx512bf16'] where this build has the kernel (and 'amx' where the tile unit is "
        "there for this process), else []");
}
