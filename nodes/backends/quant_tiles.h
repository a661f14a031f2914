// The quantized block tiles (Q8_0, Q4_1 weights against Q8 activations), included by
// quant_rows.cpp once per instruction set, inside a namespace that defines MT_MAX and either
// WIDE (AVX-512 VNNI: a group's 16 outputs in one 512-bit register) or not (AVX2: two 256-bit
// halves).
//
// The layout (QMat's packing) puts a group's 16 weight rows side by side: 4 bytes of each row
// (4 consecutive weights of a block) make one 64-byte vector, lane i for row i. An activation
// row's 4 matching bytes are broadcast to every lane, so one dot instruction advances all 16
// outputs' integer block sums at once, and a block's float work (convert, scale, accumulate) is
// one operation for 16 outputs instead of one each.
//
// Each output: a block's integer dot (exact), converted, times round(d_w * d_x), accumulated by
// one fused multiply-add in block order (Q4_1: plus the minimum terms m_w s_x, accumulated the
// same way apart, the two added last). Both instruction sets compute exactly these steps lane by
// lane, so their results are identical; nothing depends on MT or on the tiling.

#ifdef WIDE
// MT activation rows from m0 against weight group g: y[m, 16 g + i].
template <int MT>
inline void tile_q8(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  const int64_t K = w.K, nb = K / QK;
  __m512 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* blk = w.block(g, 0);
  for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
    for (int64_t o = 0; o < w.block_bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * w.block_bytes + o), _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512i wq[8];  // w + 128 as unsigned bytes: dpbusd multiplies unsigned by signed
    for (int c = 0; c < 8; c++)
      wq[c] = _mm512_xor_si512(_mm512_loadu_si512(blk + 32 + 64 * c), bias);
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++) {
      const int64_t row = (m0 + m) * nb + b;
      const int8_t* xq = a.q.data() + (m0 + m) * K + b * QK;
      // two chains of 4 (the dot's latency), added: integers, so the same sum
      __m512i s0 = _mm512_set1_epi32(-128 * a.sum[row]);  // takes the 128 back out, exactly
      __m512i s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 8; c += 2) {
        int32_t x0, x1;
        std::memcpy(&x0, xq + 4 * c, 4);
        std::memcpy(&x1, xq + 4 * c + 4, 4);
        s0 = _mm512_dpbusd_epi32(s0, wq[c], _mm512_set1_epi32(x0));
        s1 = _mm512_dpbusd_epi32(s1, wq[c + 1], _mm512_set1_epi32(x1));
      }
      const __m512i s = _mm512_add_epi32(s0, s1);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[row])), acc[m]);
    }
  }
  for (int m = 0; m < MT; m++) {
    alignas(64) float out[16];
    _mm512_store_ps(out, acc[m]);
    for (int i = 0; i < 16 && g * 16 + i < w.N; i++) y[(m0 + m) * ldy + g * 16 + i] = out[i];
  }
}

template <int MT>
inline void tile_q4(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  const int64_t K = w.K, nb = K / QK;
  __m512 acc[MT], mins[MT];
  for (int m = 0; m < MT; m++) acc[m] = mins[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* blk = w.block(g, 0);
  for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
    for (int64_t o = 0; o < w.block_bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * w.block_bytes + o), _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    __m512i wq[8];  // wq[j]: weights 4j..4j+3 of each row; wq[j + 4]: weights 16 + 4j..
    for (int j = 0; j < 4; j++) {
      const __m512i raw = _mm512_loadu_si512(blk + 64 + 64 * j);
      wq[j] = _mm512_and_si512(raw, low);
      wq[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++) {
      const int64_t row = (m0 + m) * nb + b;
      const int8_t* xq = a.q.data() + (m0 + m) * K + b * QK;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {  // two chains (low and high nibbles), added: the same integers
        int32_t lo4, hi4;
        std::memcpy(&lo4, xq + 4 * j, 4);
        std::memcpy(&hi4, xq + 16 + 4 * j, 4);
        s0 = _mm512_dpbusd_epi32(s0, wq[j], _mm512_set1_epi32(lo4));
        s1 = _mm512_dpbusd_epi32(s1, wq[j + 4], _mm512_set1_epi32(hi4));
      }
      const __m512i s = _mm512_add_epi32(s0, s1);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[row])), acc[m]);
      mins[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[row]), mins[m]);
    }
  }
  for (int m = 0; m < MT; m++) {
    alignas(64) float out[16];
    _mm512_store_ps(out, _mm512_add_ps(acc[m], mins[m]));
    for (int i = 0; i < 16 && g * 16 + i < w.N; i++) y[(m0 + m) * ldy + g * 16 + i] = out[i];
  }
}

