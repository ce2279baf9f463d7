// The few-row linear layer of decoding on CPU: y = x @ w^T (* scale per output), for fp32, bf16
// and int8 weights. Bound into the extension by fused_ops.cpp (skinny_linear, skinny_linear_simd).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINDSPEED_SKINNY_AVX2 1
#endif

namespace {

// Decoding multiplies one to a few dozen token rows by every weight matrix. MKL/oneDNN's GEMM
// is tuned for large M: at M = 1 it streams an fp32 weight at a third of the memory's read
// bandwidth here, and its int8 weight-only kernel is slower still. This kernel walks each
// weight row once, converts it to fp32 in registers (bf16: shift, int8: widen) and takes its
// dot products with a tile of x rows (AVX2 + FMA, fp32 accumulation); the outputs are split
// over threads. Without AVX2 the Python side never calls it (skinny_linear_simd() is false).

inline float skinny_to_float(float v) { return v; }
inline float skinny_to_float(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float skinny_to_float(int8_t v) { return static_cast<float>(v); }

#ifdef MINDSPEED_SKINNY_AVX2
inline __m256 skinny_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 skinny_load8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 skinny_load8(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
inline float skinny_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The four horizontal sums of a, b, c, d.
inline __m128 skinny_hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

// out[r][m] = dot(x row m, w row r) for an R x MB tile; x rows and w rows are K long.
template <int R, int MB, typename W>
inline void skinny_tile(const float* x, const W* w, int64_t K, float out[R][MB]) {
  int64_t k = 0;
#ifdef MINDSPEED_SKINNY_AVX2
  // A small tile has too few accumulators to hide the FMA latency (one chain per output at
  // one row: a third of the bandwidth for int8 weights): it keeps U chains per output.
  constexpr int U = R * MB >= 4 ? 1 : 4;
  __m256 acc[U][R][MB];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[u][r][m] = _mm256_setzero_ps();
  for (; k + 8 * U <= K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = skinny_load8(w + r * K + k + 8 * u);
      for (int m = 0; m < MB; ++m) {
        __m256 xv = _mm256_loadu_ps(x + m * K + k + 8 * u);
        for (int r = 0; r < R; ++r) acc[u][r][m] = _mm256_fmadd_ps(xv, wv[r], acc[u][r][m]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = skinny_load8(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[0][r][m] = _mm256_fmadd_ps(xv, wv[r], acc[0][r][m]);
    }
  }
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[0][r][m] = _mm256_add_ps(acc[0][r][m], acc[u][r][m]);
  for (int r = 0; r < R; ++r) {
    if constexpr (MB == 4) {  // four sums with three hadds instead of four reductions
      _mm_storeu_ps(out[r], skinny_hsum4(acc[0][r][0], acc[0][r][1], acc[0][r][2], acc[0][r][3]));
    } else {
      for (int m = 0; m < MB; ++m) out[r][m] = skinny_hsum(acc[0][r][m]);
    }
  }
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = 0.f;
#endif
  for (; k < K; ++k) {
    for (int r = 0; r < R; ++r) {
      const float wk = skinny_to_float(w[r * K + k]);
      for (int m = 0; m < MB; ++m) out[r][m] += x[m * K + k] * wk;
    }
  }
}

template <int R, int MB, typename W>
inline void skinny_store_tile(
    const float* x, const W* w, const float* scale, float* y, int64_t N, int64_t K, int64_t n,
    int64_t m) {
  float out[R][MB];
  skinny_tile<R, MB, W>(x + m * K, w + n * K, K, out);
  for (int r = 0; r < R; ++r) {
    const float s = scale != nullptr ? scale[n + r] : 1.f;
    for (int i = 0; i < MB; ++i) y[(m + i) * N + n + r] = out[r][i] * s;
  }
}

// Weight rows n..n+R against every x row, four x rows at a time.
template <int R, typename W>
inline void skinny_rows(
    const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
    int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) skinny_store_tile<R, 4, W>(x, w, scale, y, N, K, n, m);
  switch (M - m) {
    case 3: skinny_store_tile<R, 3, W>(x, w, scale, y, N, K, n, m); break;
    case 2: skinny_store_tile<R, 2, W>(x, w, scale, y, N, K, n, m); break;
    case 1: skinny_store_tile<R, 1, W>(x, w, scale, y, N, K, n, m); break;
    default: break;
  }
}

// R weight rows per tile: one while the memory bounds the kernel (M <= 2; one read stream per
// thread is what the prefetchers serve best), three when the FMAs do (12 accumulators).
template <int R, typename W>
void skinny_kernel(
    const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + R - 1) / R;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t n = t * R;
      if (n + R <= N) {
        skinny_rows<R, W>(x, w, scale, y, M, N, K, n);
      } else {
        for (; n < N; ++n) skinny_rows<1, W>(x, w, scale, y, M, N, K, n);
      }
    }
  });
}

template <typename W>
void skinny_dispatch_rows(
    const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K) {
  if (M <= 2) {
    skinny_kernel<1, W>(x, w, scale, y, M, N, K);
  } else {
    skinny_kernel<3, W>(x, w, scale, y, M, N, K);
  }
}

}  // namespace

namespace mindspeed_ops_cpu {

// x (M, K) fp32 or bf16; w (N, K) fp32, bf16 or int8, contiguous; scale (N,) fp32 or empty.
// Returns (M, N) in x's dtype.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "skinny_linear: x and w must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x and w disagree on in_features");
  TORCH_CHECK(w.is_contiguous(), "skinny_linear: w must be contiguous");
  const bool has_scale = scale.numel() > 0;
  TORCH_CHECK(
      !has_scale || (scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                     scale.numel() == w.size(0)),
      "skinny_linear: scale must be fp32, contiguous, one per output");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const float* sp = has_scale ? scale.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat:
      skinny_dispatch_rows<float>(xp, w.data_ptr<float>(), sp, yp, M, N, K);
      break;
    case at::kBFloat16:
      skinny_dispatch_rows<uint16_t>(
          xp, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), sp, yp, M, N, K);
      break;
    case at::kChar:
      skinny_dispatch_rows<int8_t>(xp, w.data_ptr<int8_t>(), sp, yp, M, N, K);
      break;
    default:
      TORCH_CHECK(false, "skinny_linear: w must be fp32, bf16 or int8");
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

bool skinny_linear_simd() {
#ifdef MINDSPEED_SKINNY_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace mindspeed_ops_cpu
