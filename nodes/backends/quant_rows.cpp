// The quantized verifier's whole forward for Llama-layout models on a CPU, row-independent by
// construction. Built with few_rows.cpp into one extension (few_rows.py builds, quant_forward.py
// says why and drives it).
//
// Row independence (the lossless promise): every number a row produces is computed by the same
// instructions in the same order whatever else shares the call (how many rows, which sequences,
// which trees), so a token's logits in a k-row verify, a tree or a batch are bit for bit its
// logits in a one-row step:
//  * activations are quantized per row, per block of 32 (Q8_0 / Q8_1 as llama.cpp does), and a
//    block's weights x activations product is an exact integer; blocks are scaled and summed
//    into 8 float lanes in block order, then the lanes are summed in one fixed order;
//  * norms, rotary, SiLU and the softmax are per-row loops of fixed shape; exp is one vector
//    polynomial applied to every element alike (no scalar tail with other rounding);
//  * attention reads the row's visible positions in position order and skips the others.
// Threads split weight rows (outputs), never a sum, so they change nothing either.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <chrono>
#include <atomic>
#include <string>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace quant {

enum Kind : int { Q8_0 = 0, Q4_1 = 1, F32 = 2 };
constexpr int64_t QK = 32;  // weights per block

#if defined(__x86_64__)
inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 floats (Cephes' expf: range reduction by ln 2, a degree-5 polynomial, 2^n by the
// exponent bits). One code path for every element.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i n = _mm256_cvttps_epi32(fx);
  n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

// A weight matrix [N, K] in one of the kinds: Q8_0 (an int8 per weight, a scale d per block of
// 32), Q4_1 (a nibble q per weight, w = d q + m per block; the 16 bytes of a block as GGUF
// stores them: element j in the low nibble of byte j, element j + 16 in its high nibble), or
// F32. Given unpacked (qs [N, K] / [N, K/2], d and m [N, K/32] float32) and packed here for
// the kernels in groups of rows (zero rows pad the last), each group one sequential stream,
// block by block (read as separate row streams, one core reached about a third of the
// bandwidth). Block kinds: 16 rows a group, and a block holds the 16 rows' float16 scales
// (Q4_1: then their minimums), then their quants interleaved 4 bytes a row: bytes 4c..4c+3 of
// every row make the 64 bytes of vector c, so one 512-bit dot instruction (or two 256-bit
// halves) serves the 16 rows (quant_tiles.h). F32: rows as they are, 4 a group.
constexpr int64_t RG = 4;   // F32 rows per group
constexpr int64_t BG = 16;  // block-kind rows per group
inline int64_t group_rows(int kind) { return kind == F32 ? RG : BG; }

// Block scales travel as GGUF keeps them, float16 (exact: every scale comes from a float16
// field, and a float16 converts to float32 exactly); a Q4_1 block is then 20 bytes, not 24.
inline void put_half(uint8_t* p, float v) {
  const uint16_t bits = c10::Half(v).x;
  std::memcpy(p, &bits, 2);
}
inline float get_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct QMat {
  int kind = F32;
  int64_t N = 0, K = 0, groups = 0, block_bytes = 0;
  torch::Tensor packed;  // uint8 (block kinds) or float [N, K] (F32)
  QMat() = default;
  QMat(int kind_, torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t N_, int64_t K_)
      : kind(kind_), N(N_), K(K_) {
    TORCH_CHECK(kind == Q8_0 || kind == Q4_1 || kind == F32, "quant: unknown block kind ", kind);
    qs = qs.contiguous();
    if (kind == F32) {
      TORCH_CHECK(qs.scalar_type() == torch::kFloat && qs.numel() == N * K, "quant: F32 [N, K]");
      packed = qs.view({N, K});
      return;
    }
    d = d.contiguous();
    TORCH_CHECK(K % QK == 0, "quant: K must be a multiple of 32 for block kinds, not ", K);
    TORCH_CHECK(d.scalar_type() == torch::kFloat && d.numel() == N * (K / QK), "quant: bad d");
    const int64_t nb = K / QK;
    groups = (N + BG - 1) / BG;
    const float* dp = d.data_ptr<float>();
    if (kind == Q8_0) {
      TORCH_CHECK(qs.scalar_type() == torch::kChar && qs.numel() == N * K, "quant: Q8_0 qs");
      block_bytes = BG * 2 + BG * QK;
      packed = torch::zeros({groups * nb * block_bytes}, torch::kByte);
      uint8_t* out = packed.data_ptr<uint8_t>();
      const int8_t* q = qs.data_ptr<int8_t>();
      for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
          uint8_t* blk = out + ((n / BG) * nb + b) * block_bytes;
          const int64_t i = n % BG;
          put_half(blk + i * 2, dp[n * nb + b]);
          for (int64_t c = 0; c < QK / 4; c++)
            std::memcpy(blk + BG * 2 + 64 * c + 4 * i, q + n * K + b * QK + 4 * c, 4);
        }
    } else {
      TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.numel() == N * K / 2, "quant: Q4_1 qs");
      m = m.contiguous();
      TORCH_CHECK(m.scalar_type() == torch::kFloat && m.numel() == N * nb, "quant: bad m");
      const float* mp = m.data_ptr<float>();
      block_bytes = BG * 4 + BG * QK / 2;
      packed = torch::zeros({groups * nb * block_bytes}, torch::kByte);
      uint8_t* out = packed.data_ptr<uint8_t>();
      const uint8_t* q = qs.data_ptr<uint8_t>();
      for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
          uint8_t* blk = out + ((n / BG) * nb + b) * block_bytes;
          const int64_t i = n % BG;
          put_half(blk + i * 2, dp[n * nb + b]);
          put_half(blk + BG * 2 + i * 2, mp[n * nb + b]);
          for (int64_t j = 0; j < QK / 8; j++)
            std::memcpy(blk + BG * 4 + 64 * j + 4 * i, q + n * (K / 2) + b * (QK / 2) + 4 * j, 4);
        }
    }
  }
  int64_t nbytes() const { return packed.nbytes(); }
  const uint8_t* block(int64_t g, int64_t b) const {
    return packed.data_ptr<uint8_t>() + (g * (K / QK) + b) * block_bytes;
  }
};

