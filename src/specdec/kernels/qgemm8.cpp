// Matrix products of int8-quantized activations with GGUF block weights (Q4_1, Q8_0), on the CPU: llama.cpp's
// scheme (activations as Q8_0/Q8_1 blocks, integer dot products with vpdpbusd / vpmaddubsw).
//
//   y (M, N) ~= x (M, K) @ W.T, W (N, K) held as the file's own blocks of 32 weights:
//   Q4_1: 20 bytes a block: fp16 d, fp16 m, 16 bytes qs; w[j] = d * (qs[j] & 15) + m, w[j+16] = d * (qs[j] >> 4) + m
//   Q8_0: 34 bytes a block: fp16 d, 32 int8 q;           w[j] = d * q[j]
//
// Activations. Each row is cut into blocks of 32 and quantized once per call, by one function (quantize_row8) used
// by every implementation: dx = amax / 127 (float32, amax = max |x| over the block), q[j] = x[j] / dx rounded to the
// nearest integer, ties to even (clamped to [-127, 127]; all 0 with dx = 0 when dx is 0, i.e. an all-zero block or
// one so small that amax / 127 underflows), sx = dx * sum(q) (float32). Division, rounding and the integer sum are
// exact operations, so the codes are the same whatever the instruction set.
//
// Products. For output (r, n) and block b, idot = sum_j qw[j] * qx[j] is computed exactly in int32 (Q4_1: codes
// 0..15, Q8_0: -128..127). The float part, the same in every implementation (scalar, AVX2, AVX-512 VNNI):
//   16 partial sums S[l], l = b mod 16, from S = +0, over the blocks b in order:
//     Q4_1: S[l] = fma(m_w, sx, S[l]); S[l] = fma(d_w * dx, float(idot), S[l])
//     Q8_0: S[l] = fma(d_w * dx, float(idot), S[l])
//   (d_w * dx one float32 product, d_w and m_w the block's fp16 values converted exactly; fma rounds once), then
//   T[l] = S[l] + S[l+8] (l < 8), U[l] = T[l] + T[l+4] (l < 4), y = (U[0] + U[2]) + (U[1] + U[3]).
// Rows are only ever tiled (never treated differently by count) and the work is split over N only, so row r of a
// product is bit-for-bit the same whatever the row count, the other rows, the thread count and the instruction set.
// Build with -ffp-contract=off (the only fused operations are the explicit fma above).
//
// Layout. The codes of a row are stored by chunks of 16 blocks, transposed: dword t (codes 4t..4t+3) of block
// 16c + l at [c][t][l]. The weights of 16 blocks are transposed the same way in registers (lane l = block l), so
// that 8 vpdpbusd (zmm) give the 16 blocks' exact dot products in 16 lanes with no horizontal sums, and the float
// part above is 3 (Q4_1: 4) vector operations for 16 blocks. Each chunk of weights is unpacked once per tile of up
// to 9 activation rows and applied to all of them.
//   Q4_1 on VNNI: vpdpbusd(u8 codes 0..15, s8 activations). Q8_0 on VNNI: the weights are biased to u8 (q + 128,
//   an xor with 0x80) and the accumulator starts at -128 * sum(qx), which is exact. AVX2: vpmaddubsw + vpmaddwd as
//   llama.cpp; Q4_1 pairs are at most 2 * 15 * 127 (8 of them summed in int16 stay under 32767), Q8_0 uses the
//   sign trick (|w| as u8 0..128, x * sign(w) in -127..127: pairs at most 2 * 128 * 127 = 32512, no saturation).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "qgemm_common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// The implementations this build compiles (1) or leaves out (0), by what the compiler targets.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMM8_AVX2 1
#else
#define QGEMM8_AVX2 0
#endif
#if QGEMM8_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QGEMM8_VNNI 1
#else
#define QGEMM8_VNNI 0
#endif

