// The layer loop of specdec's lean Llama path (BatchLlama.forward_fused for rows without token trees), in C++,
// and the small kernels both loops share (RMSNorm, rotary positions, attention of one query).
//
// It computes what the Python loop in src/specdec/llama.py computes (`_attention`, `_mlp`, `_norm`,
// `exact_attention`, `Int4Weight.mm`), on the same shapes and in the same order: the same ATen operations where
// it calls ATen, the same functions of this file where the Python loop calls them (specdec.layerloop), and
// element for element the same arithmetic where it fuses ATen operations (the rotary positions); so its results
// are bit for bit the Python loop's (tests/models/test_layerloop.py). What it removes is the interpreter's work around
// each operation (~50 Python calls a layer) and a dozen small operations a layer. The products run on the kernel
// each weight was loaded for: PyTorch's int4 kernel (bfloat16 activations), specdec.qgemm's block kernels, or a
// float matrix. Where every query attends alone (one-token steps, verification passes) and every product is one
// of specdec.qgemm's block kernels, the layers run on one workspace of raw buffers (`run_raw`): the same
// operations on the same values, two ATen calls a layer (SiLU and its product) instead of ~35.
#include <torch/extension.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

// specdec.qgemm's products (qgemm.cpp, qgemm8.cpp): x (M, K) float32 contiguous @ blocks.T, fmt 0 Q4_1, 1 Q8_0.
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

struct Layer {
  torch::Tensor in_norm, post_norm;
  Product qkv, o, gate_up, down;
  // what some families add (`specdec.families`; undefined where a layer has none): a bias on q|k|v, RMSNorms of each
  // head of q and of k, of the attention's and the MLP's outputs; the sliding window (0: none); the rotary table
  torch::Tensor qkv_bias, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t window = 0, rope = 0;
};

// The model's layers and shapes, built once per model (`specdec.step.stack_for`).
class Stack {
 public:
  Stack(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, int64_t chunk, int64_t fine, bool exact_rows)
      : n_heads_(n_heads),
        n_kv_(n_kv),
        head_dim_(head_dim),
        eps_(eps),
        chunk_(chunk),
        fine_(fine),
        exact_rows_(exact_rows) {
    TORCH_CHECK(head_dim > 0 && head_dim <= 256, "the layer loop: head sizes up to 256");
  }

  // A family's computation beside Llama's (`specdec.families.Arch`): GeGLU (gelu, tanh) instead of SwiGLU, and the
  // attention's scale where it is not 1/sqrt(head size) (0: that).
  void set_family(bool gelu, double scale) { gelu_ = gelu, scale_ = static_cast<float>(scale); }