// Activations of M rows, quantized per row per block: q = round(x / d), d = amax / 127, and
// s = d * sum(q) (what a Q4_1 block's minimum meets).
struct Act {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;  // sum of q per block (the Q8_0 tiles' unsigned offset comes back out)
};

void quantize_act(const float* x, int64_t M, int64_t K, Act& a) {
  a.M = M;
  a.K = K;
  const int64_t nb = K / QK;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.s.resize(M * nb);
  a.sum.resize(M * nb);
#if defined(__x86_64__)
  // the scalar loop's arithmetic, 8 lanes at a time: an exact max, the same product and the
  // same round-half-to-even, so the same integers and scales
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < M; r++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + r * K + b * QK;
      __m256 v[4];
      for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const __m256 idv = _mm256_set1_ps(id);
      __m256i q[4];
      for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], idv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        q[i] = _mm256_max_epi32(_mm256_min_epi32(q[i], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
      }
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      const int sum = _mm_cvtsi128_si32(s4);
      const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + r * K + b * QK),
                          _mm256_permutevar8x32_epi32(p16, order));
      a.d[r * nb + b] = d;
      a.s[r * nb + b] = d * static_cast<float>(sum);
      a.sum[r * nb + b] = sum;
    }
  }
#else
  for (int64_t r = 0; r < M; r++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + r * K + b * QK;
      float amax = 0.f;
      for (int i = 0; i < QK; i++) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* qb = a.q.data() + r * K + b * QK;
      for (int i = 0; i < QK; i++) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * id));
        qb[i] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
        sum += qb[i];
      }
      a.d[r * nb + b] = d;
      a.s[r * nb + b] = d * static_cast<float>(sum);
      a.sum[r * nb + b] = sum;
    }
  }
#endif
}

#if defined(__x86_64__)

// The block tiles, compiled twice: for AVX2 and, where the CPU has it, AVX-512 VNNI (one
// instruction for a block's integer dot product, and 32 vector registers for wider tiles).
// Both compute the same integers and the same float operations in the same order, so their
// results are identical, bit for bit; only their speed differs.
namespace avx2 {
// input rows a tile: a half's 4 sums, 4 minimum sums and 4 block sums beside a block's
// unpacked weights in the 16 registers (on a Zen 1 EPYC, 2 rows a tile measured ~5 % slower
// and 6 no faster)
constexpr int MT_MAX = 4;
#include "quant_tiles.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define WIDE
constexpr int MT_MAX = 8;  // 32 registers: 8 weight vectors, 8 sums, 8 minimum sums, 2 scales
#include "quant_tiles.h"
#undef WIDE
}  // namespace vnni
#pragma GCC pop_options

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

// Which tiles run: the CPU's best unless `isa` pinned one (tests compare the two).
std::atomic<int> vnni_on{-1};

bool has_vnni() {
  int v = vnni_on.load(std::memory_order_relaxed);
  if (v < 0) {
    v = cpu_has_vnni() ? 1 : 0;
    vnni_on.store(v);
  }
  return v == 1;
}

// Float32 weights: 8 lanes over k, then the lanes, then the tail (as few_rows.cpp's `tile`).
template <int MT, int R>
inline void tile_f32(const QMat& w, const float* x, float* y, int64_t ldy, int64_t m0, int64_t n0) {
  const int64_t K = w.K, K8 = K & ~int64_t(7);
  const float* wp = w.packed.data_ptr<float>();
  __m256 acc[R][MT];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MT];
    for (int m = 0; m < MT; m++) xv[m] = _mm256_loadu_ps(x + (m0 + m) * K + k);
    for (int r = 0; r < R; r++) {
      const __m256 wv = _mm256_loadu_ps(wp + (n0 + r) * K + k);
      for (int m = 0; m < MT; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MT; m++) {
      float s = hsum8(acc[r][m]);
      for (int64_t k = K8; k < K; k++) s += x[(m0 + m) * K + k] * wp[(n0 + r) * K + k];
      y[(m0 + m) * ldy + n0 + r] = s;
    }
}

