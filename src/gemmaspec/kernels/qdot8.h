/*
 * Products with int8 activations (opt-in: gemmaspec.kernels.set_act_quant("q8_0"), --act-quant q8_0),
 * included by qmatmul.c after its block unpackers.
 *
 * llama.cpp's CPU scheme (ggml-cpu's vec_dot_q*_q8_0): each row of x is quantized per 32 values to
 * int8 with one fp32 step (Q8_0 activations), and a weight block meets it in an integer dot product
 * (AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw, ARM sdot), which is exact. This does less work per weight
 * than fp32 activations (the all-Q4_0 model's products are compute-bound with fp32 activations on a
 * Zen 4 core) at the cost of new numerics: x is rounded to 8 bits per 32-value block, so results differ
 * from the fp32 path and from the transformers reference by the rounding of x (relative ~1e-2 per
 * product), as llama.cpp's do.
 *
 * Activations: for row m, block b of 32 values: amax = max |x|, d = amax / 127, id = d ? 1 / d : 0,
 * aq_j = round-to-nearest-even(x_j * id) (int8, |aq_j| <= 127), da[m, b] = d (fp32).
 * Weights: the signed levels q of qmatmul.c's header (Q4_0 nibble - 8, Q8_0 q, Q5_0 ..., Q4_K nibble,
 * Q6_K ... - 32, FMT_I8 q with G = 32) and their fp32 scales (Q6_K: two per 32 values).
 *
 * Order of operations per (m, n), the same on every path and for every M (so batch-invariant, and the
 * same bits on AVX-512, AVX2, NEON and portable C): 8 lanes; lane l (0..7) of block b takes the exact
 * integer p = sum of q_j * aq_j over j = 4l .. 4l+3 and adds fma(float(p), scale_l * da[m, b], acc_l)
 * (scale_l: the block's scale; Q6_K: that of values 0..15 for l < 4, of 16..31 for l >= 4), blocks
 * ascending, even blocks into one set of 8 lane accumulators and odd ones into another (two
 * independent chains, so one weight row streams without waiting on the FMA latency); the two sets are
 * added lane by lane (even + odd) and the 8 lanes reduced as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
 * (l3 + l7)) (reduce8);
 * the offset term (Q4_K mins, FMT_I8 offsets) is qmatmul.c's, over the fp32 block sums of x, added
 * last. The SIMD paths compute p as sum (q + c) * aq - c * sum aq with unsigned levels q + c where the
 * instruction needs them (c = 8, 16, 32, 128): the same integer.
 */

#define Q8_ROWS 4 /* rows of x per pass (accumulators in registers) */

/* Whether segment format fmt (with int8 group G) has an int8-activation path: every stored format and
 * FMT_I8 with 32-value groups (not the fp32 layout of r8.h). */
static inline int q8_supported(const int fmt, int G) { return !fmt_r8(fmt) && (fmt != FMT_I8 || G == 32); }

/* The integer lane sums of block b: p[l] = sum_{j=4l}^{4l+3} q[j] * a[j]; the block's per-lane scales
 * into sc[0] (values 0..15) and sc[1] (16..31). Portable C: the reference. */
static inline void q8_block_scalar(const int fmt, const void *w, const float *s, int b, const int8_t *a,
                                   int32_t p[8], float sc[2]) {
    int8_t q[32];
    if (fmt == FMT_Q6_K) {
        int8_t q2[32];
        levels_scalar(fmt, w, s, 2 * b, 16, q, &sc[0]);
        levels_scalar(fmt, w, s, 2 * b + 1, 16, q2, &sc[1]);
        memcpy(q + 16, q2, 16);
    } else {
        levels_scalar(fmt, w, s, b, 32, q, &sc[0]);
        sc[1] = sc[0];
    }
    for (int l = 0; l < 8; l++) {
        int32_t t = 0;
        for (int j = 4 * l; j < 4 * l + 4; j++) t += (int32_t)q[j] * (int32_t)a[j];
        p[l] = t;
    }
}