namespace {

namespace mm8 {

#if defined(__GNUC__)
#define MM8_INLINE inline __attribute__((always_inline))
#else
#define MM8_INLINE inline
#endif

constexpr int64_t CB = 16;  // blocks a chunk (lanes of the float part)

// The one activation quantizer: KB blocks of x into codes q (KB * 32), scales dx, sx and code sums sq (KB each).
void quantize_row8(const float* x, int64_t KB, int8_t* q, float* dx, float* sx, int32_t* sq) {
  for (int64_t b = 0; b < KB; ++b) {
    const float* xb = x + b * QK;
    int8_t* qb = q + b * QK;
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) {
      const float a = std::fabs(xb[j]);
      amax = a > amax ? a : amax;  // NaNs are skipped
    }
    const float d = amax / 127.0f;
    int32_t sum = 0;
    if (d > 0.0f) {
      for (int j = 0; j < QK; ++j) {
        const float v = std::nearbyint(xb[j] / d);  // the default rounding mode: to nearest, ties to even
        const float c = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : (v == v ? v : 0.0f));
        qb[j] = static_cast<int8_t>(c);
        sum += qb[j];
      }
    } else {
      std::memset(qb, 0, QK);
    }
    dx[b] = d > 0.0f ? d : 0.0f;
    sx[b] = dx[b] * static_cast<float>(sum);
    sq[b] = sum;
  }
}

// The activations of one product, packed by tiles of rows. A tile of mt rows starting at row r0 lies at
// q + r0 * C * 128 as (C, mt, 8, 16) int32 (chunk, row, dword t, block l of the chunk: codes 4t..4t+3 of block
// 16c + l), and at dx / sx / bias + r0 * C * 16 as (C, mt, 16); zeros past the row's end (KB blocks).
struct Args8 {
  const int32_t* q;
  const float* dx;
  const float* sx;
  const int32_t* bias;  // -128 * sum of the codes (Q8_0 on VNNI)
  const uint8_t* w;     // (N, K/32, bytes)
  float* out;           // (M, N)
  int64_t KB;
  int64_t C;  // chunks: ceil(KB / 16)
  int64_t N;
  int64_t row_bytes;
};

struct Packed {
  std::vector<int32_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> bias;
};

Packed pack_rows(const float* x, int64_t M, int64_t K, const std::vector<std::pair<int64_t, int>>& tiles) {
  const int64_t KB = K / QK, C = (KB + CB - 1) / CB;
  const size_t nq = static_cast<size_t>(M * C * 128), ns = static_cast<size_t>(M * C * CB);
  Packed p{std::vector<int32_t>(nq), std::vector<float>(ns), std::vector<float>(ns), std::vector<int32_t>(ns)};
  int32_t* q = p.q.data();
  float* dx = p.dx.data();
  float* sx = p.sx.data();
  int32_t* bias = p.bias.data();
  std::vector<int8_t> codes(static_cast<size_t>(K));
  std::vector<float> rdx(static_cast<size_t>(KB)), rsx(static_cast<size_t>(KB));
  std::vector<int32_t> rsq(static_cast<size_t>(KB));
  for (const auto& t : tiles) {
    const int64_t r0 = t.first;
    const int mt = t.second;
    for (int r = 0; r < mt; ++r) {
      quantize_row8(x + (r0 + r) * K, KB, codes.data(), rdx.data(), rsx.data(), rsq.data());
      for (int64_t b = 0; b < KB; ++b) {
        const int64_t c = b / CB, l = b % CB;
        int32_t* qc = q + r0 * C * 128 + (c * mt + r) * 128;
        for (int tt = 0; tt < 8; ++tt) std::memcpy(qc + tt * CB + l, codes.data() + b * QK + 4 * tt, 4);
        const int64_t s = r0 * C * CB + (c * mt + r) * CB + l;
        dx[s] = rdx[b];
        sx[s] = rsx[b];
        bias[s] = -128 * rsq[b];
      }
    }
  }
  return p;
}

// ------------------------------------------------------------------------------------------------ scalar

inline float reduce16(const float* S) {
  float T[8], U[4];
  for (int l = 0; l < 8; ++l) T[l] = S[l] + S[l + 8];
  for (int l = 0; l < 4; ++l) U[l] = T[l] + T[l + 4];
  const float v0 = U[0] + U[2];
  const float v1 = U[1] + U[3];
  return v0 + v1;
}

constexpr int SCALAR_TILE = 9;