// F32 weight rows [RG g_begin, RG g_end) against every input row.
void rows_range_f32(const QMat& w, const float* x, float* y, int64_t M, int64_t g_begin,
                    int64_t g_end) {
  for (int64_t g = g_begin; g < g_end; g++) {
    const int64_t n0 = g * RG;
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) {
      if (n0 + RG <= w.N) tile_f32<3, 4>(w, x, y, w.N, m, n0);
      else for (int64_t n = n0; n < w.N; n++) tile_f32<3, 1>(w, x, y, w.N, m, n);
    }
    for (; m < M; m++) {
      if (n0 + RG <= w.N) tile_f32<1, 4>(w, x, y, w.N, m, n0);
      else for (int64_t n = n0; n < w.N; n++) tile_f32<1, 1>(w, x, y, w.N, m, n);
    }
  }
}

void rows_range(const QMat& w, const Act& a, const float* x, float* y, int64_t M,
                int64_t g_begin, int64_t g_end) {
  if (w.kind == F32) rows_range_f32(w, x, y, M, g_begin, g_end);
  else if (has_vnni()) vnni::rows_range(w, a, y, M, g_begin, g_end);
  else avx2::rows_range(w, a, y, M, g_begin, g_end);
}
#endif

// y [M, N] = x [M, K] w^T, x quantized here (per row) for block kinds.
void matmul(const QMat& w, const float* x, int64_t M, float* y, Act& scratch) {
  TORCH_CHECK(w.N > 0, "quant: an empty weight matrix");
  if (w.kind != F32) quantize_act(x, M, w.K, scratch);
#if defined(__x86_64__)
  const int64_t P = 64 / group_rows(w.kind);  // weight groups per task: 64 rows
  const int64_t groups = (w.N + group_rows(w.kind) - 1) / group_rows(w.kind), panels = (groups + P - 1) / P;
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++)
      rows_range(w, scratch, x, y, M, p * P, std::min(groups, (p + 1) * P));
  });
#else
  TORCH_CHECK(false, "quant: x86 AVX2 only");
#endif
}

#if defined(__x86_64__)
void rmsnorm(const float* x, const float* wt, float eps, int64_t K, float* out) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum8(acc);
  for (int64_t k = K8; k < K; k++) ss += x[k] * x[k];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; k++) out[k] = wt[k] * (x[k] * r);
}

// silu(g) * u over n elements (n a multiple of 8 or with a tail run through a padded vector).
void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  if (i < n) {
    alignas(32) float gb[8] = {0}, ub[8] = {0}, ob[8];
    for (int64_t j = i; j < n; j++) { gb[j - i] = g[j]; ub[j - i] = u[j]; }
    const __m256 gv = _mm256_load_ps(gb);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_store_ps(ob, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_load_ps(ub)));
    for (int64_t j = i; j < n; j++) out[j] = ob[j - i];
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t n8 = n & ~int64_t(7);
  for (int64_t i = 0; i < n8; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (int64_t i = n8; i < n; i++) s += a[i] * b[i];
  return s;
}
#endif

#if defined(__x86_64__)
// Attention scores q . k_j for positions [0, n) of G heads of one kv group (G <= 3), into
// out[h][j] (times `scale`), 4 positions at a time. Each score is computed by the same steps
// wherever it falls (8 lanes over the head width in order, then one fixed tree over the lanes),
// so a position's score depends on neither its neighbours, its index, the other heads of the
// tile nor how many rows share the call: the last 1-3 positions go through the same code from a
// zero-padded copy. Each key is loaded once for the G heads, and the 4 G running sums hide the
// multiply-add latency (one head's 4 sums left it waiting). The head width: a multiple of 8.
template <int G>
inline void scores_tile(const float* const* q, const float* k, int64_t D, float scale,
                        float* const* out, int64_t j) {
  __m256 acc[G][4];
  for (int h = 0; h < G; h++)
    for (int p = 0; p < 4; p++) acc[h][p] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 qc[G];
    for (int h = 0; h < G; h++) qc[h] = _mm256_loadu_ps(q[h] + c);
    for (int p = 0; p < 4; p++) {
      const __m256 kc = _mm256_loadu_ps(k + p * D + c);
      for (int h = 0; h < G; h++) acc[h][p] = _mm256_fmadd_ps(qc[h], kc, acc[h][p]);
    }
  }
  for (int h = 0; h < G; h++) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]),
                                    _mm256_hadd_ps(acc[h][2], acc[h][3]));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storeu_ps(out[h] + j, _mm_mul_ps(s, _mm_set1_ps(scale)));
  }
}

