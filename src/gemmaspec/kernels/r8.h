/*
 * Q4_0 and Q8_0 weights regrouped 8 rows at a time for the fp32-activation products (included by
 * qmatmul.c after x8.h). x8.h's layout interleaves 4-byte quads of 8 rows for the int8 dot products;
 * this one keeps each row's level bytes of a block together, so a row's block is one contiguous load as
 * in the stored format, and only the scales move: the 8 rows' fp16 scales of a block side by side,
 * converted by one vector instruction, and the 8 rows read as one sequential stream.
 *
 * Layout (FMT_Q4_0R8, FMT_Q8_0R8): rows in groups of 8 (N a multiple of 8); group g, block b (32 values
 * of each of the 8 rows) at byte (g * nb + b) * 8 * (block bytes), nb = K / 32:
 *   bytes 0..15   the 8 rows' fp16 scales d (row 0 first), as stored;
 *   then for rows r = 0..7 in turn the row's level bytes of the block as stored (Q4_0: 16 bytes, low
 *   nibble of byte j = value j, high nibble = value j + 16; Q8_0: 32 int8 levels).
 *
 * Order of operations per (m, n): exactly the stored format's (tile_dot / tile_avx2: per block
 * t = w0 * x0, t = fma(w1, x1, t), acc = fma(t, d, acc) in 16 lanes, then reduce16), so the results
 * are the stored format's bits on every path; only the addresses differ.
 *
 * Measured on a 2-core AMD EPYC (Zen 4), one thread, a 262,144 x 640 matrix streamed from DRAM, one
 * row of x (a standalone loop of these operations): Q4_0 1.91 -> 1.46 ns per block, Q8_0 (against
 * the one-row stored path) 2.20 -> 1.85 ns; same bits.
 */

static inline int r8_stored(const int fmt) { return fmt == FMT_Q8_0R8 ? FMT_Q8_0 : FMT_Q4_0; } /* its format */
static inline int r8_level_bytes(const int fmt) { return fmt == FMT_Q8_0R8 ? 32 : 16; }
static inline long r8_block(const int fmt) { return fmt == FMT_Q8_0R8 ? R8_Q8_BYTES : R8_Q4_BYTES; }

typedef struct {
    int fmt, K;
    const uint8_t *src;
    uint8_t *dst;
    long groups;
} r8_repack_job;

#define R8_REPACK_GROUPS 64 /* groups of 8 rows per task */

static inline __attribute__((always_inline)) void r8_repack_groups(const int L, const r8_repack_job *j, long g0,
                                                                   long g1) {
    const int nb = j->K / 32;
    const long bb = 2 + L, rb = bb * nb, xb = 8 * bb;
    for (long g = g0; g < g1; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = j->dst + (g * nb + b) * xb;
            for (int r = 0; r < 8; r++) {
                const uint8_t *blk = j->src + (g * 8 + r) * rb + (long)b * bb;
                memcpy(o + 2 * r, blk, 2);
                memcpy(o + 16 + L * r, blk + 2, L); /* L a constant: inlined moves */
            }
        }
}

static void r8_repack_task(void *ctx, int t) {
    const r8_repack_job *j = (const r8_repack_job *)ctx;
    const long g0 = (long)t * R8_REPACK_GROUPS, g1 = g0 + R8_REPACK_GROUPS < j->groups ? g0 + R8_REPACK_GROUPS : j->groups;
    if (j->fmt == FMT_Q8_0) r8_repack_groups(32, j, g0, g1);
    else r8_repack_groups(16, j, g0, g1);
}

/* Rows [N, nb * block bytes] of a stored format (FMT_Q4_0 or FMT_Q8_0; N a multiple of 8) into its
 * fp32 layout, on nthreads threads; returns 0, or -1 for another format or N not a multiple of 8. */
int gs_repack_r8(int fmt, const uint8_t *src, long N, int K, uint8_t *dst, int nthreads) {
    if ((fmt != FMT_Q4_0 && fmt != FMT_Q8_0) || N % 8 || K % 32) return -1;
    r8_repack_job job = {fmt, K, src, dst, N / 8};
    gs_parallel((int)((N / 8 + R8_REPACK_GROUPS - 1) / R8_REPACK_GROUPS), nthreads, r8_repack_task, &job);
    return 0;
}