template <Fmt F>
void tile_scalar(const Args8& a, int64_t r0, int mt, int64_t n) {
  constexpr int64_t BB = block_bytes<F>();
  float S[SCALAR_TILE][CB] = {};
  const uint8_t* row = a.w + n * a.row_bytes;
  const int32_t* q = a.q + r0 * a.C * 128;
  const int64_t s0 = r0 * a.C * CB;
  for (int64_t b = 0; b < a.KB; ++b) {
    const uint8_t* blk = row + b * BB;
    int32_t wq[32];
    float dw, mw = 0.0f;
    if constexpr (F == Q4_1) {
      dw = half_to_float(blk);
      mw = half_to_float(blk + 2);
      for (int j = 0; j < 16; ++j) {
        wq[j] = blk[4 + j] & 15;
        wq[j + 16] = blk[4 + j] >> 4;
      }
    } else {
      dw = half_to_float(blk);
      for (int j = 0; j < 32; ++j) wq[j] = static_cast<int8_t>(blk[2 + j]);
    }
    const int64_t c = b / CB;
    const int l = static_cast<int>(b % CB);
    for (int r = 0; r < mt; ++r) {
      const int8_t* qx = reinterpret_cast<const int8_t*>(q + (c * mt + r) * 128);
      int32_t idot = 0;
      for (int j = 0; j < 32; ++j) idot += wq[j] * qx[((j >> 2) * CB + l) * 4 + (j & 3)];
      const int64_t s = s0 + (c * mt + r) * CB + l;
      if constexpr (F == Q4_1) S[r][l] = std::fma(mw, a.sx[s], S[r][l]);
      S[r][l] = std::fma(dw * a.dx[s], static_cast<float>(idot), S[r][l]);
    }
  }
  for (int r = 0; r < mt; ++r) a.out[(r0 + r) * a.N + n] = reduce16(S[r]);
}

alignas(64) const uint8_t kZeros[64] = {};

// ------------------------------------------------------------------------------------------------ AVX2

#if QGEMM8_AVX2

// The interleaving of dwords (BITS 32) or qwords (64) in each 128-bit lane, low (HI false) or high halves, of ymm
// (V __m256i) or, with VNNI, zmm vectors.
template <int BITS, bool HI, class V>
MM8_INLINE V unpack(V a, V b) {
  if constexpr (sizeof(V) == 32) {
    if constexpr (BITS == 32) return HI ? _mm256_unpackhi_epi32(a, b) : _mm256_unpacklo_epi32(a, b);
    else return HI ? _mm256_unpackhi_epi64(a, b) : _mm256_unpacklo_epi64(a, b);
  } else {
    static_assert(QGEMM8_VNNI && sizeof(V) == 64, "ymm, or zmm in a VNNI build");
#if QGEMM8_VNNI
    if constexpr (BITS == 32) return HI ? _mm512_unpackhi_epi32(a, b) : _mm512_unpacklo_epi32(a, b);
    else return HI ? _mm512_unpackhi_epi64(a, b) : _mm512_unpacklo_epi64(a, b);
#endif
  }
}

// 4x4 transposes of dwords in each 128-bit lane: B[i] lane (4p + k) = A[k] lane (4p + i) (V: __m256i or __m512i).
template <class V>
MM8_INLINE void transpose4(const V* A, V* B) {
  const V t0 = unpack<32, false>(A[0], A[1]), t1 = unpack<32, true>(A[0], A[1]);
  const V t2 = unpack<32, false>(A[2], A[3]), t3 = unpack<32, true>(A[2], A[3]);
  B[0] = unpack<64, false>(t0, t2);
  B[1] = unpack<64, true>(t0, t2);
  B[2] = unpack<64, false>(t1, t3);
  B[3] = unpack<64, true>(t1, t3);
}

MM8_INLINE __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// [16 bytes at p, 16 bytes at p2]
MM8_INLINE __m256i load2x128(const uint8_t* p, const uint8_t* p2) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(load128(p)), load128(p2), 1);
}