template <int G>
void scores_heads(const float* const* q, const float* k, int64_t n, int64_t D, float scale,
                  float* const* out, float* pad /* 4 x D */) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) scores_tile<G>(q, k + j * D, D, scale, out, j);
  if (j < n) {
    std::fill(pad, pad + 4 * D, 0.f);
    std::copy(k + j * D, k + n * D, pad);
    alignas(16) float tail[G][4];
    float* tails[G];
    for (int h = 0; h < G; h++) tails[h] = tail[h];
    scores_tile<G>(q, pad, D, scale, tails, 0);
    for (int h = 0; h < G; h++)
      for (int64_t i = j; i < n; i++) out[h][i] = tail[h][i - j];
  }
}

// Scores of a kv group's G heads (any number), 3 at a time.
void scores_group(const float* const* q, const float* k, int64_t n, int64_t D, float scale,
                  float* const* out, int64_t G, float* pad) {
  for (int64_t h = 0; h < G; h += 3) {
    switch (std::min<int64_t>(3, G - h)) {
      case 3: scores_heads<3>(q + h, k, n, D, scale, out + h, pad); break;
      case 2: scores_heads<2>(q + h, k, n, D, scale, out + h, pad); break;
      default: scores_heads<1>(q + h, k, n, D, scale, out + h, pad);
    }
  }
}

// The largest of x[0, n) (exact, so the order of comparisons does not matter).
inline float max_of(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = -INFINITY;
  for (int i = 0; i < 8; i++) mx = std::max(mx, lanes[i]);
  for (; j < n; j++) mx = std::max(mx, x[j]);
  return mx;
}
#endif

// Where a forward's time goes (`quant_profile`): off unless asked, then nanoseconds per phase
// summed over forwards. Phases: 0 embed+rope tables, 1 norms, 2 q/k/v products, 3 rotary + cache
// writes, 4 attention, 5 output products, 6 gate/up products, 7 SiLU, 8 down products, 9 LM head.
constexpr int PHASES = 10;
std::atomic<bool> profiling{false};
std::atomic<int64_t> phase_ns[PHASES];

struct PhaseClock {
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(int phase) {
    if (!profiling.load(std::memory_order_relaxed)) return;
    const auto now = std::chrono::steady_clock::now();
    phase_ns[phase].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count());
    last = now;
  }
};

#if defined(__x86_64__)
// o = sum of p_j v_j over the visible positions j < last, in position order; returns the sum of
// their p_j (same order). DV: the head width, so the DV / 8 running sums stay in registers.
template <int DV>
float weigh_values(const float* p, const char* vis, int64_t last, const float* v, float* o) {
  __m256 acc[DV / 8];
  for (int d = 0; d < DV / 8; d++) acc[d] = _mm256_setzero_ps();
  float sum = 0.f;
  for (int64_t j = 0; j < last; j++) {
    if (!vis[j]) continue;
    sum += p[j];
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * DV;
    for (int d = 0; d < DV / 8; d++) acc[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * d), acc[d]);
  }
  for (int d = 0; d < DV / 8; d++) _mm256_storeu_ps(o + 8 * d, acc[d]);
  return sum;
}

