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
// the kernels: groups of 4 rows (zero rows pad the last), and within a group, block by block,
// the 4 rows' scales (Q4_1: then their minimums) and then the 4 rows' quants, so that a group
// is one sequential stream (read as 4 row streams plus their scales, one core reached about a
// third of the bandwidth).
constexpr int64_t RG = 4;  // rows per group

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
    groups = (N + RG - 1) / RG;
    const float* dp = d.data_ptr<float>();
    if (kind == Q8_0) {
      TORCH_CHECK(qs.scalar_type() == torch::kChar && qs.numel() == N * K, "quant: Q8_0 qs");
      block_bytes = RG * 4 + RG * QK;
      packed = torch::zeros({groups * nb * block_bytes}, torch::kByte);
      uint8_t* out = packed.data_ptr<uint8_t>();
      const int8_t* q = qs.data_ptr<int8_t>();
      for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
          uint8_t* blk = out + ((n / RG) * nb + b) * block_bytes;
          std::memcpy(blk + (n % RG) * 4, dp + n * nb + b, 4);
          std::memcpy(blk + RG * 4 + (n % RG) * QK, q + n * K + b * QK, QK);
        }
    } else {
      TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.numel() == N * K / 2, "quant: Q4_1 qs");
      m = m.contiguous();
      TORCH_CHECK(m.scalar_type() == torch::kFloat && m.numel() == N * nb, "quant: bad m");
      const float* mp = m.data_ptr<float>();
      block_bytes = RG * 8 + RG * QK / 2;
      packed = torch::zeros({groups * nb * block_bytes}, torch::kByte);
      uint8_t* out = packed.data_ptr<uint8_t>();
      const uint8_t* q = qs.data_ptr<uint8_t>();
      for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
          uint8_t* blk = out + ((n / RG) * nb + b) * block_bytes;
          std::memcpy(blk + (n % RG) * 4, dp + n * nb + b, 4);
          std::memcpy(blk + RG * 4 + (n % RG) * 4, mp + n * nb + b, 4);
          std::memcpy(blk + RG * 8 + (n % RG) * (QK / 2), q + n * (K / 2) + b * (QK / 2), QK / 2);
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
};

void quantize_act(const float* x, int64_t M, int64_t K, Act& a) {
  a.M = M;
  a.K = K;
  const int64_t nb = K / QK;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.s.resize(M * nb);
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
    }
  }
}

#if defined(__x86_64__)
constexpr int PREFETCH = 768;  // bytes ahead in a group's stream

// MT activation rows from m0 against weight group g (4 rows), Q8_0: y[m, 4g + r].
template <int MT>
inline void tile_q8(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  const int64_t K = w.K, nb = K / QK;
  __m256 acc[RG][MT];
  for (int r = 0; r < RG; r++)
    for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* blk = w.block(g, 0);
  for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH + 64), _MM_HINT_T0);
    __m256i xv[MT];
    __m256 xd[MT];
    for (int m = 0; m < MT; m++) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * K + b * QK));
      xd[m] = _mm256_set1_ps(a.d[(m0 + m) * nb + b]);
    }
    const float* dw = reinterpret_cast<const float*>(blk);
    for (int r = 0; r < RG; r++) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + RG * 4 + r * QK));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      const __m256 dwv = _mm256_set1_ps(dw[r]);
      for (int m = 0; m < MT; m++) {
        const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[m], wv)), ones);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_mul_ps(dwv, xd[m]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < RG; r++) {
    if (g * RG + r >= w.N) break;
    for (int m = 0; m < MT; m++) y[(m0 + m) * ldy + g * RG + r] = hsum8(acc[r][m]);
  }
}

