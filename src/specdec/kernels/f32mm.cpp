// Float32 products of a few activation rows: x (M, K) @ W (N, K).T for M <= F32_ROWS (a decoding step, a verification
// pass of K + 1 tokens, a small batch), the lean Llama path's float32 weights (`specdec.qgemm.f32_mm`).
//
// Why: ATen's float32 matmul on the CPU runs a one-row product as a matrix-vector product at about half the memory's
// speed, and products of 2 or 3 rows on a kernel that costs 2-3.3x the one-row product (SmolLM2's 49,152 x 576 head
// on a 2-core AMD EPYC Zen 4: 10.7 ms for 1 row, 24.1 for 2, 35.5 for 3, 16.9 for 4), so a verification pass of two
// tokens cost 1.8x a decoding step. And its rows are not invariant: row r of a 2-row product differs from the same
// row multiplied alone in the last bits, so a scored draft token is not exactly what a one-token step computes.
//
// Arithmetic (the same on every instruction set, scalar, AVX2 and AVX-512, every M, tiling and thread count): each
// output y[r][n] is computed by one fixed sequence of float32 operations. 16 partial sums s[l] (l = 0..15) start at 0;
// for each chunk of 16 positions k0 = 0, 16, 32, ... in order, s[l] = fma(x[r][k0 + l], w[n][k0 + l], s[l]) (one
// rounding; positions at or past K count as 0, which leaves s[l] as it is); then s[l] + s[l + 8] (l < 8), those
// t[l] + t[l + 4] (l < 4), u[l] + u[l + 2] (l < 2), and v[0] + v[1]. So row r of any product equals the same row
// multiplied alone, bit for bit. Every weight row is read once a product for up to TILE activation rows at a time.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace {

// Products of up to this many rows run here (`f32_rows`); more on ATen's matmul. On a 2-core AMD EPYC Zen 4 this kernel
// beats ATen's up to 64 rows on SmolLM2's three shapes (49,152 x 576: 25.2 ms against 33.3 at 64 rows, 3,072 x 576:
// 1.58 against 1.73) and ATen's blocked GEMM wins from ~96 rows (185 GFLOP/s against this kernel's ~145): 64 covers a
// batch of 8 rows scoring 7 drafted tokens each, or a token tree of 64 nodes, with every row's bits its own.
constexpr int64_t F32_ROWS = 64;
constexpr int64_t L = 16;         // partial sums an output

#if defined(__x86_64__) || defined(_M_X64)
// The next NV weight rows' line at the same offset, asked of the L2 cache while these are read (a hint: past the
// weights' end it reads nothing and never faults). Without it a one-row product of SmolLM2's head read ~11 GB/s.
inline void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
#endif

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------------------- AVX-512
constexpr int NW = 6;    // weight rows a tile (6 x 4: 24 accumulators, 4 activation and 1 weight register of 32;
                         // against 4 x 4, alternated in one process, SmolLM2's float32 pass of 5-17 tokens is 9%
                         // faster and of 1-3 tokens the same)
constexpr int TILE = 4;  // activation rows a tile

inline float reduce(__m512 s) {  // the fixed tree above
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

template <int NV, int MT>
void tile(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  __m512 s[NV][MT];
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < MT; ++r) s[v][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    __m512 xv[MT];
    for (int r = 0; r < MT; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
    for (int v = 0; v < NV; ++v) {
      prefetch(w + (v + NV) * K + k);
      const __m512 wv = _mm512_loadu_ps(w + v * K + k);
      for (int r = 0; r < MT; ++r) s[v][r] = _mm512_fmadd_ps(xv[r], wv, s[v][r]);
    }
  }
  if (k < K) {  // the last chunk, zeros past K
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[MT];
    for (int r = 0; r < MT; ++r) xv[r] = _mm512_maskz_loadu_ps(m, x + r * K + k);
    for (int v = 0; v < NV; ++v) {
      const __m512 wv = _mm512_maskz_loadu_ps(m, w + v * K + k);
      for (int r = 0; r < MT; ++r) s[v][r] = _mm512_fmadd_ps(xv[r], wv, s[v][r]);
    }
  }
  for (int r = 0; r < MT; ++r)
    for (int v = 0; v < NV; ++v) out[r * N + v] = reduce(s[v][r]);
}

#elif defined(__AVX2__) && defined(__FMA__)
// ------------------------------------------------------------------------------------------------------------- AVX2
constexpr int NW = 2;
constexpr int TILE = 2;

inline float reduce(__m256 lo, __m256 hi) {  // lo: s[0..7], hi: s[8..15]; the fixed tree above
  const __m256 t = _mm256_add_ps(lo, hi);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

template <int NV, int MT>
void tile(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  __m256 lo[NV][MT], hi[NV][MT];
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < MT; ++r) lo[v][r] = hi[v][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    for (int v = 0; v < NV; ++v) {
      prefetch(w + (v + NV) * K + k);
      const __m256 wl = _mm256_loadu_ps(w + v * K + k), wh = _mm256_loadu_ps(w + v * K + k + 8);
      for (int r = 0; r < MT; ++r) {
        lo[v][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wl, lo[v][r]);
        hi[v][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), wh, hi[v][r]);
      }
    }
  }
  if (k < K) {  // the last chunk through zero-padded copies
    alignas(32) float xs[TILE][L] = {}, ws[NW][L] = {};
    for (int r = 0; r < MT; ++r) std::memcpy(xs[r], x + r * K + k, sizeof(float) * (K - k));
    for (int v = 0; v < NV; ++v) std::memcpy(ws[v], w + v * K + k, sizeof(float) * (K - k));
    for (int v = 0; v < NV; ++v)
      for (int r = 0; r < MT; ++r) {
        lo[v][r] = _mm256_fmadd_ps(_mm256_load_ps(xs[r]), _mm256_load_ps(ws[v]), lo[v][r]);
        hi[v][r] = _mm256_fmadd_ps(_mm256_load_ps(xs[r] + 8), _mm256_load_ps(ws[v] + 8), hi[v][r]);
      }
  }
  for (int r = 0; r < MT; ++r)
    for (int v = 0; v < NV; ++v) out[r * N + v] = reduce(lo[v][r], hi[v][r]);
}

