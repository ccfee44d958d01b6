// The small kernels of the layer loop (step.cpp), which the Python loop also calls (specdec.layerloop): RMSNorm,
// rotary positions, attention of one query. Included by step.cpp only.
#pragma once

#include <torch/extension.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// ------------------------------------------------------------------------------------------------ small kernels
// Each computes every row (and every query) by one fixed sequence of float operations, whatever else shares the
// call: rows never depend on the batch, the row count or the thread count. The Python loop calls the same
// functions (specdec.layerloop), so both loops compute the same bits.

// Sum of squares of n floats: eight running sums (positions j % 8), then a fixed tree.
inline float sum_squares(const float* x, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) s[l] += x[j + l] * x[j + l];
  for (int l = 0; j < n; ++j, ++l) s[l] += x[j] * x[j];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// RMSNorm of `rows` rows of D floats: y = x / sqrt(mean(x^2) + eps) * weight.
inline void rms_norm_into(const float* px, const float* pw, float* po, int64_t rows, int64_t D, double eps) {
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px + r * D;
    float* yr = po + r * D;
    const float inv = 1.0f / std::sqrt(sum_squares(xr, D) / static_cast<float>(D) + e);
    for (int64_t j = 0; j < D; ++j) yr[j] = (xr[j] * inv) * pw[j];
  }
}

// RMSNorm of each row of x (..., D) float32: x / sqrt(mean(x^2) + eps) * weight.
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "rms_norm: x must be float32 on the CPU");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be float32 (D,)");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t D = xc.size(-1), rows = D ? xc.numel() / D : 0;
  rms_norm_into(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, D, eps);
  return out;
}

// One head's rotary position: y = x * c + roll(x, hd/2) * s, element for element as those ATen operations compute it
// (products and a sum, each rounded once).
inline void rope_head(const float* x, const float* c, const float* s, int64_t hd, float* y) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) {
    const float a = x[d] * c[d];
    const float r = x[d < half ? d + half : d - half] * s[d];
    y[d] = a + r;
  }
}

// The rotary positions of heads (B, H, n, hd) at cos and sin_signed (B, 1, n, hd): x * cos + roll(x, hd/2) *
// sin_signed, element for element what those three ATen operations compute (products and a sum, each rounded
// once), laid out as they lay it out ((B, n, H, hd) memory, returned as (B, H, n, hd)).
torch::Tensor rope_heads(const torch::Tensor& heads, const torch::Tensor& cos, const torch::Tensor& sin_signed) {
  const int64_t B = heads.size(0), H = heads.size(1), n = heads.size(2), hd = heads.size(3);
  TORCH_CHECK(heads.stride(3) == 1 && cos.stride(3) == 1 && sin_signed.stride(3) == 1, "rope: rows must be dense");
  auto out = at::empty({B, n, H, hd}, heads.options());
  const float* px = heads.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin_signed.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t xb = heads.stride(0), xh = heads.stride(1), xt = heads.stride(2);
  const int64_t cb = cos.stride(0), ct = cos.stride(2), sb = sin_signed.stride(0), st = sin_signed.stride(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t) {
      const float* c = pc + b * cb + t * ct;
      const float* s = ps + b * sb + t * st;
      for (int64_t h = 0; h < H; ++h) rope_head(px + b * xb + h * xh + t * xt, c, s, hd, po + ((b * n + t) * H + h) * hd);
    }
  return out.transpose(1, 2);
}

// Attention of one query over `end` keys: q (1, Hq, 1, hd), keys and values (1, Hkv, >= end, hd) with dense rows
// (any strides otherwise); query head h reads key head h / (Hq / Hkv). Per head: scores q.k / sqrt(hd) (dot
// products in eight running sums, summed by a fixed tree), exponentials of the scores less the largest, then the
// weighted sum of the values in key order, divided by the weights' sum (summed in key order). Every key's
// arithmetic is the same whatever `end` is. Returns (1, Hq, 1, hd).
#ifdef __AVX2__
// exp(x) for x <= 0, eight at once (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n); below
// -87 (where float32 exp underflows) it gives 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                 _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}
#endif