// The same for Q4_1 weights: y = sum_b d_w d_x (q_w . q_x) [vector lanes] + sum_b m_w s_x
// [one scalar, block order], the two added last.
template <int MT>
inline void tile_q4(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  const int64_t K = w.K, nb = K / QK;
  __m256 acc[RG][MT];
  __m128 mins[MT];  // the 4 rows' minimum terms, one lane each
  for (int m = 0; m < MT; m++) mins[m] = _mm_setzero_ps();
  for (int r = 0; r < RG; r++)
    for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const uint8_t* blk = w.block(g, 0);
  for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    __m256i xv[MT];
    __m256 xd[MT];
    const __m128 mw = _mm_loadu_ps(reinterpret_cast<const float*>(blk + RG * 4));
    for (int m = 0; m < MT; m++) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * K + b * QK));
      xd[m] = _mm256_set1_ps(a.d[(m0 + m) * nb + b]);
      mins[m] = _mm_fmadd_ps(mw, _mm_set1_ps(a.s[(m0 + m) * nb + b]), mins[m]);
    }
    const float* dw = reinterpret_cast<const float*>(blk);
    for (int r = 0; r < RG; r++) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + RG * 8 + r * (QK / 2)));
      const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      const __m256 dwv = _mm256_set1_ps(dw[r]);
      for (int m = 0; m < MT; m++) {
        const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv[m]), ones);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_mul_ps(dwv, xd[m]), acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) {
    alignas(16) float mn[4];
    _mm_store_ps(mn, mins[m]);
    for (int r = 0; r < RG; r++) {
      if (g * RG + r >= w.N) break;
      y[(m0 + m) * ldy + g * RG + r] = hsum8(acc[r][m]) + mn[r];
    }
  }
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

// Weight groups [g_begin, g_end) (F32: rows [4 g_begin, 4 g_end)) against every input row;
// the same tiles whatever M.
template <int MT>
inline void group_tile(const QMat& w, const Act& a, const float* x, float* y, int64_t m0, int64_t g) {
  if (w.kind == Q8_0) {
    tile_q8<MT>(w, a, y, w.N, m0, g);
  } else if (w.kind == Q4_1) {
    tile_q4<MT>(w, a, y, w.N, m0, g);
  } else {
    const int64_t n0 = g * RG;
    if (n0 + RG <= w.N) tile_f32<MT, 4>(w, x, y, w.N, m0, n0);
    else for (int64_t n = n0; n < w.N; n++) tile_f32<MT, 1>(w, x, y, w.N, m0, n);
  }
}

void rows_range(const QMat& w, const Act& a, const float* x, float* y, int64_t M,
                int64_t g_begin, int64_t g_end) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3)
    for (int64_t g = g_begin; g < g_end; g++) group_tile<3>(w, a, x, y, m, g);
  const int64_t rest = M - m;
  for (int64_t g = g_begin; g < g_end; g++) {
    if (rest == 2) group_tile<2>(w, a, x, y, m, g);
    else if (rest == 1) group_tile<1>(w, a, x, y, m, g);
  }
}
#endif