// The same sums for G heads of one kv group at once, over 32 of the head's lanes [d0, d0 + 32):
// the group shares each value row's loads and runs its G probability sums side by side. Every
// output element is still the one sequence of fused multiply-adds over visible positions in
// order that `weigh_values` computes for one head, so the bits are the same.
template <int G, bool SUMS>
void weigh_pass(const float* const* p, const char* vis, int64_t last, const float* v, int64_t D,
                int64_t d0, float* const* o, float* sums) {
  __m256 acc[G][4];
  float sm[G];
  for (int h = 0; h < G; h++) {
    sm[h] = 0.f;
    for (int i = 0; i < 4; i++) acc[h][i] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < last; j++) {
    if (!vis[j]) continue;
    const float* vj = v + j * D + d0;
    __m256 vv[4];
    for (int i = 0; i < 4; i++) vv[i] = _mm256_loadu_ps(vj + 8 * i);
    for (int h = 0; h < G; h++) {
      if (SUMS) sm[h] += p[h][j];
      const __m256 pj = _mm256_set1_ps(p[h][j]);
      for (int i = 0; i < 4; i++) acc[h][i] = _mm256_fmadd_ps(pj, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < G; h++) {
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(o[h] + d0 + 8 * i, acc[h][i]);
    if (SUMS) sums[h] = sm[h];
  }
}

// G heads (any number) of one kv group, head width a multiple of 32: 3 heads and 32 lanes a pass.
void weigh_group(const float* const* p, const char* vis, int64_t last, const float* v, int64_t D,
                 int64_t G, float* const* o, float* sums) {
  for (int64_t h = 0; h < G; h += 3) {
    const int64_t n = std::min<int64_t>(3, G - h);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const bool first = d0 == 0;
      if (n == 3) first ? weigh_pass<3, true>(p + h, vis, last, v, D, d0, o + h, sums + h)
                        : weigh_pass<3, false>(p + h, vis, last, v, D, d0, o + h, sums + h);
      else if (n == 2) first ? weigh_pass<2, true>(p + h, vis, last, v, D, d0, o + h, sums + h)
                             : weigh_pass<2, false>(p + h, vis, last, v, D, d0, o + h, sums + h);
      else first ? weigh_pass<1, true>(p + h, vis, last, v, D, d0, o + h, sums + h)
                 : weigh_pass<1, false>(p + h, vis, last, v, D, d0, o + h, sums + h);
    }
  }
}

float weigh_values_any(const float* p, const char* vis, int64_t last, const float* v, int64_t D,
                       float* o) {
  std::fill(o, o + D, 0.f);
  float sum = 0.f;
  for (int64_t j = 0; j < last; j++) {
    if (!vis[j]) continue;
    sum += p[j];
    for (int64_t d = 0; d < D; d++) o[d] += p[j] * v[j * D + d];
  }
  return sum;
}
#endif

struct Layer {
  torch::Tensor attn_norm, ffn_norm;
  QMat qkv, o, gate_up, down;
};

// The model: weights in kernel form, and the forward.
struct Model {
  int64_t heads, kv_heads, head_dim, hidden;
  float eps, attn_scale, rope_scale;
  torch::Tensor inv_freq;  // [head_dim / 2] float32
  QMat embed, head;
  torch::Tensor final_norm;
  std::vector<Layer> layers;
  int64_t intermediate = 0;

  Model(int64_t heads_, int64_t kv_heads_, int64_t head_dim_, int64_t hidden_, double eps_,
        double attn_scale_, double rope_scale_, torch::Tensor inv_freq_)
      : heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), hidden(hidden_),
        eps(static_cast<float>(eps_)), attn_scale(static_cast<float>(attn_scale_)),
        rope_scale(static_cast<float>(rope_scale_)), inv_freq(inv_freq_.contiguous().to(torch::kFloat)) {
    TORCH_CHECK(heads % kv_heads == 0, "quant: heads must be a multiple of kv heads");
    TORCH_CHECK(inv_freq.numel() == head_dim / 2, "quant: inv_freq [head_dim / 2] expected");
  }

  void add_layer(torch::Tensor attn_norm, torch::Tensor ffn_norm, const QMat& qkv, const QMat& o,
                 const QMat& gate_up, const QMat& down) {
    TORCH_CHECK(qkv.K == hidden && qkv.N == (heads + 2 * kv_heads) * head_dim, "quant: qkv shape");
    TORCH_CHECK(o.K == heads * head_dim && o.N == hidden, "quant: o shape");
    TORCH_CHECK(gate_up.K == hidden && gate_up.N % 2 == 0, "quant: gate_up shape");
    TORCH_CHECK(down.N == hidden && down.K == gate_up.N / 2, "quant: down shape");
    intermediate = down.K;
    layers.push_back({attn_norm.contiguous().to(torch::kFloat), ffn_norm.contiguous().to(torch::kFloat),
                      qkv, o, gate_up, down});
  }

  void set_ends(const QMat& embed_, const QMat& head_, torch::Tensor final_norm_) {
    TORCH_CHECK(embed_.K == hidden && head_.K == hidden, "quant: embed/head width");
    embed = embed_;
    head = head_;
    final_norm = final_norm_.contiguous().to(torch::kFloat);
  }

  int64_t nbytes() const {
    int64_t b = embed.nbytes() + (head.packed.data_ptr() == embed.packed.data_ptr() ? 0 : head.nbytes());
    for (const auto& l : layers) b += l.qkv.nbytes() + l.o.nbytes() + l.gate_up.nbytes() + l.down.nbytes();
    return b;
  }

  void embed_row(int64_t id, float* out) const {
    TORCH_CHECK(id >= 0 && id < embed.N, "quant: token id ", id, " out of range");
    const int64_t K = embed.K, g = id / BG, r = id % BG;
    if (embed.kind == F32) {
      const float* p = embed.packed.data_ptr<float>() + id * K;
      std::copy(p, p + K, out);
      return;
    }
    for (int64_t b = 0; b < K / QK; b++) {
      const uint8_t* blk = embed.block(g, b);
      const float d = get_half(blk + r * 2);
      if (embed.kind == Q8_0) {
        for (int j = 0; j < QK; j++) {
          const int8_t q = static_cast<int8_t>(blk[BG * 2 + 64 * (j / 4) + 4 * r + j % 4]);
          out[b * QK + j] = d * static_cast<float>(q);
        }
      } else {
        const float m = get_half(blk + BG * 2 + r * 2);
        for (int j = 0; j < 16; j++) {
          const uint8_t q = blk[BG * 4 + 64 * (j / 4) + 4 * r + j % 4];
          out[b * QK + j] = d * static_cast<float>(q & 0x0F) + m;
          out[b * QK + j + 16] = d * static_cast<float>(q >> 4) + m;
        }
      }
    }
  }

  // cos and sin of each rotary frequency at `pos` (scaled), into c and s [head_dim / 2].
  void rope_table(int64_t pos, float* c, float* s) const {
    const float* f = inv_freq.data_ptr<float>();
    for (int64_t i = 0; i < head_dim / 2; i++) {
      const float a = static_cast<float>(pos) * f[i];
      c[i] = std::cos(a) * rope_scale;
      s[i] = std::sin(a) * rope_scale;
    }
  }

  // Rotary for one row's heads in place (HF layout: the two halves of each head rotate).
  void rope(float* x, int64_t nheads, const float* c, const float* s) const {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < nheads; h++) {
      float* v = x + h * head_dim;
      for (int64_t i = 0; i < half; i++) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }

  // forward: see quant_forward.py's `QuantForward.run` for the arguments.
  std::vector<torch::Tensor> forward(torch::Tensor ids, torch::Tensor pos, std::vector<int64_t> offs,
                                     std::vector<int64_t> pasts, std::vector<torch::Tensor> keys,
                                     std::vector<torch::Tensor> values,
                                     std::vector<c10::optional<torch::Tensor>> masks,
                                     std::vector<int64_t> keep, std::vector<int64_t> capture) {
#if defined(__x86_64__)
    const int64_t T = ids.numel(), B = static_cast<int64_t>(pasts.size());
    const int64_t L = static_cast<int64_t>(layers.size()), H = hidden, D = head_dim;
    TORCH_CHECK(static_cast<int64_t>(offs.size()) == B + 1 && offs[0] == 0 && offs[B] == T,
                "quant: offsets");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == B * L && values.size() == keys.size(),
                "quant: one K and one V buffer per sequence and layer");
    TORCH_CHECK(static_cast<int64_t>(masks.size()) == B, "quant: one mask per sequence");
    auto idc = ids.contiguous().to(torch::kLong);
    auto posc = pos.contiguous().to(torch::kLong);
    const int64_t* idp = idc.data_ptr<int64_t>();
    const int64_t* pp = posc.data_ptr<int64_t>();
    std::vector<int64_t> seq_of(T);
    for (int64_t b = 0; b < B; b++) {
      const int64_t n = offs[b + 1] - offs[b];
      TORCH_CHECK(n >= 0, "quant: offsets must grow");
      for (int64_t t = offs[b]; t < offs[b + 1]; t++) seq_of[t] = b;
      for (int64_t l = 0; l < L; l++) {
        const auto& kb = keys[b * L + l];
        TORCH_CHECK(kb.is_contiguous() && kb.scalar_type() == torch::kFloat && kb.dim() == 4 &&
                        kb.size(1) == kv_heads && kb.size(3) == D && kb.size(2) >= pasts[b] + n,
                    "quant: K/V buffers [1, kv heads, capacity >= past + fed, head dim] float32");
        const auto& vb = values[b * L + l];
        TORCH_CHECK(vb.is_contiguous() && vb.sizes() == kb.sizes() && vb.scalar_type() == torch::kFloat,
                    "quant: V buffer like its K buffer");
      }
      if (masks[b].has_value() && masks[b]->defined()) {
        const auto& mk = *masks[b];
        TORCH_CHECK(mk.scalar_type() == torch::kBool && mk.dim() == 2 && mk.size(0) == n &&
                        mk.size(1) == pasts[b] + n && mk.is_contiguous(),
                    "quant: a mask is bool [fed, past + fed]");
      }
    }
    std::vector<bool> want(L, false);
    for (auto c : capture) {
      TORCH_CHECK(c >= 0 && c < L, "quant: capture layer out of range");
      want[c] = true;
    }
    torch::Tensor hidden_out;
    if (!capture.empty()) hidden_out = torch::empty({T, static_cast<int64_t>(capture.size()), H});

    const int64_t qd = heads * D, kvd = kv_heads * D, I = intermediate;
    std::vector<float> h(T * H), xn(T * H), qkv(T * (qd + 2 * kvd)), att(T * qd), proj(T * H),
        gu(T * 2 * I), act(T * I);
    Act scratch;
    for (int64_t t = 0; t < T; t++) embed_row(idp[t], h.data() + t * H);
    std::vector<float> rc(T * (D / 2)), rs(T * (D / 2));
    for (int64_t t = 0; t < T; t++) rope_table(pp[t], rc.data() + t * (D / 2), rs.data() + t * (D / 2));
    const int64_t group = heads / kv_heads;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; b++) max_ctx = std::max(max_ctx, pasts[b] + offs[b + 1] - offs[b]);
    const int64_t stride = (max_ctx + 7) / 8 * 8;
    std::vector<float> prob(stride * group), sums(group);
    std::vector<const float*> qs(group);
    std::vector<float*> outs(group), pes(group);  // pes[e]: head e's scores, then probabilities
    for (int64_t e = 0; e < group; e++) pes[e] = prob.data() + e * stride;
    std::vector<float> pad(4 * D);
    // each row's visible positions (the same in every layer): its mask row, or causal; `prefix`
    // when they are exactly [0, last), so the largest score needs no per-position test
    std::vector<char> vis_of(T * max_ctx), prefix(T);
    std::vector<int64_t> last_of(T);
    for (int64_t t = 0; t < T; t++) {
      const int64_t b = seq_of[t], i = t - offs[b], past = pasts[b];
      const int64_t ctx = past + (offs[b + 1] - offs[b]);
      const bool* mrow = nullptr;
      if (masks[b].has_value() && masks[b]->defined()) mrow = masks[b]->data_ptr<bool>() + i * ctx;
      char* vis = vis_of.data() + t * max_ctx;
      int64_t last = 0, seen = 0;
      for (int64_t j = 0; j < ctx; j++) {
        vis[j] = mrow ? mrow[j] : (j <= past + i);
        if (vis[j]) last = j + 1, seen++;
      }
      last_of[t] = last;
      prefix[t] = seen == last;
    }

    PhaseClock clock;
    clock.lap(0);
    for (int64_t l = 0; l < L; l++) {
      const Layer& ly = layers[l];
      if (want[l]) {
        const int64_t ci = std::find(capture.begin(), capture.end(), l) - capture.begin();
        auto acc = hidden_out.accessor<float, 3>();
        for (int64_t t = 0; t < T; t++)
          for (int64_t k = 0; k < H; k++) acc[t][ci][k] = h[t * H + k];
      }
      for (int64_t t = 0; t < T; t++)
        rmsnorm(h.data() + t * H, ly.attn_norm.data_ptr<float>(), eps, H, xn.data() + t * H);
      clock.lap(1);
      matmul(ly.qkv, xn.data(), T, qkv.data(), scratch);
      clock.lap(2);
      const int64_t W = qd + 2 * kvd;
      for (int64_t t = 0; t < T; t++) {
        float* row = qkv.data() + t * W;
        rope(row, heads, rc.data() + t * (D / 2), rs.data() + t * (D / 2));
        rope(row + qd, kv_heads, rc.data() + t * (D / 2), rs.data() + t * (D / 2));
        const int64_t b = seq_of[t], slot = pasts[b] + (t - offs[b]);
        float* kbuf = keys[b * L + l].data_ptr<float>();
        float* vbuf = values[b * L + l].data_ptr<float>();
        const int64_t cap = keys[b * L + l].size(2);
        for (int64_t g = 0; g < kv_heads; g++) {
          std::copy(row + qd + g * D, row + qd + (g + 1) * D, kbuf + (g * cap + slot) * D);
          std::copy(row + qd + kvd + g * D, row + qd + kvd + (g + 1) * D, vbuf + (g * cap + slot) * D);
        }
      }
      clock.lap(3);
      // attention, per row and kv group, over the row's visible positions in order
      for (int64_t t = 0; t < T; t++) {
        const int64_t b = seq_of[t], last = last_of[t];
        const char* vis = vis_of.data() + t * max_ctx;
        const float* kbuf = keys[b * L + l].data_ptr<float>();
        const float* vbuf = values[b * L + l].data_ptr<float>();
        const int64_t cap = keys[b * L + l].size(2);
        const int64_t padded = (last + 7) / 8 * 8;
        for (int64_t g = 0; g < kv_heads; g++) {
          for (int64_t e = 0; e < group; e++) {
            const int64_t hh = g * group + e;
            qs[e] = qkv.data() + t * W + hh * D;
            outs[e] = att.data() + t * qd + hh * D;
          }
          if (D % 8 == 0) {
            scores_group(qs.data(), kbuf + g * cap * D, last, D, attn_scale, pes.data(), group,
                         pad.data());
          } else {
            for (int64_t e = 0; e < group; e++)
              for (int64_t j = 0; j < last; j++)
                if (vis[j]) pes[e][j] = dot(qs[e], kbuf + (g * cap + j) * D, D) * attn_scale;
          }
          for (int64_t e = 0; e < group; e++) {
            float* pe = pes[e];
            float mx = -INFINITY;
            if (prefix[t]) {
              mx = max_of(pe, last);
            } else {
              for (int64_t j = 0; j < last; j++)
                if (vis[j]) mx = std::max(mx, pe[j]);
            }
            // hidden and padding positions get e^0 and are skipped when the values are weighed
            for (int64_t j = prefix[t] ? last : 0; j < padded; j++)
              if (j >= last || !vis[j]) pe[j] = mx;
            const __m256 mxv = _mm256_set1_ps(mx);
            for (int64_t j = 0; j < padded; j += 8)
              _mm256_storeu_ps(pe + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(pe + j), mxv)));
          }
          const float* vg = vbuf + g * cap * D;
          if (D % 32 == 0) {
            weigh_group(pes.data(), vis, last, vg, D, group, outs.data(), sums.data());
          } else {
            for (int64_t e = 0; e < group; e++) {
              switch (D) {  // the head widths models use keep their sums in registers
                case 16: sums[e] = weigh_values<16>(pes[e], vis, last, vg, outs[e]); break;
                default: sums[e] = weigh_values_any(pes[e], vis, last, vg, D, outs[e]);
              }
            }
          }
          for (int64_t e = 0; e < group; e++) {
            const float inv = 1.f / sums[e];
            for (int64_t d = 0; d < D; d++) outs[e][d] *= inv;
          }
        }
      }
      clock.lap(4);
      matmul(ly.o, att.data(), T, proj.data(), scratch);
      clock.lap(5);
      for (int64_t k = 0; k < T * H; k++) h[k] += proj[k];
      for (int64_t t = 0; t < T; t++)
        rmsnorm(h.data() + t * H, ly.ffn_norm.data_ptr<float>(), eps, H, xn.data() + t * H);
      clock.lap(1);
      matmul(ly.gate_up, xn.data(), T, gu.data(), scratch);
      clock.lap(6);
      for (int64_t t = 0; t < T; t++)
        silu_mul(gu.data() + t * 2 * I, gu.data() + t * 2 * I + I, I, act.data() + t * I);
      clock.lap(7);
      matmul(ly.down, act.data(), T, proj.data(), scratch);
      clock.lap(8);
      for (int64_t k = 0; k < T * H; k++) h[k] += proj[k];
    }
    std::vector<int64_t> rows = keep;
    if (rows.empty())
      for (int64_t t = 0; t < T; t++) rows.push_back(t);
    const int64_t R = static_cast<int64_t>(rows.size());
    std::vector<float> fin(R * H);
    for (int64_t r = 0; r < R; r++) {
      TORCH_CHECK(rows[r] >= 0 && rows[r] < T, "quant: kept row out of range");
      rmsnorm(h.data() + rows[r] * H, final_norm.data_ptr<float>(), eps, H, fin.data() + r * H);
    }
    auto logits = torch::empty({R, head.N});
    clock.lap(1);
    matmul(head, fin.data(), R, logits.data_ptr<float>(), scratch);
    clock.lap(9);
    std::vector<torch::Tensor> out{logits};
    if (hidden_out.defined()) out.push_back(hidden_out);
    return out;