  // The last added layer's extras (see Layer); each optional (None: the layer has none).
  void set_extras(const std::optional<torch::Tensor>& qkv_bias, const std::optional<torch::Tensor>& q_norm,
                  const std::optional<torch::Tensor>& k_norm, const std::optional<torch::Tensor>& attn_out_norm,
                  const std::optional<torch::Tensor>& mlp_out_norm, int64_t window, int64_t rope) {
    TORCH_CHECK(!layers_.empty(), "set_extras: add the layer first");
    Layer& w = layers_.back();
    const auto take = [&](const std::optional<torch::Tensor>& t, int64_t size, const char* what) {
      if (!t) return torch::Tensor();
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == size && t->is_contiguous(),
                  "set_extras: ", what, " must be float32 (", size, ",), dense");
      return *t;
    };
    w.qkv_bias = take(qkv_bias, w.qkv.out_rows, "qkv_bias");
    w.q_norm = take(q_norm, head_dim_, "q_norm");
    w.k_norm = take(k_norm, head_dim_, "k_norm");
    w.attn_out_norm = take(attn_out_norm, w.o.out_rows, "attn_out_norm");
    w.mlp_out_norm = take(mlp_out_norm, w.down.out_rows, "mlp_out_norm");
    TORCH_CHECK(w.q_norm.defined() == w.k_norm.defined(), "set_extras: q_norm and k_norm together");
    TORCH_CHECK(window >= 0 && rope >= 0, "set_extras: window and rope index >= 0");
    w.window = window, w.rope = rope;
  }

  void add_layer(const torch::Tensor& in_norm, const torch::Tensor& post_norm, const std::vector<Product>& products) {
    TORCH_CHECK(products.size() == 4, "a layer has four products (qkv, o, gate_up, down)");
    layers_.push_back(Layer{in_norm, post_norm, products[0], products[1], products[2], products[3]});
    // run_raw: every product into a buffer, dense norms, and every layer of the first one's shapes
    const Layer& first = layers_.front();
    for (const auto& p : products) raw_ = raw_ && p.has_into();
    raw_ = raw_ && in_norm.is_contiguous() && post_norm.is_contiguous() &&
           products[0].out_rows == (n_heads_ + 2 * n_kv_) * head_dim_ && products[1].in_features == n_heads_ * head_dim_ &&
           products[2].out_rows == 2 * products[3].in_features && products[1].out_rows == products[3].out_rows &&
           products[1].out_rows == first.o.out_rows && products[3].in_features == first.down.in_features;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  bool raw() const { return raw_; }

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
                                                           const std::vector<int64_t>& capture,
                                                           const std::vector<std::vector<int64_t>>& trees,
                                                           const std::vector<torch::Tensor>& more_cos,
                                                           const std::vector<torch::Tensor>& more_sin) const {
    const auto rows = static_cast<int64_t>(keys.size());
    TORCH_CHECK(more_cos.size() == more_sin.size(), "one sin_signed per cos");
    std::vector<torch::Tensor> coss{cos}, sins{sin_signed};  // the rotary tables at each row's positions, by index
    coss.insert(coss.end(), more_cos.begin(), more_cos.end());
    sins.insert(sins.end(), more_sin.begin(), more_sin.end());
    for (const auto& w : layers_) TORCH_CHECK(w.rope < static_cast<int64_t>(coss.size()), "run: a layer's rotary table is missing");
    TORCH_CHECK(static_cast<int64_t>(values.size()) == rows && static_cast<int64_t>(starts.size()) == rows &&
                    static_cast<int64_t>(n_new.size()) == rows && static_cast<int64_t>(scored.size()) == rows,
                "one key buffer, value buffer, start, count of new and of scored tokens per row");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == rows, "x must be (rows, n, D)");
    const Trees tails = tree_tails(trees, starts, n_new, scored);
    TORCH_CHECK(tails.empty() || all_alone(n_new, scored), "token trees in the C++ loop: every query attends alone");
    for (const auto& w : layers_) TORCH_CHECK(tails.empty() || w.window == 0, "token trees in the C++ loop: no window");
    bool dense = true;
    for (size_t r = 0; r < coss.size(); ++r) dense = dense && coss[r].stride(3) == 1 && sins[r].stride(3) == 1;
    const int64_t count = n_layers < 0 ? size() : std::min(n_layers, size());
    std::vector<torch::Tensor> kept;
    c10::InferenceMode guard;
    if (raw_ && all_alone(n_new, scored) && x.is_contiguous() && x.scalar_type() == at::kFloat && dense)
      return {run_raw(x, coss, sins, keys, values, starts, n_new, tails, count, capture, kept), kept};
    // x is this call's own (the embedding's gather): added to in place until a layer's output is kept
    bool shared = false;
    for (int64_t i = 0; i < count; ++i) {
      const Layer& w = layers_[i];
      auto a = attention(i, norm(x, w.in_norm), coss[w.rope], sins[w.rope], keys, values, starts, n_new, scored, tails);
      x = shared ? x + a : x.add_(a);
      auto m = mlp(x, w);
      x = shared ? x + m : x.add_(m);
      for (int64_t c : capture)
        if (c == i) kept.push_back(x), shared = true;
    }
    return {x, kept};
  }

  // Per row, per new token, the slot rows a token tree's node attends to after the row's chain: its ancestors (root
  // first) and itself; empty for the chain's tokens and rows without a tree. The Python loop's `tree_layout`.
  using Trees = std::vector<std::vector<std::vector<int64_t>>>;

 private:
  inline static const std::vector<std::vector<int64_t>> kNoTails{};

  // trees: per row, the parents of its token tree (its last len(parents) new tokens; -1 the root), or empty. A tree
  // row's queries must all attend alone (its chain one token, every token scored), as in a verification pass.
  Trees tree_tails(const std::vector<std::vector<int64_t>>& trees, const std::vector<int64_t>& starts,
                   const std::vector<int64_t>& n_new, const std::vector<int64_t>& scored) const {
    Trees tails;
    bool any = false;
    for (const auto& t : trees) any = any || !t.empty();
    if (!any) return tails;
    TORCH_CHECK(trees.size() == starts.size(), "one tree (or none) per row");
    tails.resize(trees.size());
    for (size_t b = 0; b < trees.size(); ++b) {
      const auto& parents = trees[b];
      if (parents.empty()) continue;
      const auto nodes = static_cast<int64_t>(parents.size()), chain = n_new[b] - nodes;
      TORCH_CHECK(exact_rows_ && chain == 1 && scored[b] >= n_new[b],
                  "a token tree in the C++ loop: a chain of one token, every query scored alone");
      auto& rt = tails[b];
      rt.assign(static_cast<size_t>(n_new[b]), {});
      const int64_t base = starts[b] + chain;  // node j was written at slot row base + j
      for (int64_t j = 0; j < nodes; ++j) {
        TORCH_CHECK(parents[j] < j && parents[j] >= -1, "a tree's parent comes before its child");
        std::vector<int64_t> path;
        for (int64_t a = j; a >= 0; a = parents[a]) path.push_back(base + a);
        rt[chain + j].assign(path.rbegin(), path.rend());
      }
    }
    return tails;
  }

  // `run` where every query attends alone and every product writes into a buffer (`raw_`): the same operations
  // on the same values (RMSNorm and the products into buffers, the attention through `attend_alone`, the residual
  // adds in place, SiLU and its product through ATen on views of the buffers), without a tensor a layer: one
  // workspace for every layer.
  torch::Tensor run_raw(torch::Tensor x, const std::vector<torch::Tensor>& coss, const std::vector<torch::Tensor>& sins,
                        const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                        const std::vector<int64_t>& starts, const std::vector<int64_t>& n_new, const Trees& tails,
                        int64_t count, const std::vector<int64_t>& capture, std::vector<torch::Tensor>& kept) const {
    const int64_t rows = x.size(0), n = x.size(1), D = x.size(2), T = rows * n;
    const int64_t width = (n_heads_ + 2 * n_kv_) * head_dim_, heads = n_heads_ * head_dim_;
    const int64_t inner = count > 0 ? layers_[0].down.in_features : 0;
    TORCH_CHECK(count == 0 || layers_[0].o.out_rows == D, "run: x must be (rows, n, D) with D the layers' width");
    auto work = at::empty({T * (D + width + 2 * heads + 3 * inner + D)}, x.options());
    float* h = work.data_ptr<float>();
    float* qkv = h + T * D;
    float* qbuf = qkv + T * width;
    float* att = qbuf + T * heads;
    float* gu = att + T * heads;
    float* act = gu + T * 2 * inner;
    float* y = act + T * inner;
    // the views SiLU and its product read and write (as `mlp` computes them on chunk(2, -1) of gate_up's output)
    const auto gu_t = work.narrow(0, T * (D + width + 2 * heads), T * 2 * inner).view({rows, n, 2 * inner});
    const auto halves = gu_t.chunk(2, -1);
    auto act_t = work.narrow(0, T * (D + width + 2 * heads + 2 * inner), T * inner).view({rows, n, inner});
    float* px = x.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) {
      const Layer& w = layers_[i];
      rms_norm_into(px, w.in_norm.data_ptr<float>(), h, T, D, eps_);
      w.qkv.into(h, T, qkv);
      heads_extras(w, qkv, T);
      if (rows > 1) std::fill(att, att + T * heads, 0.0f);  // padding positions (as `attention_alone`'s zeros)
      attend_alone(i, qkv, rows, n, coss[w.rope], sins[w.rope], keys, values, starts, n_new, tails, qbuf, att);
      w.o.into(att, T, y);
      if (w.attn_out_norm.defined()) rms_norm_into(y, w.attn_out_norm.data_ptr<float>(), y, T, D, eps_);
      for (int64_t j = 0; j < T * D; ++j) px[j] += y[j];
      rms_norm_into(px, w.post_norm.data_ptr<float>(), h, T, D, eps_);
      w.gate_up.into(h, T, gu);
      if (gelu_)
        at::gelu_out(act_t, halves[0], "tanh");
      else
        at::silu_out(act_t, halves[0]);
      at::mul_out(act_t, act_t, halves[1]);
      w.down.into(act, T, y);
      if (w.mlp_out_norm.defined()) rms_norm_into(y, w.mlp_out_norm.data_ptr<float>(), y, T, D, eps_);
      for (int64_t j = 0; j < T * D; ++j) px[j] += y[j];
      for (int64_t c : capture)
        if (c == i) kept.push_back(x.clone());
    }
    return x;
  }

  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight) const {
    return rms_norm_rows(x, weight, eps_);
  }

  // A layer's bias on q|k|v and RMSNorms of each head of q and k, in place on T dense rows of q|k|v (as the Python
  // loop adds the bias and normalizes those heads: the same operations, so the same bits).
  void heads_extras(const Layer& w, float* qkv, int64_t T) const {
    const int64_t width = (n_heads_ + 2 * n_kv_) * head_dim_;
    if (w.qkv_bias.defined()) {
      const float* pb = w.qkv_bias.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < width; ++j) qkv[t * width + j] += pb[j];
    }
    if (w.q_norm.defined()) {
      const float* pq = w.q_norm.data_ptr<float>();
      const float* pk = w.k_norm.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkv + t * width;
        rms_norm_into(row, pq, row, n_heads_, head_dim_, eps_);
        rms_norm_into(row + n_heads_ * head_dim_, pk, row + n_heads_ * head_dim_, n_kv_, head_dim_, eps_);
      }
    }
  }

  torch::Tensor mlp(const torch::Tensor& x, const Layer& w) const {
    auto halves = w.gate_up.mm(norm(x, w.post_norm)).chunk(2, -1);
    auto out = w.down.mm((gelu_ ? at::gelu(halves[0], "tanh") : at::silu(halves[0])) * halves[1]);
    return w.mlp_out_norm.defined() ? norm(out, w.mlp_out_norm) : out;
  }

  // `defaults.attention_block_end`: the end of the prompt block holding a position (multiples of fine_, which
  // `defaults.fine_block` gives, within the first chunk, of chunk_ beyond).
  int64_t block_end(int64_t position) const {
    const int64_t step = position < chunk_ ? fine_ : chunk_;
    return position / step * step + step;
  }

  // `exact_attention`: the leading n - solo queries in causal blocks ending at `block_end`, then each of the last
  // `solo` queries alone; a query alone attends through attend_one (as `attention.one_query` does).
  torch::Tensor exact_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                int64_t start, int64_t solo, bool gqa, int64_t window) const {
    const int64_t n = q.size(2), lead = n - solo;
    std::vector<torch::Tensor> parts;
    const bool scored = window > 0 || scale_ > 0;  // a family's own attention (`llama.scored_attention`'s)
    // one query ending at `end`: over the keys its window holds, with the family's scale
    const auto one = [&](const torch::Tensor& qj, int64_t end) {
      const int64_t lo = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      return attend_one(qj, keys.slice(2, lo), values.slice(2, lo), end - lo, scale_);
    };
    for (int64_t a = 0; a < lead;) {
      const int64_t b = std::min(lead, block_end(start + a) - start);
      if (b - a == 1) {
        parts.push_back(one(q.slice(2, a, b), start + b));
      } else if (scored) {
        const int64_t lo = window > 0 ? std::max<int64_t>(0, start + a - window + 1) : 0, end = start + b;
        const auto kpos = at::arange(lo, end, q.options().dtype(at::kLong)).unsqueeze(0);
        const auto qpos = at::arange(start + a, end, q.options().dtype(at::kLong)).unsqueeze(1);
        auto mask = kpos <= qpos;
        if (window > 0) mask = mask & (kpos > qpos - window);
        const auto kt = keys.slice(2, lo, end).to(q.scalar_type());
        const auto vt = values.slice(2, lo, end).to(q.scalar_type());
        const std::optional<double> sc = scale_ > 0 ? std::optional<double>(scale_) : std::nullopt;
        parts.push_back(at::scaled_dot_product_attention(q.slice(2, a, b), kt, vt, mask, 0.0, false, sc, gqa));
      } else {
        auto mask = at::ones({b - a, start + b}, q.options().dtype(at::kBool)).tril(start + a);
        // a float16 cache's keys and values as float32 (exactly), as the Python loop converts them
        const auto kt = keys.slice(2, 0, start + b).to(q.scalar_type());
        const auto vt = values.slice(2, 0, start + b).to(q.scalar_type());
        parts.push_back(at::scaled_dot_product_attention(q.slice(2, a, b), kt, vt, mask, 0.0, false, std::nullopt, gqa));
      }
      a = b;
    }
    for (int64_t j = lead; j < n; ++j) parts.push_back(one(q.slice(2, j, j + 1), start + j + 1));
    return parts.size() == 1 ? parts[0] : at::cat(parts, 2);
  }

  // Whether every new query of every row attends alone (one-token steps; verification passes, whose scored
  // queries attend as one-token steps): then `attention_alone` computes the layer's attention.
  bool all_alone(const std::vector<int64_t>& n_new, const std::vector<int64_t>& scored) const {
    for (size_t b = 0; b < n_new.size(); ++b)
      if (n_new[b] < 1 || (n_new[b] > 1 && !(exact_rows_ && scored[b] >= n_new[b]))) return false;
    return true;
  }

  // `attention` where every query attends alone, on raw buffers: the rotary positions of each new query and key
  // (rope_heads' arithmetic), keys and values written into each row's slot, each query head through attend_head
  // (attend_one's arithmetic), the heads laid out as the output product reads them. The same bits as `attention`
  // without its views, copies and a transpose (tested against the Python loop).
  torch::Tensor attention_alone(int64_t i, const torch::Tensor& h, const torch::Tensor& cos,
                                const torch::Tensor& sin_signed, const std::vector<torch::Tensor>& keys,
                                const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& n_new, const Trees& tails) const {
    const int64_t rows = h.size(0), n = h.size(1), hd = head_dim_, Hq = n_heads_;
    const Layer& w = layers_[i];
    const auto qkv = w.qkv.mm(h).contiguous();  // (rows, n, width), this call's own
    TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.stride(3) == 1 && sin_signed.stride(3) == 1,
                "attention_alone: float32, dense rotary rows");
    heads_extras(w, qkv.data_ptr<float>(), rows * n);
    auto qbuf = at::empty({rows, n, Hq, hd}, qkv.options());
    auto out = rows > 1 ? at::zeros({rows, n, Hq, hd}, qkv.options()) : at::empty({rows, n, Hq, hd}, qkv.options());
    attend_alone(i, qkv.data_ptr<float>(), rows, n, cos, sin_signed, keys, values, starts, n_new, tails,
                 qbuf.data_ptr<float>(), out.data_ptr<float>());
    auto y = w.o.mm(out.view({rows, n, Hq * hd}));
    return w.attn_out_norm.defined() ? norm(y, w.attn_out_norm) : y;
  }

  // The attention of layer i where every new query attends alone, from its qkv rows src (rows, n, width) on raw
  // buffers: the rotary positions of each new query and key (rope_heads' arithmetic) into qd (rows, n, Hq, hd) and
  // each row's slot, values written into the slot, each query head through attend_head (attend_one's arithmetic)
  // into od (rows, n, Hq, hd), laid out as the output product reads them; padding positions of od untouched.
  void attend_alone(int64_t i, const float* src, int64_t rows, int64_t n, const torch::Tensor& cos,
                    const torch::Tensor& sin_signed, const std::vector<torch::Tensor>& keys,
                    const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& n_new, const Trees& tails, float* qd, float* od) const {
    const auto kv_type = keys.empty() ? at::kFloat : keys[0].scalar_type();
    for (int64_t b = 0; b < rows; ++b)
      TORCH_CHECK(keys[b].scalar_type() == kv_type && values[b].scalar_type() == kv_type,
                  "attention_alone: every row's keys and values of one dtype");
    if (kv_type == at::kHalf)
      attend_alone_as<c10::Half>(i, src, rows, n, cos, sin_signed, keys, values, starts, n_new, tails, qd, od);
    else
      attend_alone_as<float>(i, src, rows, n, cos, sin_signed, keys, values, starts, n_new, tails, qd, od);
  }

  template <typename KT>
  void attend_alone_as(int64_t i, const float* src, int64_t rows, int64_t n, const torch::Tensor& cos,
                       const torch::Tensor& sin_signed, const std::vector<torch::Tensor>& keys,
                       const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                       const std::vector<int64_t>& n_new, const Trees& tails, float* qd, float* od) const {
    const int64_t hd = head_dim_, Hq = n_heads_, Hkv = n_kv_, group = Hq / Hkv;
    const int64_t width = (Hq + 2 * Hkv) * hd;
    const float* pc = cos.data_ptr<float>();
    const float* ps = sin_signed.data_ptr<float>();
    const int64_t cb = cos.stride(0), ct = cos.stride(2), sb = sin_signed.stride(0), st = sin_signed.stride(2);
    struct Item {
      const KT* keys;
      const KT* values;
      int64_t kt, vt, kh, vh, end;
      const float* q;
      float* y;
      const int64_t* tail;  // a tree node's ancestors and itself (slot rows), after keys [0, end)
      int64_t n_tail;
      int64_t kv;  // the key head it reads
    };
    std::vector<Item> items;
    items.reserve(static_cast<size_t>(rows * n * Hkv));  // an item a key head's queries
    int64_t longest = 0;
    std::vector<KT*> kds(static_cast<size_t>(rows)), vds(static_cast<size_t>(rows));
    for (int64_t b = 0; b < rows; ++b) {
      TORCH_CHECK(keys[b].stride(3) == 1 && values[b].stride(3) == 1, "attention_alone: dense key rows");
      kds[b] = keys[b].data_ptr<KT>() + i * keys[b].stride(0);  // (L, Hkv, T, hd): this layer's
      vds[b] = values[b].data_ptr<KT>() + i * values[b].stride(0);
    }
    // Each new token's rotary queries and its keys and values written into its row's slot: rows in parallel
    // where there are many (each element's arithmetic is its own; rows write their own slots).
    const auto place = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        KT* kd = kds[b];
        KT* vd = vds[b];
        const int64_t kh = keys[b].stride(1), kt = keys[b].stride(2);
        const int64_t vh = values[b].stride(1), vt = values[b].stride(2);
        for (int64_t t = 0; t < n_new[b]; ++t) {
          const float* x = src + (b * n + t) * width;
          const float* c = pc + b * cb + t * ct;
          const float* sn = ps + b * sb + t * st;
          const int64_t pos = starts[b] + t;
          for (int64_t head = 0; head < Hq; ++head)
            rope_head(x + head * hd, c, sn, hd, qd + ((b * n + t) * Hq + head) * hd);
          float key[256];
          for (int64_t head = 0; head < Hkv; ++head) {
            rope_head(x + (Hq + head) * hd, c, sn, hd, key);
            KT* kr = kd + head * kh + pos * kt;
            KT* vr = vd + head * vh + pos * vt;
            const float* vx = x + (Hq + Hkv + head) * hd;
            for (int64_t d = 0; d < hd; ++d) store_as(key[d], kr + d), store_as(vx[d], vr + d);
          }
        }
      }
    };
    if (rows >= 8)
      at::parallel_for(0, rows, 4, place);
    else
      place(0, rows);
    for (int64_t b = 0; b < rows; ++b) {
      KT* kd = kds[b];
      KT* vd = vds[b];
      const int64_t kh = keys[b].stride(1), kt = keys[b].stride(2);
      const int64_t vh = values[b].stride(1), vt = values[b].stride(2);
      const auto& rt = tails.empty() ? kNoTails : tails[b];  // per new token: its tail (empty: causal)
      int64_t chain = 0;  // a tree row's chain: its new tokens before the first node
      while (chain < static_cast<int64_t>(rt.size()) && rt[chain].empty()) ++chain;
      // The row's queries in the order that keeps each key head's keys and values in the core's caches: by key
      // head, then by new token, then by the query heads that read it (each query's arithmetic is its own, so
      // the order changes no bit; it spares re-reading a layer's whole cache from memory for each scored token).
      for (int64_t kv = 0; kv < Hkv; ++kv)
        for (int64_t t = 0; t < n_new[b]; ++t) {
          const bool node = t < static_cast<int64_t>(rt.size()) && !rt[t].empty();
          const int64_t end = node ? starts[b] + chain : starts[b] + t + 1;  // a node: the cache and the chain,
          // (a window: the keys [lo, end) it holds; trees never meet windows here, see `run`)
          const int64_t lo = layers_[i].window > 0 ? std::max<int64_t>(0, end - layers_[i].window) : 0;
          const int64_t n_tail = node ? static_cast<int64_t>(rt[t].size()) : 0;  // then its tail
          // one item a key head's query heads (consecutive in qd and od): attended together where attend_heads
          // applies, else one by one
          const int64_t head = kv * group;
          items.push_back(Item{kd + lo * kt, vd + lo * vt, kt, vt, kh, vh, end - lo, qd + ((b * n + t) * Hq + head) * hd,
                               od + ((b * n + t) * Hq + head) * hd, node ? rt[t].data() : nullptr, n_tail, kv});
          longest = std::max(longest, end - lo + n_tail);
        }
    }
    const int64_t padded = (longest + 7) / 8 * 8;
    const float scale = scale_ > 0 ? scale_ : 1.0f / std::sqrt(static_cast<float>(hd));
    const auto count = static_cast<int64_t>(items.size());
    const int64_t grain =
        std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * hd * longest * group));