// y [M, N] = x [M, K] w^T, x quantized here (per row) for block kinds.
void matmul(const QMat& w, const float* x, int64_t M, float* y, Act& scratch) {
  TORCH_CHECK(w.N > 0, "quant: an empty weight matrix");
  if (w.kind != F32) quantize_act(x, M, w.K, scratch);
#if defined(__x86_64__)
  constexpr int64_t P = 16;  // weight groups per task
  const int64_t groups = (w.N + RG - 1) / RG, panels = (groups + P - 1) / P;
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
    const int64_t K = embed.K, g = id / RG, r = id % RG;
    if (embed.kind == F32) {
      const float* p = embed.packed.data_ptr<float>() + id * K;
      std::copy(p, p + K, out);
      return;
    }
    for (int64_t b = 0; b < K / QK; b++) {
      const uint8_t* blk = embed.block(g, b);
      const float d = reinterpret_cast<const float*>(blk)[r];
      if (embed.kind == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + RG * 4 + r * QK);
        for (int j = 0; j < QK; j++) out[b * QK + j] = d * static_cast<float>(q[j]);
      } else {
        const float m = reinterpret_cast<const float*>(blk + RG * 4)[r];
        const uint8_t* q = blk + RG * 8 + r * (QK / 2);
        for (int j = 0; j < 16; j++) {
          out[b * QK + j] = d * static_cast<float>(q[j] & 0x0F) + m;
          out[b * QK + j + 16] = d * static_cast<float>(q[j] >> 4) + m;
        }
      }
    }
  }

  // Rotary for one row's heads in place (HF layout: the two halves of each head rotate).
  void rope(float* x, int64_t nheads, int64_t pos) const {
    const int64_t half = head_dim / 2;
    const float* f = inv_freq.data_ptr<float>();
    std::vector<float> c(half), s(half);
    for (int64_t i = 0; i < half; i++) {
      const float a = static_cast<float>(pos) * f[i];
      c[i] = std::cos(a) * rope_scale;
      s[i] = std::sin(a) * rope_scale;
    }
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
    const int64_t group = heads / kv_heads;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; b++) max_ctx = std::max(max_ctx, pasts[b] + offs[b + 1] - offs[b]);
    std::vector<float> score((max_ctx + 7) / 8 * 8), prob((max_ctx + 7) / 8 * 8);
    std::vector<char> vis(max_ctx);

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
      matmul(ly.qkv, xn.data(), T, qkv.data(), scratch);
      const int64_t W = qd + 2 * kvd;
      for (int64_t t = 0; t < T; t++) {
        float* row = qkv.data() + t * W;
        rope(row, heads, pp[t]);
        rope(row + qd, kv_heads, pp[t]);
        const int64_t b = seq_of[t], slot = pasts[b] + (t - offs[b]);
        float* kbuf = keys[b * L + l].data_ptr<float>();
        float* vbuf = values[b * L + l].data_ptr<float>();
        const int64_t cap = keys[b * L + l].size(2);
        for (int64_t g = 0; g < kv_heads; g++) {
          std::copy(row + qd + g * D, row + qd + (g + 1) * D, kbuf + (g * cap + slot) * D);
          std::copy(row + qd + kvd + g * D, row + qd + kvd + (g + 1) * D, vbuf + (g * cap + slot) * D);
        }
      }
      // attention, per row and head, over the row's visible positions in order
      for (int64_t t = 0; t < T; t++) {
        const int64_t b = seq_of[t], i = t - offs[b], past = pasts[b];
        const int64_t ctx = past + (offs[b + 1] - offs[b]);
        const bool* mrow = nullptr;
        if (masks[b].has_value() && masks[b]->defined()) mrow = masks[b]->data_ptr<bool>() + i * ctx;
        int64_t last = 0;
        for (int64_t j = 0; j < ctx; j++) {
          vis[j] = mrow ? mrow[j] : (j <= past + i);
          if (vis[j]) last = j + 1;
        }
        const float* kbuf = keys[b * L + l].data_ptr<float>();
        const float* vbuf = values[b * L + l].data_ptr<float>();
        const int64_t cap = keys[b * L + l].size(2);
        const int64_t padded = (last + 7) / 8 * 8;
        for (int64_t hh = 0; hh < heads; hh++) {
          const int64_t g = hh / group;
          const float* q = qkv.data() + t * W + hh * D;
          float mx = -INFINITY;
          for (int64_t j = 0; j < last; j++) {
            if (!vis[j]) continue;
            const float s = dot(q, kbuf + (g * cap + j) * D, D) * attn_scale;
            score[j] = s;
            mx = std::max(mx, s);
          }
          for (int64_t j = 0; j < padded; j++) if (j >= last || !vis[j]) score[j] = mx;
          const __m256 mxv = _mm256_set1_ps(mx);
          for (int64_t j = 0; j < padded; j += 8)
            _mm256_storeu_ps(prob.data() + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(score.data() + j), mxv)));
          float sum = 0.f;
          float* o = att.data() + t * qd + hh * D;
          std::fill(o, o + D, 0.f);
          for (int64_t j = 0; j < last; j++) {
            if (!vis[j]) continue;
            sum += prob[j];
            const float pj = prob[j];
            const float* v = vbuf + (g * cap + j) * D;
            int64_t d = 0;
            for (; d + 8 <= D; d += 8)
              _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_set1_ps(pj), _mm256_loadu_ps(v + d),
                                                      _mm256_loadu_ps(o + d)));
            for (; d < D; d++) o[d] += pj * v[d];
          }
          const float inv = 1.f / sum;
          for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
      }
      matmul(ly.o, att.data(), T, proj.data(), scratch);
      for (int64_t k = 0; k < T * H; k++) h[k] += proj[k];
      for (int64_t t = 0; t < T; t++)
        rmsnorm(h.data() + t * H, ly.ffn_norm.data_ptr<float>(), eps, H, xn.data() + t * H);
      matmul(ly.gate_up, xn.data(), T, gu.data(), scratch);
      for (int64_t t = 0; t < T; t++)
        silu_mul(gu.data() + t * 2 * I, gu.data() + t * 2 * I + I, I, act.data() + t * I);
      matmul(ly.down, act.data(), T, proj.data(), scratch);
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
    matmul(head, fin.data(), R, logits.data_ptr<float>(), scratch);
    std::vector<torch::Tensor> out{logits};
    if (hidden_out.defined()) out.push_back(hidden_out);
    return out;
#else
    TORCH_CHECK(false, "quant: x86 AVX2 only");
#endif
  }
};

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
}