// 8 blocks at blk (nb of them real, the rest read as zeros): w[t] lane l = dword t of block l's 32 codes,
// as u8 (Q4_1) or s8 (Q8_0); wa[t] = |w[t]| (Q8_0); d, m the blocks' scales.
template <Fmt F, bool TAIL>
MM8_INLINE void unpack8(const uint8_t* blk, int nb, __m256i* w, __m256i* wa, __m256& d, __m256& m) {
  constexpr int64_t BB = block_bytes<F>();
  auto P = [&](int b) -> const uint8_t* { return (!TAIL || b < nb) ? blk + BB * b : kZeros; };
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i live = TAIL ? _mm256_cmpgt_epi32(_mm256_set1_epi32(nb), idx) : _mm256_set1_epi32(-1);
  if constexpr (F == Q4_1) {
    __m256i A[4], B[4];
    for (int k = 0; k < 4; ++k) A[k] = load2x128(P(k) + 4, P(k + 4) + 4);
    transpose4(A, B);
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm256_and_si256(B[i], lo4);
      w[4 + i] = _mm256_and_si256(_mm256_srli_epi16(B[i], 4), lo4);
    }
    const __m256i hdr = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(blk),
                                                    _mm256_mullo_epi32(idx, _mm256_set1_epi32(5)), live, 4);
    const __m256i dm = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(hdr, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(hdr, 16)), 0xD8);
    d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
  } else {
    for (int h = 0; h < 2; ++h) {
      __m256i A[4];
      for (int k = 0; k < 4; ++k) A[k] = load2x128(P(k) + 2 + 16 * h, P(k + 4) + 2 + 16 * h);
      transpose4(A, w + 4 * h);
    }
    for (int t = 0; t < 8; ++t) wa[t] = _mm256_abs_epi8(w[t]);
    const __m256i hdr = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(blk),
                                                    _mm256_mullo_epi32(idx, _mm256_set1_epi32(34)), live, 1);
    const __m256i dd = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(hdr, _mm256_set1_epi32(0xFFFF)), _mm256_setzero_si256()), 0xD8);
    d = _mm256_cvtph_ps(_mm256_castsi256_si128(dd));
    m = _mm256_setzero_ps();
  }
}

constexpr int AVX2_TILE = 3;

// Two passes, lanes 0..7 then 8..15 of every chunk (the blocks 16c + 8h + l'), each with one accumulator a row.
template <Fmt F, int MT>
void tile_avx2(const Args8& a, int64_t r0, int64_t n) {
  constexpr int64_t BB = block_bytes<F>();
  const uint8_t* row = a.w + n * a.row_bytes;
  const int32_t* q = a.q + r0 * a.C * 128;
  const int64_t s0 = r0 * a.C * CB;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 first[MT], acc[MT];
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < a.C; ++c) {
      const int64_t b0 = c * CB + 8 * h;
      const int64_t nb = std::min<int64_t>(8, a.KB - b0);
      if (nb <= 0) break;
      __m256i w[8], wa[8];
      __m256 d, m;
      if (nb == 8)
        unpack8<F, false>(row + b0 * BB, 8, w, wa, d, m);
      else
        unpack8<F, true>(row + b0 * BB, static_cast<int>(nb), w, wa, d, m);
      for (int r = 0; r < MT; ++r) {
        const int32_t* x = q + (c * MT + r) * 128 + 8 * h;
        const int64_t s = s0 + (c * MT + r) * CB + 8 * h;
        __m256i idot;
        if constexpr (F == Q4_1) {
          // Pairs are at most 2 * 15 * 127 = 3810 and 8 of them sum to at most 30480: exact in int16.
          __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
          for (int t = 1; t < 8; ++t)
            s16 = _mm256_add_epi16(
                s16, _mm256_maddubs_epi16(w[t], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * t))));
          idot = _mm256_madd_epi16(s16, ones);
        } else {
          idot = _mm256_setzero_si256();
          for (int t = 0; t < 8; ++t) {
            const __m256i xs =
                _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * t)), w[t]);
            idot = _mm256_add_epi32(idot, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[t], xs), ones));
          }
        }
        const __m256 f = _mm256_cvtepi32_ps(idot);
        const __m256 sc = _mm256_mul_ps(d, _mm256_loadu_ps(a.dx + s));
        if constexpr (F == Q4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.sx + s), acc[r]);
        acc[r] = _mm256_fmadd_ps(sc, f, acc[r]);
      }
    }
    if (h == 0)
      for (int r = 0; r < MT; ++r) first[r] = acc[r];
  }
  for (int r = 0; r < MT; ++r) {
    const __m256 t = _mm256_add_ps(first[r], acc[r]);  // T[l] = S[l] + S[l+8]
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // U[l] = T[l] + T[l+4]
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));                                   // U[0]+U[2], U[1]+U[3]
    a.out[(r0 + r) * a.N + n] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
  }
}

template <Fmt F>
void dispatch_avx2(const Args8& a, int64_t r0, int mt, int64_t n) {
  with_rows<AVX2_TILE>(mt, [&](auto rows) { tile_avx2<F, decltype(rows)::value>(a, r0, n); });
}

#endif  // QGEMM8_AVX2