#ifdef __AVX2__
    const bool grouped = (hd == 64 || hd == 128) && group >= 2 && group <= 4;
#else
    const bool grouped = false;
#endif
    at::parallel_for(0, count, grain, [&](int64_t j0, int64_t j1) {
      std::vector<float> p(static_cast<size_t>(padded * group));
      std::vector<float> acc(static_cast<size_t>(hd * group));
      for (int64_t j = j0; j < j1; ++j) {
        const Item& it = items[j];
        const KT* kb = it.keys + it.kv * it.kh;
        const KT* vb = it.values + it.kv * it.vh;
        if (grouped) {
#ifdef __AVX2__
          const float* qs[4];
          float* ys[4];
          for (int64_t g = 0; g < group; ++g) qs[g] = it.q + g * hd, ys[g] = it.y + g * hd;
          attend_group<KT>(group, hd)(qs, kb, it.kt, vb, it.vt, it.end, scale, padded, p.data(), acc.data(), ys,
                                      it.tail, it.n_tail);
#endif
        } else {
          for (int64_t g = 0; g < group; ++g)
            attend_head(it.q + g * hd, kb, it.kt, vb, it.vt, it.end, hd, scale, p.data(), acc.data(), it.y + g * hd,
                        it.tail, it.n_tail);
        }
      }
    });
  }

  torch::Tensor attention(int64_t i, const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                          const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& n_new,
                          const std::vector<int64_t>& scored, const Trees& tails) const {
    if (all_alone(n_new, scored)) return attention_alone(i, h, cos, sin_signed, keys, values, starts, n_new, tails);
    const int64_t rows = h.size(0), n = h.size(1), hd = head_dim_;
    const Layer& w = layers_[i];
    auto qkv = w.qkv.mm(h).contiguous();  // (B, n, width), this call's own
    heads_extras(w, qkv.data_ptr<float>(), rows * n);
    auto heads = qkv.view({rows, n, -1, hd}).transpose(1, 2);  // (B, Hq + 2 Hkv, n, hd)
    auto qk = rope_heads(heads.slice(1, 0, n_heads_ + n_kv_), cos, sin_signed);
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
                                 layer_values.unsqueeze(0), start, solo, gqa, w.window);
      if (rows == 1)
        out = one;
      else
        out.slice(0, b, b + 1).slice(2, 0, count).copy_(one);
    }
    auto y = w.o.mm(out.transpose(1, 2).reshape({rows, n, n_heads_ * hd}));
    return w.attn_out_norm.defined() ? norm(y, w.attn_out_norm) : y;
  }

  int64_t n_heads_, n_kv_, head_dim_;
  double eps_;
  int64_t chunk_, fine_;
  bool exact_rows_;
  std::vector<Layer> layers_;
  bool raw_ = true;  // every layer's products write into buffers (`run_raw`)
  bool gelu_ = false;  // GeGLU rather than SwiGLU
  float scale_ = 0.0f;  // the attention's scale (0: 1/sqrt(head size))
};

}  // namespace