static inline float reduce8_scalar(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Portable path (also NEON's): res[r * RS + m] for R weight rows and M <= Q8_ROWS rows of x. */
static inline __attribute__((always_inline)) void tile_q8_portable(const int fmt, const void *const wr[],
                                                                   const float *const sr[], const int R, int K,
                                                                   const int8_t *aq, const float *da, const int M,
                                                                   float *res) {
    const int nb = K / 32;
    for (int r = 0; r < R; r++) {
        float acc[Q8_ROWS][2][8] = {{{0}}}; /* [m][block parity][lane] */
        for (int b = 0; b < nb; b++)
            for (int m = 0; m < M; m++) {
                int32_t p[8];
                float sc[2];
                q8_block_scalar(fmt, wr[r], sr[r], b, aq + (long)m * K + 32 * b, p, sc);
                const float d = da[(long)m * nb + b];
                const float s0 = sc[0] * d, s1 = sc[1] * d;
                float *a = acc[m][b & 1];
                for (int l = 0; l < 8; l++) a[l] = fmaf((float)p[l], l < 4 ? s0 : s1, a[l]);
            }
        for (int m = 0; m < M; m++) {
            float t[8];
            for (int l = 0; l < 8; l++) t[l] = acc[m][0][l] + acc[m][1][l];
            res[r * RS + m] = reduce8_scalar(t);
        }
    }
}

#if defined(GS_AVX512) || defined(GS_AVX2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#endif

/* The level offset c the SIMD levels carry (unsigned bytes q + c); 0: signed levels (Q8_0 / FMT_I8
 * without VNNI, multiplied by the sign trick). */
static inline int q8_offset(const int fmt) {
    switch (fmt) {
        case FMT_Q4_0: return 8;
        case FMT_Q5_0: return 16;
        case FMT_Q6_K: return 32;
        case FMT_Q4_K: return 0;
#ifdef Q8_VNNI
        default: return 128;
#else
        default: return 0;
#endif
    }
}

/* init + lane sums of u (unsigned bytes) * a (signed bytes), 4 bytes per lane; exact (u <= 63 without
 * VNNI, so vpmaddubsw's int16 pairs cannot saturate). */
static inline __m256i q8_dot_u(__m256i init, __m256i u, __m256i a) {
#ifdef Q8_VNNI
    return _mm256_dpbusd_epi32(init, u, a);
#else
    return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}

/* Block b's 32 levels in value order as bytes: q + q8_offset(fmt) (unsigned), or signed q where the
 * offset is 0 for Q8_0 / FMT_I8. */
static inline __attribute__((always_inline)) __m256i q8_levels(const int fmt, const void *wv, int b) {
    const uint8_t *w = (const uint8_t *)wv;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    switch (fmt) {
        case FMT_Q4_0: {
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + (long)b * Q4_0_BYTES + 2));
            return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);
        }
        case FMT_Q5_0: {
            const uint8_t *blk = w + (long)b * Q5_0_BYTES;
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 6));
            const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);
#if defined(GS_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__)
            return _mm256_mask_add_epi8(lo, (__mmask32)qh, lo, _mm256_set1_epi8(16));
#else
            return _mm256_or_si256(lo, _mm256_set_m128i(bits_to_0x10(qh >> 16), bits_to_0x10(qh & 0xFFFF)));
#endif
        }
        case FMT_Q4_K: {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (long)(b >> 3) * Q4_K_BYTES + 16 + ((b & 7) >> 1) * 32));
            return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (b & 1))), m4);
        }
        case FMT_Q6_K: {
            const uint8_t *blk = w + (long)(b >> 3) * Q6_K_BYTES;
            const int h = (b & 7) >> 2, i = b & 3;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + (i & 1) * 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
            const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (i >> 1))), m4);
            const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), _mm256_set1_epi8(3));
            return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        }
        default: { /* FMT_Q8_0, FMT_I8 (G = 32) */
            const __m256i v = _mm256_loadu_si256(
                (const __m256i *)(fmt == FMT_Q8_0 ? w + (long)b * Q8_0_BYTES + 2 : w + (long)b * 32));
            return q8_offset(fmt) ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
        }
    }
}

/* init + lane sums of the block's levels times a (exact integers; see q8_levels). */
static inline __m256i q8_dot(const int fmt, __m256i init, __m256i lv, __m256i a) {
    if (q8_offset(fmt) == 0 && (fmt == FMT_Q8_0 || fmt == FMT_I8)) /* signed levels: |q| * (a * sign q) */
        return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lv, lv),
                                                                             _mm256_sign_epi8(a, lv)),
                                                        _mm256_set1_epi16(1)));
    return q8_dot_u(init, lv, a);
}

/* The block's per-lane scales (8 lanes): the same fp32 values as q8_block_scalar's sc. */
static inline __attribute__((always_inline)) __m256 q8_scales(const int fmt, const void *w, const float *s, int b,
                                                               const float *ks) {
    switch (fmt) {
        case FMT_Q4_K: return _mm256_set1_ps(ks[b & 7]);
        case FMT_Q6_K: return _mm256_set_m128(_mm_set1_ps(ks[2 * (b & 7) + 1]), _mm_set1_ps(ks[2 * (b & 7)]));
        case FMT_I8: return _mm256_set1_ps(s[b]);
        default: return _mm256_set1_ps(stored_scale(fmt, (const uint8_t *)w, b));
    }
}