/* Row n of a regrouped matrix back in its stored format's bytes. */
static void r8_row_to_stored(const int fmt, const uint8_t *w, int K, long n, uint8_t *row) {
    const int nb = K / 32, r = (int)(n & 7), L = r8_level_bytes(fmt);
    const long xb = r8_block(fmt), bb = 2 + L;
    const uint8_t *g = w + (n >> 3) * (long)nb * xb;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (long)b * xb;
        memcpy(row + b * bb, blk + 2 * r, 2);
        memcpy(row + b * bb + 2, blk + 16 + (long)L * r, (size_t)L);
    }
}

#ifdef GS_AVX512
/* res[r] for the 8 rows of group g and one row of x: tile_dot's operations with 8 accumulators, the
 * block's 8 scales converted at once. */
static inline __attribute__((always_inline)) void r8_one_x(const int fmt, const uint8_t *g, int K, const float *x,
                                                           float res[8]) {
    const int nb = K / 32, L = r8_level_bytes(fmt);
    const long xb = r8_block(fmt);
    const __m512 q4_levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (long)b * xb;
        for (int l = 0; l < (int)xb; l += 64) _mm_prefetch((const char *)blk + PF_BYTES + l, _MM_HINT_T0);
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        float d[8] __attribute__((aligned(32)));
#ifdef __F16C__
        _mm256_store_ps(d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk))); /* exact, as f16_to_f32 */
#else
        for (int r = 0; r < 8; r++) d[r] = f16_to_f32(blk + 2 * r);
#endif
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
            const uint8_t *q = blk + 16 + L * r;
            __m512 w0, w1;
            if (fmt == FMT_Q4_0R8) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                w0 = _mm512_permutexvar_ps(v, q4_levels);
                w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), q4_levels);
            } else {
                w0 = cvt16(_mm_loadu_si128((const __m128i *)q));
                w1 = cvt16(_mm_loadu_si128((const __m128i *)(q + 16)));
            }
            __m512 t = _mm512_mul_ps(w0, x0);
            t = _mm512_fmadd_ps(w1, x1, t);
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(d[r]), acc[r]);
        }
    }
    for (int r = 0; r < 8; r++) res[r] = reduce512(acc[r]);
}
#endif

#ifdef GS_AVX2
/* res[r] for the 8 rows of group g and one row of x on AVX2: tile_avx2's operations per row (16 lanes as
 * two 8-lane halves), in two passes of 4 rows (8 accumulators of the 16 registers), each block's scales
 * converted 4 at a time by one vcvtph2ps. For Q4_0, the first product of each half, (n - 8) * x, is
 * computed as fma(n, x, -8x) with xm8 = -8x precomputed once per call: the same real number rounded
 * once, so the same bits for finite x (a zero may change sign, which the accumulator, starting at +0,
 * absorbs), and one subtraction fewer per 8 levels. Non-finite x, or |x| > FLT_MAX / 8, may give
 * different results (NaN or inf either way). */
static inline __attribute__((always_inline)) void r8_one_x_avx2(const int fmt, const uint8_t *g, int K, const float *x,
                                                                const float *xm8, float res[8]) {
    const int nb = K / 32, L = r8_level_bytes(fmt);
    const long xb = r8_block(fmt);
    for (int h = 0; h < 8; h += 4) {
        __m256 lo[4], hi[4];
        for (int r = 0; r < 4; r++) lo[r] = hi[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = g + (long)b * xb;
            if (h == 0)
                for (int l = 0; l < (int)xb; l += 64) _mm_prefetch((const char *)blk + PF_BYTES + l, _MM_HINT_T0);
            float d[4] __attribute__((aligned(16)));
            _mm_store_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(const void *)(blk + 2 * h)))); /* exact */
            const float *xp = x + 32 * b;
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                const uint8_t *q = blk + 16 + (long)L * (h + r);
                const __m256 sc = _mm256_broadcast_ss(d + r);
                __m256 tl, th;
                if (fmt == FMT_Q4_0R8) {
                    const __m256i d0 = _mm256_cvtepu8_epi32(LD8(q)), d1 = _mm256_cvtepu8_epi32(LD8(q + 8));
                    const __m256i m15 = _mm256_set1_epi32(15), e = _mm256_set1_epi32(8);
                    tl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(d0, m15)), _mm256_loadu_ps(xp),
                                         _mm256_loadu_ps(xm8 + 32 * b));
                    th = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(d1, m15)), _mm256_loadu_ps(xp + 8),
                                         _mm256_loadu_ps(xm8 + 32 * b + 8));
                    tl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(d0, 4), e)),
                                         _mm256_loadu_ps(xp + 16), tl);
                    th = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(d1, 4), e)),
                                         _mm256_loadu_ps(xp + 24), th);
                } else {
                    tl = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD8(q))), _mm256_loadu_ps(xp));
                    th = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD8(q + 8))), _mm256_loadu_ps(xp + 8));
                    tl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD8(q + 16))), _mm256_loadu_ps(xp + 16), tl);
                    th = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD8(q + 24))), _mm256_loadu_ps(xp + 24), th);
                }
                lo[r] = _mm256_fmadd_ps(tl, sc, lo[r]);
                hi[r] = _mm256_fmadd_ps(th, sc, hi[r]);
            }
        }
        for (int r = 0; r < 4; r++) res[h + r] = reduce16(lo[r], hi[r]);
    }
}
#ifndef GS_R8_AVX2_ONE
#define GS_R8_AVX2_ONE 1 /* 0: one row of x through tile_avx2, for A/B */
#endif
#define R8_XM8_MAX 16384 /* the longest K whose -8x fits the stack buffer; longer K use tile_avx2 */
#endif

