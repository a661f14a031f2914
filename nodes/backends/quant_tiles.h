// The quantized block tiles (Q8_0, Q4_1 weights against Q8 activations), included by
// quant_rows.cpp once per instruction set, inside a namespace that defines QDOT (8 int32 lanes,
// lane i the sum of products of bytes 4i..4i+3: the same integers either way) and MT_MAX.
// Each output: a block's integer dot, scaled by d_w d_x, added into 8 float lanes in block
// order, the lanes summed last in one fixed order (Q4_1: plus the minimum terms, one scalar
// per row in block order, added at the very end). Nothing depends on MT or on the tiling.

// MT activation rows from m0 against weight group g (4 rows), Q8_0: y[m, 4g + r].
template <int MT>
inline void tile_q8(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  const int64_t K = w.K, nb = K / QK;
  __m256 acc[RG][MT];
  for (int r = 0; r < RG; r++)
    for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
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
    const __m256 dw4 = _mm256_castps128_ps256(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk))));
    for (int r = 0; r < RG; r++) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + RG * 2 + r * QK));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      const __m256 dwv = _mm256_permutevar8x32_ps(dw4, _mm256_set1_epi32(r));
      for (int m = 0; m < MT; m++) {
        const __m256i p32 = QDOT(aw, _mm256_sign_epi8(xv[m], wv));
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
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* blk = w.block(g, 0);
  for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    __m256i xv[MT];
    __m256 xd[MT];
    const __m128 mw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + RG * 2)));
    for (int m = 0; m < MT; m++) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * K + b * QK));
      xd[m] = _mm256_set1_ps(a.d[(m0 + m) * nb + b]);
      mins[m] = _mm_fmadd_ps(mw, _mm_set1_ps(a.s[(m0 + m) * nb + b]), mins[m]);
    }
    const __m256 dw4 = _mm256_castps128_ps256(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk))));
    for (int r = 0; r < RG; r++) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + RG * 4 + r * (QK / 2)));
      const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      const __m256 dwv = _mm256_permutevar8x32_ps(dw4, _mm256_set1_epi32(r));
      for (int m = 0; m < MT; m++) {
        const __m256i p32 = QDOT(wv, xv[m]);
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

// Weight groups [g_begin, g_end) against every input row, MT_MAX rows a tile and the rest.
template <int MT>
inline void group(const QMat& w, const Act& a, float* y, int64_t m0, int64_t g) {
  if (w.kind == Q8_0) tile_q8<MT>(w, a, y, w.N, m0, g);
  else tile_q4<MT>(w, a, y, w.N, m0, g);
}

inline void rows_range(const QMat& w, const Act& a, float* y, int64_t M, int64_t g_begin,
                       int64_t g_end) {
  int64_t m = 0;
  for (; m + MT_MAX <= M; m += MT_MAX)
    for (int64_t g = g_begin; g < g_end; g++) group<MT_MAX>(w, a, y, m, g);
  const int64_t rest = M - m;
  for (int64_t g = g_begin; g < g_end; g++) {
    if (rest == 3) group<3 < MT_MAX ? 3 : 1>(w, a, y, m, g);
    if (rest == 2) group<2 < MT_MAX ? 2 : 1>(w, a, y, m, g);
    if (rest == 1) group<1>(w, a, y, m, g);
  }
}