// p[0, n) = exp(p - top), n rounded up to a multiple of 8 (the buffer's padding holds -inf).
inline void exp_shifted(float* p, int64_t n, float top) {
#ifdef __AVX2__
  const __m256 t = _mm256_set1_ps(top);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(p + i, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), t)));
#else
  for (int64_t i = 0; i < n; ++i) p[i] = std::exp(p[i] - top);
#endif
}

// sum of a[d] * b[d]: eight running sums (positions d % 8; each starts as its first product), then the fixed tree
// ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)).
inline float dot8(const float* a, const float* b, int64_t n) {
#ifdef __AVX2__
  if (n % 8 == 0 && n > 0) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t d = 8; d < n; d += 8) s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
    const __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // s0+s4, s1+s5, ...
    const __m128 w = _mm_hadd_ps(v, v);                                                   // (v0+v1), (v2+v3)
    return _mm_cvtss_f32(_mm_hadd_ps(w, w));
  }
#endif
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < n; ++d) s[d % 8] = d < 8 ? a[d] * b[d] : s[d % 8] + a[d] * b[d];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// acc[d] += w * v[d]
inline void add_scaled(float* acc, const float* v, float w, int64_t n) {
  int64_t d = 0;
#ifdef __AVX2__
  const __m256 ww = _mm256_set1_ps(w);
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(ww, _mm256_loadu_ps(v + d))));
#endif
  for (; d < n; ++d) acc[d] += w * v[d];
}

// A cache holds keys and values as float32 or float16 (`BatchLlama.kv_dtype`); every read converts a float16 element
// to float32 exactly (both hold every float16 value), so the arithmetic below is the same on the converted values.

// A key or value row as float32: the row itself, or its n elements converted into buf.
inline const float* row_floats(const float* row, int64_t, float*) { return row; }
inline const float* row_floats(const c10::Half* row, int64_t n, float* buf) {
  for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<float>(row[d]);
  return buf;
}

// The element a float16 cache stores for x: round to nearest, ties to even (what PyTorch's copy into a float16
// tensor does, so that the Python loop and this one write the same bits).
inline void store_as(float x, float* y) { *y = x; }
inline void store_as(float x, c10::Half* y) { *y = c10::Half(x); }

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// dot8's tree of each of 8 keys' running sums s[j], side by side: lane j holds key j's sum. Keys j and j + 4 in one
// register: lanes l + (l + 4) of each (dot8's first step), then its two pairwise sums.
inline __m256 dot8_trees(const __m256* s) {
  __m256 a[4];
  for (int j = 0; j < 4; ++j)
    a[j] = _mm256_add_ps(_mm256_permute2f128_ps(s[j], s[j + 4], 0x20), _mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
  return _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
}

// The scores of the 8 keys from k (rows kt floats apart): for each, dot8's arithmetic (eight running sums, the same
// tree), the 8 trees summed side by side; lane j holds key j's. hd a positive multiple of 8.
template <typename KT>
inline __m256 dot8_keys8(const float* qv, const KT* k, int64_t kt, int64_t hd) {
  __m256 s[8];
  const __m256 q0 = _mm256_loadu_ps(qv);
  for (int j = 0; j < 8; ++j) s[j] = _mm256_mul_ps(q0, load8(k + j * kt));
  for (int64_t d = 8; d < hd; d += 8) {
    const __m256 qd = _mm256_loadu_ps(qv + d);
    for (int j = 0; j < 8; ++j) s[j] = _mm256_add_ps(s[j], _mm256_mul_ps(qd, load8(k + j * kt + d)));
  }
  return dot8_trees(s);
}

// acc (V x 8 floats) = sum over t < end, in key order from 0, then over the tail's rows (tail[i] * vt floats into
// vbase, weights p[end + i]) in order, of p[t] * v_t (each product rounded, then the sum): add_scaled's arithmetic
// with the sums held in registers (16 lanes a register where the CPU has them); returns the weights' total, summed
// in the same order alongside. With a tail, the values of keys [0, end) then the tail's are summed exactly as those
// of one contiguous run of keys in that order.
template <int V, typename KT>
inline float weigh_values(const float* p, const KT* vbase, int64_t vt, int64_t end, const int64_t* tail,
                          int64_t n_tail, float* acc) {
  float total = 0.0f;
  const int64_t all = end + n_tail;
#ifdef __AVX512F__
  static_assert(V % 2 == 0, "16 lanes a register");
  __m512 s[V / 2];
  for (int j = 0; j < V / 2; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < all; ++t) {
    const __m512 w = _mm512_set1_ps(p[t]);
    const KT* v = vbase + (t < end ? t : tail[t - end]) * vt;
    for (int j = 0; j < V / 2; ++j) s[j] = _mm512_add_ps(s[j], _mm512_mul_ps(w, load16(v + 16 * j)));
    total += p[t];
  }
  for (int j = 0; j < V / 2; ++j) _mm512_storeu_ps(acc + 16 * j, s[j]);
#else
  __m256 s[V];
  for (int j = 0; j < V; ++j) s[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < all; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const KT* v = vbase + (t < end ? t : tail[t - end]) * vt;
    for (int j = 0; j < V; ++j) s[j] = _mm256_add_ps(s[j], _mm256_mul_ps(w, load8(v + 8 * j)));
    total += p[t];
  }
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + 8 * j, s[j]);
#endif
  return total;
}
#endif