#else  // AVX2: the same lanes in two 256-bit halves (rows 0-7, rows 8-15), one half at a time
// Without VNNI a block's dot is maddubs (pairs of byte products to 16 bits) then madd with ones
// (pairs to 32 bits), two multiplies where VNNI has one. Each half of a group runs over all of
// its blocks before the other (its accumulators and a block's unpacked weights then fit the 16
// registers beside MT rows), a block's unpacked weights serve all MT rows, and Q4_1 sums a
// block's eight maddubs in 16 bits before its one madd: nibbles times |x| <= 127 make at most
// 8 x 2 x 15 x 127 = 30480, so no sum wraps and the integers are the same as VNNI's. The float
// steps per output are VNNI's, in the same block order.

inline __m256 half_cvtph(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline void store_half(float* y, int64_t ldy, int64_t m, int64_t g, int h, int64_t N, __m256 v) {
  alignas(32) float out[8];
  _mm256_store_ps(out, v);
  for (int i = 0; i < 8 && g * 16 + 8 * h + i < N; i++) y[m * ldy + g * 16 + 8 * h + i] = out[i];
}

// Block b's integer sums for half h of a Q8_0 group, MT rows from m0, into s.
template <int MT>
inline void q8_half_sums(const uint8_t* blk, int h, const Act& a, int64_t m0, int64_t b, int64_t K,
                         __m256i* s) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; m++) s[m] = _mm256_setzero_si256();
  for (int c = 0; c < 8; c++) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 64 * c + 32 * h));
    const __m256i wabs = _mm256_sign_epi8(wv, wv);
    // |w| times x with w's sign: the same integer products as w times x; |w| <= 128 and
    // |x| <= 127 keep each pair in 16 bits, so each maddubs gets its own madd
    for (int m = 0; m < MT; m++) {
      const __m256i xs = _mm256_sign_epi8(bcast4(a.q.data() + (m0 + m) * K + b * QK + 4 * c), wv);
      s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones));
      asm("" : "+x"(s[m]));  // one chain a row (as tile_q4)
    }
  }
}

// One row: both halves per block (the stream read once, in order) is the faster order here.
template <int MT>
inline void tile_q8_by_block(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  const int64_t K = w.K, nb = K / QK;
  __m256 acc[MT][2];
  for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const uint8_t* blk = w.block(g, 0);
  for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
    for (int64_t o = 0; o < w.block_bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * w.block_bytes + o), _MM_HINT_T0);
    for (int h = 0; h < 2; h++) {
      __m256i s[MT];
      q8_half_sums<MT>(blk, h, a, m0, b, K, s);
      const __m256 dw = half_cvtph(blk + 16 * h);
      for (int m = 0; m < MT; m++)
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]),
                                    _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(m0 + m) * nb + b])), acc[m][h]);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int h = 0; h < 2; h++) store_half(y, ldy, m0 + m, g, h, w.N, acc[m][h]);
}