#else
// ----------------------------------------------------------------------------------------------------------- scalar
constexpr int NW = 1;
constexpr int TILE = 1;

template <int NV, int MT>
void tile(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  for (int r = 0; r < MT; ++r)
    for (int v = 0; v < NV; ++v) {
      float s[L] = {};
      for (int64_t k = 0; k < K; k += L)
        for (int64_t l = 0; l < L && k + l < K; ++l) s[l] = std::fma(x[r * K + k + l], w[v * K + k + l], s[l]);
      for (int l = 0; l < 8; ++l) s[l] = s[l] + s[l + 8];
      for (int l = 0; l < 4; ++l) s[l] = s[l] + s[l + 4];
      for (int l = 0; l < 2; ++l) s[l] = s[l] + s[l + 2];
      out[r * N + v] = s[0] + s[1];
    }
}
#endif

// Activation rows [0, M) (tiles of up to TILE) against NV weight rows from n.
template <int NV>
void rows(const float* x, int64_t M, int64_t K, const float* w, float* out, int64_t N, int64_t n) {
  int64_t r = 0;
  for (; r + TILE <= M; r += TILE) tile<NV, TILE>(x + r * K, K, w + n * K, out + r * N + n, N);
  switch (M - r) {  // the rest, fewer than TILE rows
    case 0: return;
#if defined(__AVX512F__)
    case 3: return tile<NV, 3>(x + r * K, K, w + n * K, out + r * N + n, N);
    case 2: return tile<NV, 2>(x + r * K, K, w + n * K, out + r * N + n, N);
#endif
    default:
      for (; r < M; ++r) tile<NV, 1>(x + r * K, K, w + n * K, out + r * N + n, N);
  }
}

}  // namespace

int64_t f32_rows() { return F32_ROWS; }

// The tile this build multiplies in (weight rows x activation rows), e.g. "6x4": a step's cost depends on it.
std::string f32_tile() { return std::to_string(NW) + "x" + std::to_string(TILE); }

// x (M, K) float32 @ w (N, K).T -> (M, N) float32 with the arithmetic above, for any M (the callers send M <= F32_ROWS:
// beyond, ATen's matmul is faster and invariance is not asked of prompt reading).
torch::Tensor f32_mm(const torch::Tensor& x_in, const torch::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2, "f32_mm: x (M, K) and w (N, K)");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "f32_mm: float32 tensors");
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "f32_mm: CPU tensors");
  TORCH_CHECK(x_in.size(1) == w_in.size(1), "f32_mm: x has ", x_in.size(1), " columns, w ", w_in.size(1));
  const auto x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = (N + NW - 1) / NW;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (NW * K));  // ~64 KB of weights at least
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * NW;
      if (n + NW <= N) {
        rows<NW>(xp, M, K, wp, op, N, n);
      } else {
        for (int64_t m = n; m < N; ++m) rows<1>(xp, M, K, wp, op, N, m);
      }
    }
  });
  return out;
}

// x (..., K) float32 @ w.T: here for up to F32_ROWS rows, ATen's matmul beyond (`specdec.qgemm.f32_mm`; the C++ layer
// loop's float products, so that both loops multiply alike).
torch::Tensor f32_product(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t K = w.size(1);
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  if (M == 0 || M > F32_ROWS || x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat || !x.device().is_cpu() ||
      !w.device().is_cpu())
    return at::matmul(x, w.t());
  auto shape = x.sizes().vec();
  shape.back() = w.size(0);
  return f32_mm(x.reshape({M, K}), w).view(shape);
}

void register_f32(pybind11::module& m) {
  m.def("f32_mm", &f32_mm, "x (M, K) float32 @ w (N, K).T -> (M, N), rows invariant (kernels/f32mm.cpp)");
  m.def("f32_product", &f32_product, "x (..., K) float32 @ w.T: f32_mm up to f32_rows() rows, ATen's matmul beyond");
  m.def("f32_tile", &f32_tile, "the tile this build multiplies in, weight rows x activation rows");
  m.def("f32_rows", &f32_rows, "the most rows f32_product multiplies with f32_mm");
}