// ------------------------------------------------------------------------------------------------ AVX-512 VNNI

#if QGEMM8_VNNI

// Lanes l of 16 whose dword 5l + i lies in [lo, hi).
constexpr __mmask16 lanes5(int i, int lo, int hi) {
  unsigned k = 0;
  for (int l = 0; l < 16; ++l)
    if (5 * l + i >= lo && 5 * l + i < hi) k |= 1u << l;
  return static_cast<__mmask16>(k);
}

// Lane l = dword 5l + I of the 16 * NR dwords in R[0..NR) (dword I of Q4_1 block l of the chunk; lanes whose
// dword lies past R[NR - 1] are left as they come, zero or garbage, and must not be used).
template <int I, int NR>
MM8_INLINE __m512i pick5(const __m512i* R) {
  const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75),
                                       _mm512_set1_epi32(I));
  if constexpr (NR == 1) return _mm512_permutexvar_epi32(idx, R[0]);
  __m512i t = _mm512_permutex2var_epi32(R[0], idx, R[1]);  // index bit 4 picks R[1]: dwords 0..31
  if constexpr (NR == 3) t = _mm512_mask_permutexvar_epi32(t, lanes5(I, 32, 48), idx, R[2]);
  if constexpr (NR >= 4) t = _mm512_mask_blend_epi32(lanes5(I, 32, 64), t, _mm512_permutex2var_epi32(R[2], idx, R[3]));
  if constexpr (NR == 5) t = _mm512_mask_permutexvar_epi32(t, lanes5(I, 64, 80), idx, R[4]);  // low 4 bits: 64..79
  return t;
}

alignas(64) const uint16_t kDmIdx[32] = {0, 2, 4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                         1, 3, 5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

// Q4_1 blocks at blk, 16 a chunk: w[t] lane l = dword t of block l's codes (t < 4: the low nibbles of qs word t,
// t >= 4: the high nibbles of qs word t - 4), u8 0..15; d, m the scales. NR = ceil(5 nb / 16) registers of 16
// dwords hold the nb blocks (16: NR = 5); TAIL: nb < 16, the dwords past the nb blocks read as zeros (masked loads),
// so that lanes nb.. hold zero codes and scales (or, past R[NR - 1], garbage that the caller does not use).
template <int NR, bool TAIL>
MM8_INLINE void unpack16_q4_1(const uint8_t* blk, int nb, __m512i* w, __m512& d, __m512& m) {
  __m512i R[NR];
  for (int i = 0; i < NR; ++i) {
    if (!TAIL) {
      R[i] = _mm512_loadu_si512(blk + 64 * i);
    } else {
      const int cnt = std::max(0, std::min(16, 5 * nb - 16 * i));
      R[i] = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << cnt) - 1), blk + 64 * i);
    }
  }
  __m512i hdr = pick5<0, NR>(R);
  // Zero scales in the lanes past the tail's blocks: their codes meet zero activations, but their scales could be
  // any bits (inf * 0 would be NaN).
  if (TAIL) hdr = _mm512_maskz_mov_epi32(static_cast<__mmask16>((1u << nb) - 1), hdr);
  const __m512i q0 = pick5<1, NR>(R), q1 = pick5<2, NR>(R), q2 = pick5<3, NR>(R), q3 = pick5<4, NR>(R);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  w[0] = _mm512_and_si512(q0, lo4);
  w[1] = _mm512_and_si512(q1, lo4);
  w[2] = _mm512_and_si512(q2, lo4);
  w[3] = _mm512_and_si512(q3, lo4);
  w[4] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), lo4);
  w[5] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), lo4);
  w[6] = _mm512_and_si512(_mm512_srli_epi16(q2, 4), lo4);
  w[7] = _mm512_and_si512(_mm512_srli_epi16(q3, 4), lo4);
  const __m512i dm = _mm512_permutexvar_epi16(_mm512_load_si512(kDmIdx), hdr);  // 16 d, then 16 m
  d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
  m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
}