// More rows: each half over all blocks, so a block's weights serve every row from registers.
template <int MT>
inline void tile_q8(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  if constexpr (MT == 1) {
    tile_q8_by_block<1>(w, a, y, ldy, m0, g);
    return;
  }
  const int64_t K = w.K, nb = K / QK;
  for (int h = 0; h < 2; h++) {
    __m256 acc[MT];
    for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
    const uint8_t* blk = w.block(g, 0);
    for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
      if (h == 0)
        for (int64_t o = 0; o < w.block_bytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * w.block_bytes + o), _MM_HINT_T0);
      __m256i s[MT];
      q8_half_sums<MT>(blk, h, a, m0, b, K, s);
      const __m256 dw = half_cvtph(blk + 16 * h);
      for (int m = 0; m < MT; m++)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]),
                                 _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(m0 + m) * nb + b])), acc[m]);
    }
    for (int m = 0; m < MT; m++) store_half(y, ldy, m0 + m, g, h, w.N, acc[m]);
  }
}

template <int MT>
inline void tile_q4(const QMat& w, const Act& a, float* y, int64_t ldy, int64_t m0, int64_t g) {
  const int64_t K = w.K, nb = K / QK;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; h++) {
    __m256 acc[MT], mins[MT];
    for (int m = 0; m < MT; m++) acc[m] = mins[m] = _mm256_setzero_ps();
    const uint8_t* blk = w.block(g, 0);
    for (int64_t b = 0; b < nb; b++, blk += w.block_bytes) {
      if (h == 0)
        for (int64_t o = 0; o < w.block_bytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * w.block_bytes + o), _MM_HINT_T0);
      __m256i s[MT];  // 16-bit sums of the block's byte products
      for (int m = 0; m < MT; m++) s[m] = _mm256_setzero_si256();
      for (int j = 0; j < 4; j++) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 64 * j + 32 * h));
        const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int m = 0; m < MT; m++) {
          const int8_t* xq = a.q.data() + (m0 + m) * K + b * QK;
          s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(lo, bcast4(xq + 4 * j)));
          s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * j)));
          asm("" : "+x"(s[m]));  // keep each row's sum one chain: GCC's reassociation of the
                                 // adds into a tree held every product at once and spilled
        }
      }
      const __m256 dw = half_cvtph(blk + 16 * h), mw = half_cvtph(blk + 32 + 16 * h);
      for (int m = 0; m < MT; m++) {
        const int64_t row = (m0 + m) * nb + b;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[m], ones)),
                                 _mm256_mul_ps(dw, _mm256_set1_ps(a.d[row])), acc[m]);
        mins[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[row]), mins[m]);
      }
    }
    for (int m = 0; m < MT; m++) store_half(y, ldy, m0 + m, g, h, w.N, _mm256_add_ps(acc[m], mins[m]));
  }
}
#endif

template <int MT>
inline void group(const QMat& w, const Act& a, float* y, int64_t m0, int64_t g) {
  if (w.kind == Q8_0) tile_q8<MT>(w, a, y, w.N, m0, g);
  else tile_q4<MT>(w, a, y, w.N, m0, g);
}

// Weight groups [g_begin, g_end) against every input row: per group, MT_MAX rows a tile, then
// the rest in one smaller tile (the group's stream stays in cache between tiles).
inline void rows_range(const QMat& w, const Act& a, float* y, int64_t M, int64_t g_begin,
                       int64_t g_end) {
  for (int64_t g = g_begin; g < g_end; g++) {
    int64_t m = 0;
    for (; m + MT_MAX <= M; m += MT_MAX) group<MT_MAX>(w, a, y, m, g);
    switch (M - m) {
      case 0: break;
      case 1: group<1>(w, a, y, m, g); break;
      case 2: group<2 < MT_MAX ? 2 : 1>(w, a, y, m, g); break;
      case 3: group<3 < MT_MAX ? 3 : 1>(w, a, y, m, g); break;
      case 4: group<4 < MT_MAX ? 4 : 1>(w, a, y, m, g); break;
      case 5: group<5 < MT_MAX ? 5 : 1>(w, a, y, m, g); break;
      case 6: group<6 < MT_MAX ? 6 : 1>(w, a, y, m, g); break;
      default: group<7 < MT_MAX ? 7 : 1>(w, a, y, m, g); break;
    }
  }
}