#else
    TORCH_CHECK(false, "quant: x86 AVX2 only");
#endif
  }
};

// Turn the phase clock on (and zero it) or off; returns the nanoseconds per phase so far.
std::vector<int64_t> profile(bool on) {
  std::vector<int64_t> out;
  for (int i = 0; i < PHASES; i++) out.push_back(phase_ns[i].load());
  for (int i = 0; i < PHASES; i++) phase_ns[i].store(0);
  profiling.store(on);
  return out;
}

// The tiles in use ("avx2" or "avx512-vnni"); `want` "avx2" or "avx512-vnni" pins them, "auto"
// gives the choice back to the CPU check.
std::string isa(const std::string& want) {
#if defined(__x86_64__)
  if (want == "avx2") vnni_on.store(0);
  else if (want == "avx512-vnni") {
    TORCH_CHECK(cpu_has_vnni(), "quant: this CPU has no AVX-512 VNNI");
    vnni_on.store(1);
  } else if (want == "auto") vnni_on.store(-1);
  else TORCH_CHECK(want.empty(), "quant: isa auto, avx2 or avx512-vnni, not ", want);
  return has_vnni() ? "avx512-vnni" : "avx2";
#else
  return "none";
#endif
}

// y [M, N] = x [M, K] w^T through the kernels (tests and benchmarks call one matrix).
torch::Tensor linear(const QMat& w, torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K && x.scalar_type() == torch::kFloat,
              "quant: x [M, K] float32 expected");
  auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), w.N});
  if (xc.size(0) == 0) return y;
  Act scratch;
  matmul(w, xc.data_ptr<float>(), xc.size(0), y.data_ptr<float>(), scratch);
  return y;
}

}  // namespace quant

void register_quant(py::module& m) {
  using namespace quant;
  py::class_<QMat>(m, "QMat")
      .def(py::init<int, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t>(),
           py::arg("kind"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("n"), py::arg("k"))
      .def_readonly("kind", &QMat::kind)
      .def_readonly("n", &QMat::N)
      .def_readonly("k", &QMat::K)
      .def("nbytes", &QMat::nbytes);
  py::class_<Model>(m, "QModel")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, double, torch::Tensor>())
      .def("add_layer", &Model::add_layer)
      .def("set_ends", &Model::set_ends)
      .def("nbytes", &Model::nbytes)
      .def("forward", &Model::forward, py::call_guard<py::gil_scoped_release>());
  m.def("qlinear", &quant::linear, "y = x w^T through the quantized kernels");
  m.def("quant_profile", &quant::profile, "phase clock on/off; nanoseconds per phase so far",
        py::arg("on"));
  m.def("quant_isa", &quant::isa, "the quantized tiles in use; pin avx2 / avx512-vnni / auto",
        py::arg("want") = "");
}