// 16 Q8_0 blocks at blk (nb real): w[t] lane l = dword t of block l's codes + 128 (u8); d the scales.
template <bool TAIL>
MM8_INLINE void unpack16_q8_0(const uint8_t* blk, int nb, __m512i* w, __m512& d) {
  auto P = [&](int b) -> const uint8_t* { return (!TAIL || b < nb) ? blk + 34 * b + 2 : kZeros; };
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  if (TAIL && nb <= 4) {
    // At most 4 blocks: one 128-bit lane, 128-bit operations (lanes 4.. are zero: zero codes, zero scales).
    for (int h = 0; h < 2; ++h) {
      __m128i A[4];
      for (int k = 0; k < 4; ++k) A[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(P(k) + 16 * h));
      const __m128i t0 = _mm_unpacklo_epi32(A[0], A[1]), t1 = _mm_unpackhi_epi32(A[0], A[1]);
      const __m128i t2 = _mm_unpacklo_epi32(A[2], A[3]), t3 = _mm_unpackhi_epi32(A[2], A[3]);
      const __m128i b8 = _mm512_castsi512_si128(bias);
      w[4 * h + 0] = _mm512_zextsi128_si512(_mm_xor_si128(_mm_unpacklo_epi64(t0, t2), b8));
      w[4 * h + 1] = _mm512_zextsi128_si512(_mm_xor_si128(_mm_unpackhi_epi64(t0, t2), b8));
      w[4 * h + 2] = _mm512_zextsi128_si512(_mm_xor_si128(_mm_unpacklo_epi64(t1, t3), b8));
      w[4 * h + 3] = _mm512_zextsi128_si512(_mm_xor_si128(_mm_unpackhi_epi64(t1, t3), b8));
    }
    alignas(32) uint16_t hs[16] = {};
    for (int l = 0; l < 4; ++l) hs[l] = l < nb ? load_u16(blk + 34 * l) : 0;
    d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(hs)));
    return;
  }
  for (int h = 0; h < 2; ++h) {
    __m512i A[4];
    for (int k = 0; k < 4; ++k) {
      // Masked broadcasts from memory (a load and a blend) rather than inserts (shuffles, the scarcer port).
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P(k) + 16 * h)));
      v = _mm512_mask_broadcast_i32x4(v, 0x00F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(P(k + 4) + 16 * h)));
      v = _mm512_mask_broadcast_i32x4(v, 0x0F00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(P(k + 8) + 16 * h)));
      A[k] = _mm512_mask_broadcast_i32x4(v, 0xF000,
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(P(k + 12) + 16 * h)));
    }
    transpose4(A, w + 4 * h);
    for (int i = 0; i < 4; ++i) w[4 * h + i] = _mm512_xor_si512(w[4 * h + i], bias);
  }
  // The 16 scales through scalar loads and stores (integer ports, idle here; a vpgatherdd costs far more on Zen 4).
  alignas(32) uint16_t hs[16];
  for (int l = 0; l < 16; ++l) hs[l] = (!TAIL || l < nb) ? load_u16(blk + 34 * l) : 0;
  d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(hs)));
}

// One row against a chunk: the 16 blocks' exact dot products in 16 lanes, then the float part. HALF: the chunk
// has at most 8 blocks, lanes 0..7 only (ymm).
template <Fmt F, bool HALF>
MM8_INLINE void row16(const __m512i* w, __m512 d, __m512 m, const int32_t* x, const float* dx, const float* sx,
                  const int32_t* bias, __m512& acc) {
  if constexpr (!HALF) {
    __m512i a0 = F == Q8_0 ? _mm512_loadu_si512(bias) : _mm512_setzero_si512();
    __m512i a1 = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += 2) {
      a0 = _mm512_dpbusd_epi32(a0, w[t], _mm512_loadu_si512(x + 16 * t));
      a1 = _mm512_dpbusd_epi32(a1, w[t + 1], _mm512_loadu_si512(x + 16 * t + 16));
    }
    const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
    const __m512 s = _mm512_mul_ps(d, _mm512_loadu_ps(dx));
    if constexpr (F == Q4_1) acc = _mm512_fmadd_ps(m, _mm512_loadu_ps(sx), acc);
    acc = _mm512_fmadd_ps(s, f, acc);
  } else {
    __m256i a0 = F == Q8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)) : _mm256_setzero_si256();
    __m256i a1 = _mm256_setzero_si256();
    for (int t = 0; t < 8; t += 2) {
      a0 = _mm256_dpbusd_epi32(a0, _mm512_castsi512_si256(w[t]),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * t)));
      a1 = _mm256_dpbusd_epi32(a1, _mm512_castsi512_si256(w[t + 1]),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * t + 16)));
    }
    const __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1));
    const __m256 s = _mm256_mul_ps(_mm512_castps512_ps256(d), _mm256_loadu_ps(dx));
    __m256 lo = _mm512_castps512_ps256(acc);
    if constexpr (F == Q4_1) lo = _mm256_fmadd_ps(_mm512_castps512_ps256(m), _mm256_loadu_ps(sx), lo);
    lo = _mm256_fmadd_ps(s, f, lo);
    acc = _mm512_mask_mov_ps(acc, 0x00FF, _mm512_castps256_ps512(lo));
  }
}

