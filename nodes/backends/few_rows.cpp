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

// Weight-only int8 (W8A32): y[m, n] = s[n] * (x[m, :] . q[n, :]) (+ b[n]) with int8 weights q
// and a float32 scale per weight row. The weights come packed (few_rows.py, `pack_w8`): groups
// of 8 rows, and within a group, for each 8 columns, the 8 rows' 8 bytes one after another, so
// that a group is read as one sequential stream, one cache line per 8 columns (zero padded to
// whole groups and whole 8-column blocks). Read row by row (8 streams of 8 bytes a step) a
// one-row product reached ~3 GB/s here; packed and prefetched, ~15 GB/s.
// Each 8 int8 weights are sign-extended and converted to float32 once per tile, then multiplied
// into every input of the tile: float32 products and sums (a product of |q| <= 127 and a
// float32 is exact), in one fixed order whatever M or the tiling (8 lanes over k, then the
// lanes, then the tail columns, then the scale), so a row's result never depends on the rows
// beside it.
inline __m256 load_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

constexpr int64_t PREFETCH = 1024;  // bytes ahead of the packed weight stream

// MT inputs from m0 against R rows of group g from row `r0` in the group (R + r0 <= 8).
template <int MT, int R>
inline void tile_q8(const float* x, const int8_t* q, const float* s, const float* b, float* y,
                    int64_t m0, int64_t g, int r0, int64_t N, int64_t K) {
  const int64_t K8 = K & ~int64_t(7), KB = (K + 7) / 8;  // whole blocks; blocks stored
  const int8_t* qg = q + g * KB * 64;
  __m256 acc[R][MT];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 16
    for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    const int8_t* qk = qg + k * 8 + r0 * 8;
    _mm_prefetch(reinterpret_cast<const char*>(qk + PREFETCH), _MM_HINT_T0);
    __m256 xv[MT];
#pragma GCC unroll 16
    for (int m = 0; m < MT; m++) xv[m] = _mm256_loadu_ps(x + (m0 + m) * K + k);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m256 wv = load_q8(qk + r * 8);
#pragma GCC unroll 16
      for (int m = 0; m < MT; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    const int64_t n = g * 8 + r0 + r;
    if (n >= N) break;  // padding rows of the last group
#pragma GCC unroll 16
    for (int m = 0; m < MT; m++) {
      float sum = hsum(acc[r][m]);
      const int8_t* tail = qg + K8 * 8 + (r0 + r) * 8;
      for (int64_t k = K8; k < K; k++)
        sum += x[(m0 + m) * K + k] * static_cast<float>(tail[k - K8]);
      sum *= s[n];
      if (b) sum += b[n];
      y[(m0 + m) * N + n] = sum;
    }
  }
}

// One panel of groups against every input: the panel stays in cache across input chunks.
void panel_q8(const float* x, const int8_t* q, const float* s, const float* b, float* y,
              int64_t M, int64_t g_begin, int64_t g_end, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3)
    for (int64_t g = g_begin; g < g_end; g++) {
      tile_q8<3, 4>(x, q, s, b, y, m, g, 0, N, K);
      tile_q8<3, 4>(x, q, s, b, y, m, g, 4, N, K);
    }
  switch (M - m) {
    case 2:
      for (int64_t g = g_begin; g < g_end; g++) {
        tile_q8<2, 4>(x, q, s, b, y, m, g, 0, N, K);
        tile_q8<2, 4>(x, q, s, b, y, m, g, 4, N, K);
      }
      break;
    case 1:
      for (int64_t g = g_begin; g < g_end; g++) tile_q8<1, 8>(x, q, s, b, y, m, g, 0, N, K);
      break;
    default: break;
  }
}
#endif

bool cpu_supported() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
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

torch::Tensor linear_w8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(cpu_supported(), "few_rows: this CPU lacks AVX2/FMA");
  TORCH_CHECK(x.dim() == 2, "few_rows: x [M, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && scale.scalar_type() == torch::kFloat,
              "few_rows: float32 inputs and scales only");
  TORCH_CHECK(q.scalar_type() == torch::kChar, "few_rows: int8 weights only");
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(),
              "few_rows: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = scale.numel();
  TORCH_CHECK(scale.dim() == 1 && q.dim() == 4 && q.size(0) == (N + 7) / 8 &&
                  q.size(1) == (K + 7) / 8 && q.size(2) == 8 && q.size(3) == 8,
              "few_rows: packed int8 weights [ceil(N/8), ceil(K/8), 8, 8] for x [M, K] and "
              "scale [N] expected");
  auto xc = x.contiguous();
  auto qc = q.contiguous();
  auto sc = scale.contiguous();
  auto y = torch::empty({M, N}, xc.options());
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N && bc.scalar_type() == torch::kFloat && bc.device().is_cpu(),
                "few_rows: bad bias");
    b = bc.data_ptr<float>();
  }
#if defined(__x86_64__)
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t P = 6;  // groups of 8 rows per panel: 48 rows, as above
  const int64_t groups = (N + 7) / 8, panels = (groups + P - 1) / P;
  if (M > 0 && N > 0)
    at::parallel_for(0, panels, 8, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; p++)
        panel_q8(xp, qp, sp, b, yp, M, p * P, std::min(groups, (p + 1) * P), N, K);
    });
#endif
  return y;
}

}  // namespace

void register_quant(pybind11::module& m);  // quant_rows.cpp: the quantized verifier

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_quant(m);
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX2 and FMA");
  m.def("linear", &linear, "y = x w^T (+ b) for a few rows of x",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_w8", &linear_w8,
        "y = (x q^T) * scale (+ b): packed int8 weights q, a float32 scale per weight row",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias") = py::none());
}