// The layer loop's entry points, added to the extension's module by qgemm.cpp.
void register_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Product>(m, "Product")
      .def(py::init([](int64_t kind, torch::Tensor weight, int64_t fmt, std::vector<torch::Tensor> packed,
                       std::vector<torch::Tensor> scales_zeros, int64_t out_rows, int64_t in_features, bool solo) {
             TORCH_CHECK(kind >= FLOAT && kind <= BLOCKS16, "unknown product kind ", kind);
             TORCH_CHECK(packed.size() == scales_zeros.size(), "one scales_zeros per packed plane");
             TORCH_CHECK(kind != INT4_TORCH || !packed.empty(), "an int4 product needs its planes");
             return Product{kind, weight, fmt, packed, scales_zeros, out_rows, in_features, solo};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("fmt"), py::arg("packed"), py::arg("scales_zeros"),
           py::arg("out_rows"), py::arg("in_features"), py::arg("solo"))
      .def("mm", &Product::mm, "x (..., K) @ W.T -> (..., out_rows), as LlamaWeights._mm computes it");
  m.def("residual_mlps", &residual_mlps, "an eagle's step: x + down(silu(up([x; extra]))), then x + down(silu(up(x)))",
        py::arg("ups"), py::arg("downs"), py::arg("x"), py::arg("extra"));
  m.def("rms_norm", &rms_norm_rows, "RMSNorm of each row of x (..., D) float32, one fixed order a row",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("attend_one", &attend_one, "one query (1, Hq, 1, hd) over the first `end` keys (1, Hkv, T, hd), float32",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("end"), py::arg("scale") = 0.0);
  m.def("rope_heads", &rope_heads, "x * cos + roll(x, hd/2) * sin_signed for heads (B, H, n, hd)", py::arg("heads"),
        py::arg("cos"), py::arg("sin_signed"));
  py::class_<Stack>(m, "Stack")
      .def(py::init<int64_t, int64_t, int64_t, double, int64_t, int64_t, bool>(), py::arg("n_heads"),
           py::arg("n_kv"), py::arg("head_dim"), py::arg("eps"), py::arg("chunk"), py::arg("fine"),
           py::arg("exact_rows"))
      .def("add_layer", &Stack::add_layer)
      .def("set_family", &Stack::set_family, py::arg("gelu"), py::arg("scale"))
      .def("set_extras", &Stack::set_extras, py::arg("qkv_bias"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("attn_out_norm"), py::arg("mlp_out_norm"), py::arg("window"), py::arg("rope"))
      .def("__len__", &Stack::size)
      .def_property_readonly("raw", &Stack::raw,
                             "whether its layers run on buffers where every query attends alone (run_raw)")
      .def("run", &Stack::run, py::arg("x"), py::arg("cos"), py::arg("sin_signed"), py::arg("keys"),
           py::arg("values"), py::arg("starts"), py::arg("n_new"), py::arg("scored"), py::arg("n_layers"),
           py::arg("capture"), py::arg("trees") = std::vector<std::vector<int64_t>>{},
           py::arg("more_cos") = std::vector<torch::Tensor>{}, py::arg("more_sin") = std::vector<torch::Tensor>{},
           py::call_guard<py::gil_scoped_release>());
}