// T[l] = S[l] + S[l+8], U[l] = T[l] + T[l+4], (U0 + U2) + (U1 + U3).
MM8_INLINE float reduce16_512(__m512 s) {
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

constexpr int VNNI_TILE = 9;

template <Fmt F, int NR, bool TAIL>
MM8_INLINE void unpack16(const uint8_t* blk, int nb, __m512i* w, __m512& d, __m512& m) {
  if constexpr (F == Q4_1) {
    unpack16_q4_1<NR, TAIL>(blk, nb, w, d, m);
  } else {
    unpack16_q8_0<TAIL>(blk, nb, w, d);
    m = _mm512_setzero_ps();
  }
}

// The last chunk (tail = KB % 16 blocks, 0 < tail < 16) against the tile's rows.
template <Fmt F, int MT, int NR>
MM8_INLINE void tail_vnni(const uint8_t* blk, int tail, const int32_t* q, const float* dx, const float* sx,
                          const int32_t* bias, __m512* acc) {
  __m512i w[8];
  __m512 d, m;
  unpack16<F, NR, true>(blk, tail, w, d, m);
  if (tail <= 8) {
    for (int r = 0; r < MT; ++r)
      row16<F, true>(w, d, m, q + r * 128, dx + r * CB, sx + r * CB, bias + r * CB, acc[r]);
  } else {
    for (int r = 0; r < MT; ++r)
      row16<F, false>(w, d, m, q + r * 128, dx + r * CB, sx + r * CB, bias + r * CB, acc[r]);
  }
}

// Weight rows [n0, n1) against the tile of MT rows at r0.
template <Fmt F, int MT>
void tile_vnni(const Args8& a, int64_t r0, int64_t n0, int64_t n1) {
  constexpr int64_t BB = block_bytes<F>();
  const int32_t* q = a.q + r0 * a.C * 128;
  const float* dx = a.dx + r0 * a.C * CB;
  const float* sx = a.sx + r0 * a.C * CB;
  const int32_t* bias = a.bias + r0 * a.C * CB;
  const int64_t full = a.KB / CB;
  const int tail = static_cast<int>(a.KB % CB);
  const int nr = (5 * tail + 15) / 16;  // Q4_1: registers of 16 dwords the tail's blocks span
  const int64_t o = full * MT;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; ++c) {
      __m512i w[8];
      __m512 d, m;
      unpack16<F, 5, false>(row + c * CB * BB, 16, w, d, m);
      const int64_t oc = c * MT;
      for (int r = 0; r < MT; ++r)
        row16<F, false>(w, d, m, q + (oc + r) * 128, dx + (oc + r) * CB, sx + (oc + r) * CB, bias + (oc + r) * CB,
                        acc[r]);
    }
    if (tail) {
      const uint8_t* blk = row + full * CB * BB;
      const int32_t* qt = q + o * 128;
      const float *dt = dx + o * CB, *st = sx + o * CB;
      const int32_t* bt = bias + o * CB;
      if constexpr (F == Q4_1) {
        with_rows<5>(nr, [&](auto regs) { tail_vnni<F, MT, decltype(regs)::value>(blk, tail, qt, dt, st, bt, acc); });
      } else {
        tail_vnni<F, MT, 5>(blk, tail, qt, dt, st, bt, acc);
      }
    }
    for (int r = 0; r < MT; ++r) a.out[(r0 + r) * a.N + n] = reduce16_512(acc[r]);
  }
}

template <Fmt F>
void dispatch_vnni(const Args8& a, int64_t r0, int mt, int64_t n0, int64_t n1) {
  with_rows<VNNI_TILE>(mt, [&](auto rows) { tile_vnni<F, decltype(rows)::value>(a, r0, n0, n1); });
}

#endif  // QGEMM8_VNNI

// ------------------------------------------------------------------------------------------------ driver