// One head of one query: q (hd) over keys and values [0, end) (rows kt and vt floats apart), then over the n_tail
// rows listed in tail (a token tree's node: its ancestors and itself, at the slot rows where the pass wrote them),
// into y (hd). p holds end + n_tail rounded up to a multiple of 8 floats; acc hd floats. Every score is dot8's
// arithmetic; the values are summed in key order (add_scaled's), the weights' total too. Vectorized across keys
// where hd allows (8 scores at a time, the values' sums in registers) with those very operations: the same bits as
// one key at a time (tested against a reference of this arithmetic), and a tail's the same bits as its keys laid
// out contiguously after `end` (so a tree's node attends as the one-token step at its place would).
template <typename KT>
inline void attend_head(const float* qv, const KT* kbase, int64_t kt, const KT* vbase, int64_t vt, int64_t end,
                        int64_t hd, float scale, float* p, float* acc, float* y, const int64_t* tail = nullptr,
                        int64_t n_tail = 0) {
  float row[256];  // a float16 key or value row as float32 (head sizes up to 256)
  const int64_t all = end + n_tail, padded = (all + 7) / 8 * 8;
  float top = -INFINITY;
  int64_t t = 0;
#ifdef __AVX2__
  if (hd % 8 == 0 && hd > 0) {
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 most = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= end; t += 8) {
      const __m256 z = _mm256_mul_ps(dot8_keys8(qv, kbase + t * kt, kt, hd), sc);
      _mm256_storeu_ps(p + t, z);
      most = _mm256_max_ps(most, z);
    }
    alignas(32) float m8[8];
    _mm256_store_ps(m8, most);
    for (float m : m8) top = std::max(top, m);
  }
#endif
  for (; t < all; ++t) {
    p[t] = dot8(qv, row_floats(kbase + (t < end ? t : tail[t - end]) * kt, hd, row), hd) * scale;
    top = std::max(top, p[t]);
  }
  for (int64_t t = all; t < padded; ++t) p[t] = -INFINITY;
  exp_shifted(p, padded, top);
  float total = 0.0f;
#ifdef __AVX2__
  if (hd == 64) {
    total = weigh_values<8>(p, vbase, vt, end, tail, n_tail, acc);
  } else if (hd == 128) {
    total = weigh_values<16>(p, vbase, vt, end, tail, n_tail, acc);
  } else