/* The rows of scheduling unit t (sg->tile rows, a multiple of 8) of a regrouped segment (fmt) for M rows
 * of fp32 x. With AVX-512 or AVX2 the SIMD tiles read the layout in place (levels32's FMT_*R8 cases);
 * elsewhere each row is rebuilt in its stored format into a buffer (correct, not fast; the Python side
 * regroups only for those two). */
static inline __attribute__((always_inline)) void r8_tile(const int fmt, const gs_segment *sg, int K,
                                                          const float *x, int M, float *y, long ldy, int t) {
    const int nb = K / 32, N = sg->N, L = r8_level_bytes(fmt);
    const int n0 = t * sg->tile, n1 = n0 + sg->tile < N ? n0 + sg->tile : N;
    const long xb = r8_block(fmt);
#if defined(GS_AVX512) || defined(GS_AVX2)
#ifdef GS_AVX2
    float xm8[fmt == FMT_Q4_0R8 && M == 1 && K <= R8_XM8_MAX ? K : 1] __attribute__((aligned(32))); /* -8x */
    if (fmt == FMT_Q4_0R8 && M == 1 && K <= R8_XM8_MAX)
        for (int k = 0; k < K; k += 8) _mm256_store_ps(xm8 + k, _mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(-8.f)));
#endif
    for (int n = n0; n < n1; n += 8) {
        const uint8_t *g = (const uint8_t *)sg->w + (long)(n >> 3) * nb * xb;
#ifdef GS_AVX512
        if (M == 1) {
            float res[8];
            r8_one_x(fmt, g, K, x, res);
            for (int r = 0; r < 8; r++) y[sg->col + n + r] = res[r];
            continue;
        }
#else
        if (GS_R8_AVX2_ONE && M == 1 && K <= R8_XM8_MAX) {
            float res[8];
            r8_one_x_avx2(fmt, g, K, x, xm8, res);
            for (int r = 0; r < 8; r++) y[sg->col + n + r] = res[r];
            continue;
        }
#endif
        const void *wr[8];
        const float *sr[8]; /* the row's scale bytes, read as bytes by levels32 */
        for (int r = 0; r < 8; r++) {
            wr[r] = g + 16 + (long)L * r;
            sr[r] = (const float *)(const void *)(g + 2 * r);
        }
        for (int m0 = 0; m0 < M; m0 += MCHUNK) {
            const int mm = M - m0 < MCHUNK ? M - m0 : MCHUNK;
            for (int h = 0; h < 8; h += NR) {
                float res[NR * RS];
                tile_dispatch(fmt, wr + h, sr + h, K, 32, x + (long)m0 * K, K, mm, res);
                for (int r = 0; r < NR; r++)
                    for (int m = 0; m < mm; m++) y[(long)(m0 + m) * ldy + sg->col + n + h + r] = res[r * RS + m];
            }
        }
    }
#else
    (void)nb, (void)N, (void)L, (void)n0, (void)n1, (void)xb;
    rebuilt_rows_tile(fmt, r8_stored(fmt), r8_row_to_stored, sg, K, x, M, y, ldy, t);
#endif
}