constexpr Impls IMPLS{QGEMM8_AVX2, QGEMM8_VNNI, "avx512vnni"};

template <Fmt F>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, float* out, int64_t N, Impl impl) {
  int tile = SCALAR_TILE;
#if QGEMM8_VNNI
  if (impl == AVX512) tile = VNNI_TILE;
#endif
#if QGEMM8_AVX2
  if (impl == AVX2) tile = AVX2_TILE;
#endif
  const auto tiles = row_tiles(M, tile, tile);
  const Packed p = pack_rows(x, M, K, tiles);
  const int64_t KB = K / QK;
  const Args8 a{p.q.data(), p.dx.data(), p.sx.data(), p.bias.data(),
                w, out, KB, (KB + CB - 1) / CB, N, KB * block_bytes<F>()};
  rows_by_tiles(impl, tiles, N, K, M, [&](int64_t r0, int mt, int64_t g0, int64_t g1) {
#if QGEMM8_VNNI
    if (impl == AVX512) return dispatch_vnni<F>(a, r0, mt, g0, g1);
#endif
#if QGEMM8_AVX2
    if (impl == AVX2) return dispatch_avx2<F>(a, r0, mt, g0);
#endif
    tile_scalar<F>(a, r0, mt, g0);  // one weight row a call (g1 = g0 + 1)
  });
}

}  // namespace mm8

torch::Tensor qmm8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt, int64_t impl) {
  return block_product(x, blocks, fmt, impl, mm8::IMPLS, "8",
                       [&](auto f, const float* xp, int64_t M, int64_t K, float* out, Impl chosen) {
                         mm8::run<decltype(f)::value>(xp, M, K, blocks.data_ptr<uint8_t>(), out, blocks.size(0),
                                                      chosen);
                       });
}

torch::Tensor q4_1_mm8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t impl) {
  return qmm8(x, blocks, Q4_1, impl);
}
torch::Tensor q8_0_mm8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t impl) {
  return qmm8(x, blocks, Q8_0, impl);
}

// The activations' quantization as the products use it: (codes int8 (M, K), dx float32 (M, K/32), sx float32
// (M, K/32)), sx = dx * sum of the block's codes.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "quantize_rows: x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quantize_rows: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "quantize_rows: x must be 2-D (M, K), got ", x.dim(), " dimensions");
  TORCH_CHECK(x.is_contiguous(), "quantize_rows: x must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "quantize_rows: K (", K, ") must be a multiple of 32");
  const int64_t KB = K / QK;
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, KB}, x.options());
  auto sx = torch::empty({M, KB}, x.options());
  std::vector<int32_t> sq(static_cast<size_t>(KB));
  for (int64_t r = 0; r < M; ++r)
    mm8::quantize_row8(x.data_ptr<float>() + r * K, KB, q.data_ptr<int8_t>() + r * K, dx.data_ptr<float>() + r * KB,
                       sx.data_ptr<float>() + r * KB, sq.data());
  return {q, dx, sx};
}

std::vector<std::string> impls8() { return mm8::IMPLS.names(); }

}  // namespace

// For the layer loop (step.cpp): the product as `q4_1_mm8` / `q8_0_mm8` computes it.
torch::Tensor qgemm_blocks_mm8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t fmt) {
  return qmm8(x, blocks, fmt, AUTO);
}

// The int8 kernel's entry points, added to the extension's module by qgemm.cpp.
void register_mm8(pybind11::module& m) {
  m.def("q4_1_mm8", &q4_1_mm8, "x (M, K) float32 @ Q4_1 blocks (N, K/32, 20).T with x quantized to int8 blocks",
        py::arg("x"), py::arg("blocks"), py::arg("impl") = 0);
  m.def("q8_0_mm8", &q8_0_mm8, "x (M, K) float32 @ Q8_0 blocks (N, K/32, 34).T with x quantized to int8 blocks",
        py::arg("x"), py::arg("blocks"), py::arg("impl") = 0);
  m.def("qmm8", &qmm8, "qmm8(x, blocks, fmt, impl): fmt 0 Q4_1, 1 Q8_0; impl 0 auto, 1 scalar, 2 avx2, 3 avx512vnni");
  m.def("quantize_rows", &quantize_rows, "x (M, K) float32 -> (codes int8 (M, K), dx (M, K/32), sx (M, K/32))");
  m.def("impls8", &impls8, "the implementations compiled in this build, worst to best");
}