#endif
  {
    for (int64_t t = 0; t < all; ++t) total += p[t];
    std::fill(acc, acc + hd, 0.0f);
    for (int64_t t = 0; t < all; ++t)
      add_scaled(acc, row_floats(vbase + (t < end ? t : tail[t - end]) * vt, hd, row), p[t], hd);
  }
  for (int64_t d = 0; d < hd; ++d) y[d] = acc[d] / total;
}

// G query heads that read one key head (grouped-query attention), each exactly as attend_head computes it alone
// (its scores, its softmax, its weighted values: the same operations in the same order, so the same bits), with
// each key and value row loaded (and, from a float16 cache, converted) once for the G of them instead of G times.
// qv[g], y[g]: query g and its output (hd = 8 V floats: 64 or 128); p: G buffers of `padded` floats; acc: G x hd.
#ifdef __AVX2__
template <int G, int V, typename KT>
inline void attend_heads(const float* const* qv, const KT* kbase, int64_t kt, const KT* vbase, int64_t vt,
                         int64_t end, float scale, int64_t padded, float* p, float* acc, float* const* y,
                         const int64_t* tail, int64_t n_tail) {
  constexpr int64_t hd = 8 * V;
  float row[256];
  const int64_t all = end + n_tail;
  float top[G];
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 most[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY, most[g] = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= end; t += 8) {  // dot8_keys8's arithmetic for each query, the keys loaded once
    const KT* k = kbase + t * kt;
    __m256 s[G][8];
    for (int j = 0; j < 8; ++j) {
      const __m256 k0 = load8(k + j * kt);
      for (int g = 0; g < G; ++g) s[g][j] = _mm256_mul_ps(_mm256_loadu_ps(qv[g]), k0);
    }
    for (int64_t d = 8; d < hd; d += 8)
      for (int j = 0; j < 8; ++j) {
        const __m256 kd = load8(k + j * kt + d);
        for (int g = 0; g < G; ++g) s[g][j] = _mm256_add_ps(s[g][j], _mm256_mul_ps(_mm256_loadu_ps(qv[g] + d), kd));
      }
    for (int g = 0; g < G; ++g) {
      const __m256 z = _mm256_mul_ps(dot8_trees(s[g]), sc);
      _mm256_storeu_ps(p + g * padded + t, z);
      most[g] = _mm256_max_ps(most[g], z);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(32) float m8[8];
    _mm256_store_ps(m8, most[g]);
    for (float m : m8) top[g] = std::max(top[g], m);
  }
  for (; t < all; ++t) {
    const float* kr = row_floats(kbase + (t < end ? t : tail[t - end]) * kt, hd, row);
    for (int g = 0; g < G; ++g) {
      p[g * padded + t] = dot8(qv[g], kr, hd) * scale;
      top[g] = std::max(top[g], p[g * padded + t]);
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {
    for (int64_t u = all; u < padded; ++u) p[g * padded + u] = -INFINITY;
    exp_shifted(p + g * padded, padded, top[g]);
    total[g] = 0.0f;
  }
  // weigh_values' arithmetic for each query, each value row loaded once
#ifdef __AVX512F__
  __m512 sv[G][V / 2];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V / 2; ++j) sv[g][j] = _mm512_setzero_ps();
  for (int64_t u = 0; u < all; ++u) {
    const KT* v = vbase + (u < end ? u : tail[u - end]) * vt;
    for (int j = 0; j < V / 2; ++j) {
      const __m512 vj = load16(v + 16 * j);
      for (int g = 0; g < G; ++g) sv[g][j] = _mm512_add_ps(sv[g][j], _mm512_mul_ps(_mm512_set1_ps(p[g * padded + u]), vj));
    }
    for (int g = 0; g < G; ++g) total[g] += p[g * padded + u];
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V / 2; ++j) _mm512_storeu_ps(acc + g * hd + 16 * j, sv[g][j]);
#else
  __m256 sv[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) sv[g][j] = _mm256_setzero_ps();
  for (int64_t u = 0; u < all; ++u) {
    const KT* v = vbase + (u < end ? u : tail[u - end]) * vt;
    for (int j = 0; j < V; ++j) {
      const __m256 vj = load8(v + 8 * j);
      for (int g = 0; g < G; ++g) sv[g][j] = _mm256_add_ps(sv[g][j], _mm256_mul_ps(_mm256_set1_ps(p[g * padded + u]), vj));
    }
    for (int g = 0; g < G; ++g) total[g] += p[g * padded + u];
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + g * hd + 8 * j, sv[g][j]);
#endif
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < hd; ++d) y[g][d] = acc[g * hd + d] / total[g];
}

// attend_heads for `group` query heads (2-4) of `hd` floats (64 or 128).
template <typename KT>
using AttendHeads = void (*)(const float* const*, const KT*, int64_t, const KT*, int64_t, int64_t, float, int64_t,
                             float*, float*, float* const*, const int64_t*, int64_t);
template <typename KT>
inline AttendHeads<KT> attend_group(int64_t group, int64_t hd) {
  static const AttendHeads<KT> table[3][2] = {{attend_heads<2, 8, KT>, attend_heads<2, 16, KT>},
                                              {attend_heads<3, 8, KT>, attend_heads<3, 16, KT>},
                                              {attend_heads<4, 8, KT>, attend_heads<4, 16, KT>}};
  return table[group - 2][hd == 128];
}
#endif

template <typename KT>
torch::Tensor attend_one_as(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                            int64_t end, double scale_or_zero) {
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1, "attend_one: q must be (1, Hq, 1, hd)");
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1 && keys.size(2) >= end && end > 0, "attend_one: keys too short");
  const auto qc = q.stride(3) == 1 ? q : q.contiguous();
  const auto kc = keys.stride(3) == 1 ? keys : keys.contiguous();
  const auto vc = values.stride(3) == 1 ? values : values.contiguous();
  const int64_t Hq = qc.size(1), Hkv = kc.size(1), hd = qc.size(3);
  TORCH_CHECK(Hq % Hkv == 0 && vc.size(1) == Hkv && kc.size(3) == hd && vc.size(3) == hd,
              "attend_one: heads and head sizes must agree");
  const int64_t group = Hq / Hkv;
  auto out = at::empty({1, Hq, 1, hd}, qc.options());
  const float* pq = qc.data_ptr<float>();
  const KT* pk = kc.data_ptr<KT>();
  const KT* pv = vc.data_ptr<KT>();
  float* po = out.data_ptr<float>();
  const int64_t qh = qc.stride(1), kh = kc.stride(1), kt = kc.stride(2), vh = vc.stride(1), vt = vc.stride(2);
  const float scale = scale_or_zero > 0 ? static_cast<float>(scale_or_zero) : 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t padded = (end + 7) / 8 * 8;
  // ~hd multiply-adds a key for the scores and as many for the values: a thread takes >= 64K of them
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * hd * end));
  at::parallel_for(0, Hq, grain, [&](int64_t h0, int64_t h1) {
    std::vector<float> p(static_cast<size_t>(padded), -INFINITY);
    std::vector<float> acc(static_cast<size_t>(hd));
    for (int64_t h = h0; h < h1; ++h)
      attend_head(pq + h * qh, pk + (h / group) * kh, kt, pv + (h / group) * vh, vt, end, hd, scale, p.data(),
                  acc.data(), po + h * hd);
  });
  return out;
}

// float32 queries over float32 or float16 keys and values (a cache's `kv_dtype`; both the same). scale: the scores'
// (a family's own, `specdec.families.Arch.query_scale`), 0 for 1/sqrt(head size).
torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, int64_t end,
                         double scale) {
  const auto kv = keys.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && (kv == at::kFloat || kv == at::kHalf) && values.scalar_type() == kv,
              "attend_one: float32 queries over float32 or float16 keys and values (both the same)");
  TORCH_CHECK(q.size(-1) <= 256, "attend_one: head sizes up to 256");
  return kv == at::kHalf ? attend_one_as<c10::Half>(q, keys, values, end, scale)
                         : attend_one_as<float>(q, keys, values, end, scale);
}

}  // namespace