static inline float reduce8(__m256 a) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l + l+4 */
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));                                 /* (0+2), (1+3) */
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

/* Block b of R weight rows against M rows of x, accumulated into acc (one parity's accumulators). */
static inline __attribute__((always_inline)) void q8_step(const int fmt, const void *const wr[],
                                                          const float *const sr[], const int R, int K,
                                                          const int8_t *aq, const float *da, const int M, int b,
                                                          __m256 acc[NR][Q8_ROWS], float ks[NR][16]) {
    const int nb = K / 32, c = q8_offset(fmt);
    prefetch_rows(fmt, wr, sr, R, fmt == FMT_Q6_K ? 2 * b : b, fmt == FMT_Q6_K ? 16 : 32);
    if ((fmt == FMT_Q4_K || fmt == FMT_Q6_K) && (b & 7) == 0)
        for (int r = 0; r < R; r++) super_scales(fmt, (const uint8_t *)wr[r], b >> 3, ks[r]);
    __m256i a[Q8_ROWS], init[Q8_ROWS];
    __m256 d[Q8_ROWS];
    for (int m = 0; m < M; m++) {
        a[m] = _mm256_loadu_si256((const __m256i *)(aq + (long)m * K + 32 * b));
        init[m] = c ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                       q8_dot_u(_mm256_setzero_si256(), _mm256_set1_epi8((char)c), a[m]))
                    : _mm256_setzero_si256();
        d[m] = _mm256_set1_ps(da[(long)m * nb + b]);
    }
    for (int r = 0; r < R; r++) {
        const __m256i lv = q8_levels(fmt, wr[r], b);
        const __m256 sc = q8_scales(fmt, wr[r], sr[r], b, ks[r]);
        for (int m = 0; m < M; m++)
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_dot(fmt, init[m], lv, a[m])), _mm256_mul_ps(sc, d[m]),
                                        acc[r][m]);
    }
}

static inline __attribute__((always_inline)) void tile_q8(const int fmt, const void *const wr[],
                                                          const float *const sr[], const int R, int K,
                                                          const int8_t *aq, const float *da, const int M,
                                                          float *res) {
    const int nb = K / 32;
    __m256 even[NR][Q8_ROWS], odd[NR][Q8_ROWS];
    float ks[NR][16];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) even[r][m] = odd[r][m] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        q8_step(fmt, wr, sr, R, K, aq, da, M, b, even, ks);
        q8_step(fmt, wr, sr, R, K, aq, da, M, b + 1, odd, ks);
    }
    if (b < nb) q8_step(fmt, wr, sr, R, K, aq, da, M, b, even, ks);
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) res[r * RS + m] = reduce8(_mm256_add_ps(even[r][m], odd[r][m]));
}
#define TILE_Q8 tile_q8
#elif defined(GS_NEON)
/* Lane sums of 16 signed levels times 16 activations, 4 bytes per lane: sdot with the dotprod
 * extension (ARMv8.2+, e.g. -march=armv8.2-a+dotprod or a native build on such a CPU), else widening
 * multiplies and pairwise adds; the same exact integers. */
static inline int32x4_t q8_dot16_neon(int8x16_t q, int8x16_t a) {
#ifdef __ARM_FEATURE_DOTPROD
    return vdotq_s32(vdupq_n_s32(0), q, a);
#else
    const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(q), vget_low_s8(a)));
    const int32x4_t hi = vpaddlq_s16(vmull_high_s8(q, a));
    return vpaddq_s32(lo, hi);
#endif
}

