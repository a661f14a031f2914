// y = x w^T (+ b) for a few rows of x: the verify forward's shape. Built by `make` (see
// few_rows.py, which says why and loads it); torch's own matmul serves every other shape.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

#if defined(__x86_64__)
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m, n] = x[m, :] . w[n, :] (+ b[n]) for MT inputs from m0 and R weight rows from n0.
// Each output is summed in the same order whatever M, MT or R: 8 lanes over k, then the lanes.
template <int MT, int R>
inline void tile(const float* x, const float* w, const float* b, float* y,
                 int64_t m0, int64_t n0, int64_t N, int64_t K) {
  __m256 acc[R][MT];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 16
    for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MT];
#pragma GCC unroll 16
    for (int m = 0; m < MT; m++) xv[m] = _mm256_loadu_ps(x + (m0 + m) * K + k);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m256 wv = _mm256_loadu_ps(w + (n0 + r) * K + k);
#pragma GCC unroll 16
      for (int m = 0; m < MT; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 16
    for (int m = 0; m < MT; m++) {
      float s = hsum(acc[r][m]);
      for (int64_t k = K8; k < K; k++) s += x[(m0 + m) * K + k] * w[(n0 + r) * K + k];
      if (b) s += b[n0 + r];
      y[(m0 + m) * N + n0 + r] = s;
    }
}

template <int MT, int R>
inline void rows(const float* x, const float* w, const float* b, float* y,
                 int64_t m0, int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) tile<MT, R>(x, w, b, y, m0, n, N, K);
  for (; n < n_end; n++) tile<MT, 1>(x, w, b, y, m0, n, N, K);
}

// One panel of weight rows against every input: the panel stays in cache across input chunks.
void panel(const float* x, const float* w, const float* b, float* y,
           int64_t M, int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) rows<3, 4>(x, w, b, y, m, n_begin, n_end, N, K);
  switch (M - m) {
    case 2: rows<2, 6>(x, w, b, y, m, n_begin, n_end, N, K); break;
    case 1: rows<1, 8>(x, w, b, y, m, n_begin, n_end, N, K); break;
    default: break;
  }
}
#endif

bool cpu_supported() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(cpu_supported(), "few_rows: this CPU lacks AVX2/FMA");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "few_rows: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "few_rows: float32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "few_rows: CPU tensors only");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N && bc.scalar_type() == torch::kFloat, "few_rows: bad bias");
    b = bc.data_ptr<float>();
  }
#if defined(__x86_64__)
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t P = 48;  // weight rows per panel: a multiple of 3, 4, 6 and 8
  const int64_t panels = (N + P - 1) / P;
  at::parallel_for(0, panels, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++)
      panel(xp, wp, b, yp, M, p * P, std::min(N, (p + 1) * P), N, K);
  });
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX2 and FMA");
  m.def("linear", &linear, "y = x w^T (+ b) for a few rows of x",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
}