/* As tile_q8: lanes 0-3 and 4-7 in two registers, even and odd blocks in two sets. */
static inline __attribute__((always_inline)) void tile_q8_neon(const int fmt, const void *const wr[],
                                                               const float *const sr[], const int R, int K,
                                                               const int8_t *aq, const float *da, const int M,
                                                               float *res) {
    const int nb = K / 32;
    float32x4_t acc[NR][Q8_ROWS][2][2]; /* [r][m][block parity][lanes 0-3, 4-7] */
    float ks[NR][16];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++)
            for (int p = 0; p < 2; p++) acc[r][m][p][0] = acc[r][m][p][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < nb; b++) {
        if ((fmt == FMT_Q4_K || fmt == FMT_Q6_K) && (b & 7) == 0)
            for (int r = 0; r < R; r++) super_scales(fmt, (const uint8_t *)wr[r], b >> 3, ks[r]);
        for (int r = 0; r < R; r++) {
            int8x16_t lo, hi;
            float s0, s1;
            if (fmt == FMT_Q6_K) {
                lo = levels16_neon(fmt, wr[r], sr[r], 2 * b, &s0, ks[r]);
                hi = levels16_neon(fmt, wr[r], sr[r], 2 * b + 1, &s1, ks[r]);
            } else {
                levels32_neon(fmt, wr[r], sr[r], b, &lo, &hi, &s0, ks[r]);
                s1 = s0;
            }
            for (int m = 0; m < M; m++) {
                const int8_t *a = aq + (long)m * K + 32 * b;
                const float d = da[(long)m * nb + b];
                float32x4_t *ac = acc[r][m][b & 1];
                ac[0] = vfmaq_f32(ac[0], vcvtq_f32_s32(q8_dot16_neon(lo, vld1q_s8(a))), vdupq_n_f32(s0 * d));
                ac[1] = vfmaq_f32(ac[1], vcvtq_f32_s32(q8_dot16_neon(hi, vld1q_s8(a + 16))), vdupq_n_f32(s1 * d));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            const float32x4_t t = vaddq_f32(vaddq_f32(acc[r][m][0][0], acc[r][m][1][0]),
                                            vaddq_f32(acc[r][m][0][1], acc[r][m][1][1]));
            res[r * RS + m] = (vgetq_lane_f32(t, 0) + vgetq_lane_f32(t, 2)) + (vgetq_lane_f32(t, 1) + vgetq_lane_f32(t, 3));
        }
}
#define TILE_Q8 tile_q8_neon
#else
#define TILE_Q8 tile_q8_portable
#endif

/* res for NR weight rows and M <= MCHUNK rows of x (aq, da: those rows' int8 activations). */
static inline __attribute__((always_inline)) void tile_q8_dispatch(const int fmt, const void *const wr[NR],
                                                                   const float *const sr[NR], int K,
                                                                   const int8_t *aq, const float *da, int M,
                                                                   float *res) {
    const int nb = K / 32;
    for (int m0 = 0; m0 < M; m0 += Q8_ROWS) {
        const int mm = M - m0 < Q8_ROWS ? M - m0 : Q8_ROWS;
        const int8_t *a = aq + (long)m0 * K;
        const float *d = da + (long)m0 * nb;
        if (fmt_one_row(fmt, mm)) { /* one weight row at a time, as the fp32 path (see fmt_one_row) */
            for (int r = 0; r < NR; r++) {
                if (mm == 1) TILE_Q8(fmt, wr + r, sr + r, 1, K, a, d, 1, res + r * RS + m0);
                else TILE_Q8(fmt, wr + r, sr + r, 1, K, a, d, 2, res + r * RS + m0);
            }
            continue;
        }
        switch (mm) {
            case 1: TILE_Q8(fmt, wr, sr, NR, K, a, d, 1, res + m0); break;
            case 2: TILE_Q8(fmt, wr, sr, NR, K, a, d, 2, res + m0); break;
            case 3: TILE_Q8(fmt, wr, sr, NR, K, a, d, 3, res + m0); break;
            default: TILE_Q8(fmt, wr, sr, NR, K, a, d, 4, res + m0); break;
        }
    }
}

/* aq [M, K] int8, da [M, K/32] fp32: x [M, K] quantized per 32 values (see the header). K % 32 == 0. */
void gs_quantize_act(const float *x, int M, int K, int8_t *aq, float *da) {
    const int nb = K / 32;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *v = x + (long)m * K + 32 * b;
            int8_t *q = aq + (long)m * K + 32 * b;
#if defined(GS_AVX512) || defined(GS_AVX2)
            const __m256 sign = _mm256_set1_ps(-0.f);
            __m256 xv[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                xv[i] = _mm256_loadu_ps(v + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, xv[i]));
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
#else
            float amax = 0.f;
            for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
#endif
            const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            da[(long)m * nb + b] = d;
#if defined(GS_AVX512) || defined(GS_AVX2)
            const __m256 idv = _mm256_set1_ps(id);
            __m256i iv[4];
            for (int i = 0; i < 4; i++) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], idv)); /* nearest-even */
            const __m256i p16 = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
            const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b),
                                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)q, p8);
#else
            for (int j = 0; j < 32; j++) q[j] = (int8_t)rintf(v[j] * id); /* nearest-even (default mode) */
#endif
        }
}
