/*
 * Q4_0 and Q8_0 weights (and Q5_0, as the Q8_0 blocks of the same values) repacked 8 rows at a time
 * for the int8-activation products (included by qmatmul.c after qdot8.h); K-quants as FMT_I8X8 (below).
 * The idea is llama.cpp's (ggml-cpu repack.cpp, block_q4_0x8): interleave the blocks of 8 weight rows
 * so that one activation load and one vector of 8 scales serve 8 rows, and the
 * 8 rows' integer dot products land in the 8 lanes of one register, with no horizontal sums; one weight
 * stream per group of rows. The layout and the code here are this project's own.
 *
 * Layout (FMT_Q4_0X8, FMT_Q8_0X8): rows in groups of 8 (N a multiple of 8); group g, block b (32 values
 * of each of the 8 rows) at byte (g * nb + b) * 8 * (block bytes), nb = K / 32, so the same bytes per
 * block as the stored format (18 for Q4_0, 34 for Q8_0):
 *   bytes 0..15   the 8 rows' fp16 scales d (row 0 first), as stored;
 *   then C "byte groups" of 32 bytes (C = 4 for Q4_0, 8 for Q8_0): byte group c holds, for rows
 *                 r = 0..7 in turn, bytes 4c .. 4c+3 of row r's packed bytes (Q4_0: 16 bytes, low
 *                 nibble of byte j = value j, high nibble = value j + 16; Q8_0: 32 int8 levels).
 * So 4-byte lane r of a byte group holds row r's levels of one quad of values (Q4_0: two quads, in
 * the two nibbles): a 256-bit load is one quad of values for 8 rows.
 *
 * Order of operations per (m, n) of these formats (their own, the same on every path, batch-
 * invariant): for each block b ascending, the exact integer p_b = sum_j q_j * aq_j over the block's 32
 * values (q: the signed level, Q4_0 nibble - 8), then acc = fma(float(p_b), d_b * da[m, b], acc) from
 * acc = 0; no lanes, no reduction. It differs from the stored formats' int8-activation order (qdot8.h:
 * 8 lanes of 4 values) by float rounding only: the same exact integers per block, summed in another order.
 *
 * With AVX-512 VNNI, Q4_0 and 2+ rows of x, two groups share each 512-bit register (x8_pair_q4_zmm):
 * the same operations per lane in half the instructions per activation row, for up to 8 rows of x per
 * pass over the weights (X8_ZMM_ROWS; the other paths take Q8_ROWS = 4), so a batched draft step of 8
 * slots unpacks each weight block once instead of twice.
 */

#define FMT_Q4_0X8 6
#define FMT_Q8_0X8 7

static inline int x8_stored(const int fmt) { return fmt == FMT_Q8_0X8 ? FMT_Q8_0 : FMT_Q4_0; } /* its format */
static inline int x8_groups(const int fmt) { return fmt == FMT_Q8_0X8 ? 8 : 4; } /* byte groups C */
static inline long x8_block(const int fmt) { return 16 + 32L * x8_groups(fmt); } /* bytes per 8 row-blocks */

typedef struct {
    int fmt, K;
    const uint8_t *src;
    uint8_t *dst;
    long groups;
} x8_repack_job;

#define X8_REPACK_GROUPS 64 /* groups of 8 rows per task */

/* The layout a stored format repacks into: Q4_0 -> Q4_0X8; Q8_0 and Q5_0 -> Q8_0X8 (a Q5_0 block's levels,
 * nibble | high bit << 4 minus 16, fit int8 exactly, and its fp16 d is kept: the Q8_0 block of the same values). */
static inline int x8_of(const int fmt) { return fmt == FMT_Q4_0 ? FMT_Q4_0X8 : FMT_Q8_0X8; }

static void x8_repack_task(void *ctx, int t) {
    const x8_repack_job *j = (const x8_repack_job *)ctx;
    const int fmt = j->fmt, xf = x8_of(fmt), nb = j->K / 32, C = x8_groups(xf);
    const long rb = row_bytes(fmt, j->K), bb = rb / nb, xb = x8_block(xf);
    const long g0 = (long)t * X8_REPACK_GROUPS, g1 = g0 + X8_REPACK_GROUPS < j->groups ? g0 + X8_REPACK_GROUPS : j->groups;
    uint8_t q8[Q8_0_BYTES];
    for (long g = g0; g < g1; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = j->dst + (g * nb + b) * xb;
            for (int r = 0; r < 8; r++) {
                const uint8_t *blk = j->src + (g * 8 + r) * rb + (long)b * bb;
                if (fmt == FMT_Q5_0) { /* the same values as a Q8_0 block: d, then the 32 levels */
                    float unused;
                    memcpy(q8, blk, 2);
                    levels_scalar(FMT_Q5_0, blk, NULL, 0, 32, (int8_t *)(q8 + 2), &unused);
                    blk = q8;
                }
                memcpy(o + 2 * r, blk, 2);
                for (int c = 0; c < C; c++) memcpy(o + 16 + 32 * c + 4 * r, blk + 2 + 4 * c, 4);
            }
        }
}

/* Rows [N, nb * block bytes] of a stored format (FMT_Q4_0, FMT_Q8_0 or FMT_Q5_0; N a multiple of 8) into
 * its repacked layout (x8_of: Q5_0 into Q8_0X8, 34 bytes per block of 32 values against its 22), on
 * nthreads threads; returns 0, or -1 for another format. */
int gs_repack_x8(int fmt, const uint8_t *src, long N, int K, uint8_t *dst, int nthreads) {
    if (fmt != FMT_Q4_0 && fmt != FMT_Q8_0 && fmt != FMT_Q5_0) return -1;
    x8_repack_job job = {fmt, K, src, dst, N / 8};
    gs_parallel((int)((N / 8 + X8_REPACK_GROUPS - 1) / X8_REPACK_GROUPS), nthreads, x8_repack_task, &job);
    return 0;
}

/* Row n of a repacked matrix back in its stored format's bytes. */
static void x8_row_to_stored(const int fmt, const uint8_t *w, int K, long n, uint8_t *row) {
    const int nb = K / 32, r = (int)(n & 7), C = x8_groups(fmt);
    const long xb = x8_block(fmt), bb = 2 + 4 * C;
    const uint8_t *g = w + (n >> 3) * (long)nb * xb;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (long)b * xb;
        memcpy(row + b * bb, blk + 2 * r, 2);
        for (int c = 0; c < C; c++) memcpy(row + b * bb + 2 + 4 * c, blk + 16 + 32 * c + 4 * r, 4);
    }
}

/* Scheduling unit t of a regrouped segment (this file's or r8.h's layout, format fmt, stored format sf)
 * for M rows of fp32 x, each row first rebuilt in the stored format's bytes (row_fn) into a buffer:
 * the stored format's bits; correct, not fast. */
static void rebuilt_rows_tile(const int fmt, const int sf, void (*row_fn)(int, const uint8_t *, int, long, uint8_t *),
                              const gs_segment *sg, int K, const float *x, int M, float *y, long ldy, int t) {
    const int N = sg->N, n0 = t * sg->tile, n1 = n0 + sg->tile < N ? n0 + sg->tile : N;
    const long rb = row_bytes(sf, K);
    uint8_t *buf = (uint8_t *)malloc((size_t)(n1 - n0) * (size_t)rb);
    if (!buf) return;
    for (int n = n0; n < n1; n++) row_fn(fmt, (const uint8_t *)sg->w, K, n, buf + (long)(n - n0) * rb);
    const gs_segment tmp = {sf, n1 - n0, 32, sg->col + n0, buf, NULL, NULL, n1 - n0};
    if (sf == FMT_Q8_0) qmatmul_tile(FMT_Q8_0, &tmp, K, x, NULL, M, NULL, NULL, y, ldy, 0);
    else qmatmul_tile(FMT_Q4_0, &tmp, K, x, NULL, M, NULL, NULL, y, ldy, 0);
    free(buf);
}

#ifndef X8_PF
#define X8_PF 4096 /* prefetch distance (bytes) along a group's stream */
#endif

#if defined(GS_AVX512) || defined(GS_AVX2)
/* x8_group for G adjacent groups at once (G = 1 or 2, compile-time; group g at wg + g * gstride bytes):
 * res[(g * M + m) * 8 + r]. Each activation word is broadcast once for the G groups' dot products; every
 * output's operations (integer sums, then one fused multiply-add per block) are those of G = 1, so the
 * bits are the same. G = 2 needs 16 level registers: AVX-512's 32 vector registers (AVX2 spills). */
static inline __attribute__((always_inline)) void x8_groups_avx(const int fmt, const int G, const uint8_t *wg,
                                                                long gstride, int K, const int8_t *aq,
                                                                const float *da, const int32_t *as, const int M,
                                                                float *res) {
    const int nb = K / 32, q8 = fmt == FMT_Q8_0X8;
    const long xb = x8_block(fmt);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    /* Q8_0: unsigned levels q + 128 where the dot product instruction takes unsigned bytes (VNNI),
     * else signed ones through q8_dot's sign trick; Q4_0: the nibbles (q + 8) */
    const int c8 = q8 ? q8_offset(FMT_Q8_0) : 8;
    __m256 acc[2][Q8_ROWS];
    for (int g = 0; g < G; g++)
        for (int m = 0; m < M; m++) acc[g][m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 sc[2];
        __m256i lv[2][8];
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = wg + g * gstride + (long)b * xb;
            if (G == 1)
                for (int l = 0; l < (int)xb; l += 64) __builtin_prefetch(blk + X8_PF + l);
            else /* two streams, gstride apart: each fetches the next pair's block (2 * gstride on) into L2. A fixed
                  * distance along one stream runs into the other group's bytes, leaving the next pair's second
                  * group cold: M = 2-3 rows then cost 1.4-1.6x one row instead of 1.0-1.2x (E2B-sized Q4_0, Zen 4) */
                for (int l = 0; l < (int)xb; l += 64) __builtin_prefetch(blk + 2 * gstride + l, 0, 2);
            sc[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            if (q8) {
                for (int c = 0; c < 8; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                    lv[g][c] = c8 ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
                }
            } else {
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                    lv[g][c] = _mm256_and_si256(v, m4);
                    lv[g][4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
            }
        }
        for (int m = 0; m < M; m++) {
            const int8_t *a = aq + (long)m * K + 32 * b;
            int32_t aw[8];
            memcpy(aw, a, 32);
            __m256i p[2], p2[2];
            for (int g = 0; g < G; g++) {
                p[g] = _mm256_set1_epi32(-c8 * as[(long)m * nb + b]);
                p2[g] = _mm256_setzero_si256();
            }
            for (int c = 0; c < 8; c += 2) {
                const __m256i w0 = _mm256_set1_epi32(aw[c]), w1 = _mm256_set1_epi32(aw[c + 1]);
                for (int g = 0; g < G; g++) {
                    p[g] = q8 ? q8_dot(FMT_Q8_0, p[g], lv[g][c], w0) : q8_dot_u(p[g], lv[g][c], w0);
                    p2[g] = q8 ? q8_dot(FMT_Q8_0, p2[g], lv[g][c + 1], w1) : q8_dot_u(p2[g], lv[g][c + 1], w1);
                }
            }
            const __m256 dm = _mm256_set1_ps(da[(long)m * nb + b]);
            for (int g = 0; g < G; g++)
                acc[g][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p[g], p2[g])),
                                            _mm256_mul_ps(sc[g], dm), acc[g][m]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int m = 0; m < M; m++) _mm256_storeu_ps(res + 8 * (g * M + m), acc[g][m]);
}
#endif

#if defined(GS_AVX512) && defined(Q8_VNNI) && defined(__AVX512DQ__)
#define X8_ZMM 1
#define X8_ZMM_ROWS 8 /* rows of x per pass of x8_pair_q4_zmm: 8 accumulators + 8 levels + temporaries of 32 */
/* x8_groups_avx for Q4_0, G = 2, in 512-bit registers: group 0's 8 rows in the low 256 bits and group 1's
 * in the high 256 bits of each level, scale and accumulator register, so one VNNI dot product, one
 * conversion and one fused multiply-add serve 16 weight rows for an activation row (half the
 * instructions per activation row of the 256-bit pair). Every lane's operations are those of the
 * 256-bit code: the same exact integer block sums (integer addition in any order), then one
 * fma(float(p_b), d_b * da[m, b], acc) per block, so the bits are the same. */
static inline __attribute__((always_inline)) void x8_pair_q4_zmm(const uint8_t *wg, long gstride, int K,
                                                                 const int8_t *aq, const float *da,
                                                                 const int32_t *as, const int M, float *res) {
    const int nb = K / 32;
    const long xb = x8_block(FMT_Q4_0X8);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[X8_ZMM_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *b0 = wg + (long)b * xb, *b1 = b0 + gstride;
        for (int l = 0; l < (int)xb; l += 64) { /* the next pair's block, into L2 (see x8_groups_avx) */
            __builtin_prefetch(b0 + 2 * gstride + l, 0, 2);
            __builtin_prefetch(b1 + 2 * gstride + l, 0, 2);
        }
        const __m512 sc = _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)b1),
                                                           _mm_loadu_si128((const __m128i *)b0)));
        __m512i lv[8];
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 16 + 32 * c))),
                _mm256_loadu_si256((const __m256i *)(b1 + 16 + 32 * c)), 1);
            lv[c] = _mm512_and_si512(v, m4);
            lv[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        for (int m = 0; m < M; m++) {
            const int8_t *a = aq + (long)m * K + 32 * b;
            int32_t aw[8];
            memcpy(aw, a, 32);
            __m512i p = _mm512_set1_epi32(-8 * as[(long)m * nb + b]), p2 = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                p = _mm512_dpbusd_epi32(p, lv[c], _mm512_set1_epi32(aw[c]));
                p2 = _mm512_dpbusd_epi32(p2, lv[c + 1], _mm512_set1_epi32(aw[c + 1]));
            }
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(p, p2)),
                                     _mm512_mul_ps(sc, _mm512_set1_ps(da[(long)m * nb + b])), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) { /* res[(g * M + m) * 8 + r], as x8_groups_avx */
        _mm256_storeu_ps(res + 8 * m, _mm512_castps512_ps256(acc[m]));
        _mm256_storeu_ps(res + 8 * (M + m), _mm512_extractf32x8_ps(acc[m], 1));
    }
}
#endif

/* res[m * 8 + r] for the 8 rows of group wg (format fmt, a compile-time constant) and M <= Q8_ROWS rows
 * of int8 activations; as: their block sums sum_j aq_j [M, nb] (x8_tile computes them once per tile),
 * which the unsigned-level dot products correct by. */
static inline __attribute__((always_inline)) void x8_group(const int fmt, const uint8_t *wg, int K,
                                                           const int8_t *aq, const float *da,
                                                           const int32_t *as, const int M, float *res) {
    const int nb = K / 32, q8 = fmt == FMT_Q8_0X8;
    const long xb = x8_block(fmt);
#if defined(GS_AVX512) || defined(GS_AVX2)
    x8_groups_avx(fmt, 1, wg, 0, K, aq, da, as, M, res);
#elif defined(GS_NEON)
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int8x16_t eight = vdupq_n_s8(8);
    float32x4_t acc[Q8_ROWS][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wg + (long)b * xb;
        for (int l = 0; l < (int)xb; l += 64) __builtin_prefetch(blk + X8_PF + l);
        const float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(blk));
        const float32x4_t sc[2] = {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
        int8x16_t lv[8][2]; /* [quad][rows 0-3, 4-7]: signed levels */
        for (int half = 0; half < 2; half++) {
            if (q8) {
                for (int c = 0; c < 8; c++) lv[c][half] = vld1q_s8((const int8_t *)blk + 16 + 32 * c + 16 * half);
            } else {
                for (int c = 0; c < 4; c++) {
                    const uint8x16_t v = vld1q_u8(blk + 16 + 32 * c + 16 * half);
                    lv[c][half] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, m4)), eight);
                    lv[4 + c][half] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), eight);
                }
            }
        }
        for (int m = 0; m < M; m++) {
            const int8_t *a = aq + (long)m * K + 32 * b;
            int32_t aw[8];
            memcpy(aw, a, 32);
            const float32x4_t dv = vdupq_n_f32(da[(long)m * nb + b]);
            for (int half = 0; half < 2; half++) {
                int32x4_t p = vdupq_n_s32(0);
                for (int c = 0; c < 8; c++)
                    p = vaddq_s32(p, q8_dot16_neon(lv[c][half], vreinterpretq_s8_s32(vdupq_n_s32(aw[c]))));
                acc[m][half] = vfmaq_f32(acc[m][half], vcvtq_f32_s32(p), vmulq_f32(sc[half], dv));
            }
        }
    }
    for (int m = 0; m < M; m++) {
        vst1q_f32(res + 8 * m, acc[m][0]);
        vst1q_f32(res + 8 * m + 4, acc[m][1]);
    }
#else
    float acc[Q8_ROWS][8] = {{0}};
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wg + (long)b * xb;
        for (int r = 0; r < 8; r++) {
            const float d = f16_to_f32(blk + 2 * r);
            for (int m = 0; m < M; m++) {
                const int8_t *a = aq + (long)m * K + 32 * b;
                int32_t p = 0;
                for (int c = 0; c < x8_groups(fmt); c++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = blk[16 + 32 * c + 4 * r + i];
                        if (q8) {
                            p += (int32_t)(int8_t)byte * a[4 * c + i];
                        } else {
                            p += ((int32_t)(byte & 0x0F) - 8) * a[4 * c + i];
                            p += ((int32_t)(byte >> 4) - 8) * a[16 + 4 * c + i];
                        }
                    }
                acc[m][r] = fmaf((float)p, d * da[(long)m * nb + b], acc[m][r]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < 8; r++) res[8 * m + r] = acc[m][r];
#endif
}

/* The rows of scheduling unit t (sg->tile rows, a multiple of 8) of a repacked segment (fmt), for M rows of
 * int8 activations (aq, da) or, without them, fp32 x (each row rebuilt in its stored format into a buffer: correct,
 * not fast; the Python side passes this format only with int8 activations). */
static inline __attribute__((always_inline)) void x8_tile(const int fmt, const gs_segment *sg, int K,
                                                          const float *x, int M, const int8_t *aq,
                                                          const float *da, float *y, long ldy, int t) {
    const int nb = K / 32, N = sg->N;
    const int n0 = t * sg->tile, n1 = n0 + sg->tile < N ? n0 + sg->tile : N;
    if (!aq) {
        rebuilt_rows_tile(fmt, x8_stored(fmt), x8_row_to_stored, sg, K, x, M, y, ldy, t);
        return;
    }
#if defined(X8_ZMM)
    const int pass = fmt == FMT_Q4_0X8 ? X8_ZMM_ROWS : Q8_ROWS; /* rows of x per pass over the weights */
#else
    const int pass = Q8_ROWS;
#endif
    for (int m0 = 0; m0 < M; m0 += pass) {
        const int mm = M - m0 < pass ? M - m0 : pass;
        const int8_t *a = aq + (long)m0 * K;
        const float *d = da + (long)m0 * nb;
        int32_t stack[8 * 256];
        int32_t *as = mm * nb <= 8 * 256 ? stack : (int32_t *)malloc(sizeof(int32_t) * (size_t)mm * nb);
        if (!as) return;
        for (int m = 0; m < mm; m++) /* block sums of the activations, once per tile */
            for (int b = 0; b < nb; b++) {
                int32_t t = 0;
                for (int j = 0; j < 32; j++) t += a[(long)m * K + 32 * b + j];
                as[m * nb + b] = t;
            }
        int n = n0;
#if defined(GS_AVX512)
        for (; mm >= 2 && n + 16 <= n1; n += 16) { /* two groups per pass: each activation broadcast serves 16 rows */
            const long gs = (long)nb * x8_block(fmt);
            const uint8_t *wg = (const uint8_t *)sg->w + (long)(n >> 3) * gs;
            float res[2 * 8 * 8];
#if defined(X8_ZMM)
            if (fmt == FMT_Q4_0X8) {
                switch (mm) {
                    case 2: x8_pair_q4_zmm(wg, gs, K, a, d, as, 2, res); break;
                    case 3: x8_pair_q4_zmm(wg, gs, K, a, d, as, 3, res); break;
                    case 4: x8_pair_q4_zmm(wg, gs, K, a, d, as, 4, res); break;
                    case 5: x8_pair_q4_zmm(wg, gs, K, a, d, as, 5, res); break;
                    case 6: x8_pair_q4_zmm(wg, gs, K, a, d, as, 6, res); break;
                    case 7: x8_pair_q4_zmm(wg, gs, K, a, d, as, 7, res); break;
                    default: x8_pair_q4_zmm(wg, gs, K, a, d, as, 8, res); break;
                }
            } else
#endif
            switch (mm) {
                case 2: x8_groups_avx(fmt, 2, wg, gs, K, a, d, as, 2, res); break;
                case 3: x8_groups_avx(fmt, 2, wg, gs, K, a, d, as, 3, res); break;
                default: x8_groups_avx(fmt, 2, wg, gs, K, a, d, as, 4, res); break;
            }
            for (int g = 0; g < 2; g++)
                for (int m = 0; m < mm; m++)
                    for (int r = 0; r < 8; r++)
                        y[(long)(m0 + m) * ldy + sg->col + n + 8 * g + r] = res[8 * (g * mm + m) + r];
        }
#endif
        for (; n < n1; n += 8) {
            const uint8_t *wg = (const uint8_t *)sg->w + (long)(n >> 3) * nb * x8_block(fmt);
            for (int q0 = 0; q0 < mm; q0 += Q8_ROWS) { /* a single group takes Q8_ROWS rows of x at a time */
                const int mq = mm - q0 < Q8_ROWS ? mm - q0 : Q8_ROWS;
                const int8_t *aq0 = a + (long)q0 * K;
                const float *d0 = d + (long)q0 * nb;
                const int32_t *as0 = as + (long)q0 * nb;
                float res[Q8_ROWS * 8];
                switch (mq) {
                    case 1: x8_group(fmt, wg, K, aq0, d0, as0, 1, res); break;
                    case 2: x8_group(fmt, wg, K, aq0, d0, as0, 2, res); break;
                    case 3: x8_group(fmt, wg, K, aq0, d0, as0, 3, res); break;
                    default: x8_group(fmt, wg, K, aq0, d0, as0, 4, res); break;
                }
                for (int m = 0; m < mq; m++)
                    for (int r = 0; r < 8; r++) y[(long)(m0 + q0 + m) * ldy + sg->col + n + r] = res[8 * m + r];
            }
        }
        if (as != stack) free(as);
    }
}

/*
 * FMT_I8X8: any stored format's int8 levels, 8 rows at a time, for the int8-activation products (K-quants:
 * Q4_K, Q6_K, whose blocks x8's layout cannot hold). Segment fields: w the levels, s the scales, o the
 * offsets (or NULL), G the values per scale (32 for Q4_K, 16 for Q6_K). Group g (rows 8g .. 8g+7),
 * block b of nbg = K / G:
 *   levels at byte (g * nbg + b) * 8 * G: G / 4 byte groups of 32 bytes, byte group c holding, for rows
 *          r = 0..7 in turn, row r's int8 levels of values 4c .. 4c+3 of the block (x8's interleave);
 *   scales s[(g * nbg + b) * 8 + r] and offsets o[...] as fp32 (the stored block's scale and offset,
 *          levels_scalar / stored_scale / block_offset: W = scale * q + offset, no rounding).
 * Order per (m, n): for each block b ascending, the exact integer p_b = sum_j q_j * aq_j over its G values,
 * acc = fma(float(p_b), s_b * da[m, b * G / 32], acc) from 0; then the offsets' term
 * off = fma(o_b, xsum[m, b], off) from 0, b ascending (xsum: fp32 sums of x over the G-value blocks),
 * and y = acc + off. The same on every path, for every number of rows.
 */
#define FMT_I8X8 10

typedef struct {
    int fmt, K, G;
    const uint8_t *src;
    int8_t *lev;
    float *s, *o;
    long groups;
} i8x8_repack_job;

static void i8x8_repack_task(void *ctx, int t) {
    const i8x8_repack_job *j = (const i8x8_repack_job *)ctx;
    const int G = j->G, nbg = j->K / G, C = G / 4;
    const long rb = row_bytes(j->fmt, j->K);
    const long g0 = (long)t * X8_REPACK_GROUPS, g1 = g0 + X8_REPACK_GROUPS < j->groups ? g0 + X8_REPACK_GROUPS : j->groups;
    for (long g = g0; g < g1; g++)
        for (int b = 0; b < nbg; b++) {
            int8_t *o = j->lev + (g * nbg + b) * 8L * G;
            const long at = (g * nbg + b) * 8;
            for (int r = 0; r < 8; r++) {
                const uint8_t *row = j->src + (g * 8 + r) * rb;
                int8_t q[32];
                float sc;
                levels_scalar(j->fmt, row, NULL, b, G, q, &sc);
                j->s[at + r] = sc;
                if (j->o) j->o[at + r] = block_offset(j->fmt, row, NULL, b);
                for (int c = 0; c < C; c++) memcpy(o + 32 * c + 4 * r, q + 4 * c, 4);
            }
        }
}

/* Rows [N, row bytes] of a stored K-quant (FMT_Q4_K: G 32, offsets; FMT_Q6_K: G 16, o may be NULL; N a
 * multiple of 8) into FMT_I8X8: lev int8 [N * K], s and o fp32 [N / 8 * K / G * 8]; returns 0, or -1 for
 * another format. */
int gs_repack_i8x8(int fmt, const uint8_t *src, long N, int K, int8_t *lev, float *s, float *o, int nthreads) {
    if (fmt != FMT_Q4_K && fmt != FMT_Q6_K) return -1;
    i8x8_repack_job job = {fmt, K, fmt_group(fmt, 32), src, lev, s, fmt == FMT_Q4_K ? o : NULL, N / 8};
    gs_parallel((int)((N / 8 + X8_REPACK_GROUPS - 1) / X8_REPACK_GROUPS), nthreads, i8x8_repack_task, &job);
    return 0;
}

/* res[(g * M + m) * 8 + r]: the block sums' accumulator acc (offsets not included) of NG = 1 or 2 adjacent
 * groups (levels wg + g * gstride, scales sg + g * sstride) for M <= Q8_ROWS rows of int8 activations; as:
 * their sums over the G-value blocks [M, K / G] (x8_tile's role). */
static inline __attribute__((always_inline)) void i8x8_groups(const int NG, const int G, const int8_t *wg, long gstride,
                                                              const float *sg, long sstride, int K, const int8_t *aq,
                                                              const float *da, const int32_t *as, const int M,
                                                              float *res) {
    const int nbg = K / G, C = G / 4, nb32 = K / 32;
#if defined(GS_AVX512) || defined(GS_AVX2)
    const int c8 = q8_offset(FMT_Q8_0); /* unsigned levels q + 128 for VNNI, else the sign trick */
    __m256 acc[2][Q8_ROWS];
    for (int g = 0; g < NG; g++)
        for (int m = 0; m < M; m++) acc[g][m] = _mm256_setzero_ps();
    for (int b = 0; b < nbg; b++) {
        __m256 sc[2];
        __m256i lv[2][8];
        for (int g = 0; g < NG; g++) {
            const int8_t *blk = wg + g * gstride + (long)b * 8 * G;
            if (NG == 1)
                for (int l = 0; l < 8 * G; l += 64) __builtin_prefetch(blk + X8_PF + l);
            else
                for (int l = 0; l < 8 * G; l += 64) __builtin_prefetch(blk + 2 * gstride + l, 0, 2);
            sc[g] = _mm256_loadu_ps(sg + g * sstride + (long)b * 8);
            for (int c = 0; c < C; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * c));
                lv[g][c] = c8 ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
            }
        }
        for (int m = 0; m < M; m++) {
            const int8_t *a = aq + (long)m * K + G * b;
            int32_t aw[8];
            memcpy(aw, a, (size_t)G);
            __m256i p[2], p2[2];
            for (int g = 0; g < NG; g++) {
                p[g] = _mm256_set1_epi32(-c8 * as[(long)m * nbg + b]);
                p2[g] = _mm256_setzero_si256();
            }
            for (int c = 0; c < C; c += 2) {
                const __m256i w0 = _mm256_set1_epi32(aw[c]), w1 = _mm256_set1_epi32(aw[c + 1]);
                for (int g = 0; g < NG; g++) {
                    p[g] = q8_dot(FMT_Q8_0, p[g], lv[g][c], w0);
                    p2[g] = q8_dot(FMT_Q8_0, p2[g], lv[g][c + 1], w1);
                }
            }
            const __m256 dm = _mm256_set1_ps(da[(long)m * nb32 + (G * b) / 32]);
            for (int g = 0; g < NG; g++)
                acc[g][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p[g], p2[g])),
                                            _mm256_mul_ps(sc[g], dm), acc[g][m]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int m = 0; m < M; m++) _mm256_storeu_ps(res + 8 * (g * M + m), acc[g][m]);
#elif defined(GS_NEON)
    for (int g = 0; g < NG; g++) {
        const int8_t *wgg = wg + g * gstride;
        const float *sgg = sg + g * sstride;
        float32x4_t acc[Q8_ROWS][2];
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
        for (int b = 0; b < nbg; b++) {
            const int8_t *blk = wgg + (long)b * 8 * G;
            for (int l = 0; l < 8 * G; l += 64) __builtin_prefetch(blk + X8_PF + l);
            const float32x4_t sc[2] = {vld1q_f32(sgg + (long)b * 8), vld1q_f32(sgg + (long)b * 8 + 4)};
            int8x16_t lv[8][2];
            for (int c = 0; c < C; c++)
                for (int half = 0; half < 2; half++) lv[c][half] = vld1q_s8(blk + 32 * c + 16 * half);
            for (int m = 0; m < M; m++) {
                const int8_t *a = aq + (long)m * K + G * b;
                int32_t aw[8];
                memcpy(aw, a, (size_t)G);
                const float32x4_t dv = vdupq_n_f32(da[(long)m * nb32 + (G * b) / 32]);
                for (int half = 0; half < 2; half++) {
                    int32x4_t p = vdupq_n_s32(0);
                    for (int c = 0; c < C; c++)
                        p = vaddq_s32(p, q8_dot16_neon(lv[c][half], vreinterpretq_s8_s32(vdupq_n_s32(aw[c]))));
                    acc[m][half] = vfmaq_f32(acc[m][half], vcvtq_f32_s32(p), vmulq_f32(sc[half], dv));
                }
            }
        }
        for (int m = 0; m < M; m++) {
            vst1q_f32(res + 8 * (g * M + m), acc[m][0]);
            vst1q_f32(res + 8 * (g * M + m) + 4, acc[m][1]);
        }
    }
#else
    (void)as;
    for (int g = 0; g < NG; g++) {
        const int8_t *wgg = wg + g * gstride;
        const float *sgg = sg + g * sstride;
        float acc[Q8_ROWS][8] = {{0}};
        for (int b = 0; b < nbg; b++) {
            const int8_t *blk = wgg + (long)b * 8 * G;
            for (int r = 0; r < 8; r++) {
                const float d = sgg[(long)b * 8 + r];
                for (int m = 0; m < M; m++) {
                    const int8_t *a = aq + (long)m * K + G * b;
                    int32_t p = 0;
                    for (int c = 0; c < C; c++)
                        for (int i = 0; i < 4; i++) p += (int32_t)blk[32 * c + 4 * r + i] * a[4 * c + i];
                    acc[m][r] = fmaf((float)p, d * da[(long)m * nb32 + (G * b) / 32], acc[m][r]);
                }
            }
        }
        for (int m = 0; m < M; m++)
            for (int r = 0; r < 8; r++) res[8 * (g * M + m) + r] = acc[m][r];
    }
#endif
}

/* Row n of an FMT_I8X8 matrix as the FMT_I8 form: levels q [K], scales and offsets [K / G]. */
static void i8x8_row(const int8_t *lev, const float *s, const float *o, int K, int G, long n, int8_t *q, float *rs,
                     float *ro) {
    const int nbg = K / G, C = G / 4, r = (int)(n & 7);
    const long g = n >> 3;
    for (int b = 0; b < nbg; b++) {
        const int8_t *blk = lev + (g * nbg + b) * 8L * G;
        for (int c = 0; c < C; c++) memcpy(q + (long)b * G + 4 * c, blk + 32 * c + 4 * r, 4);
        rs[b] = s[(g * nbg + b) * 8 + r];
        if (o) ro[b] = o[(g * nbg + b) * 8 + r];
    }
}

/* out[r] = the offsets' term of the 8 rows of a group for one row of x: fma(o_b[r], xs[b], acc) from 0, b
 * ascending (o8: the group's offsets [nbg][8], xs: that row's sums of x over the blocks). */
static inline void i8x8_offsets(const float *o8, const float *xs, int nbg, float out[8]) {
#if defined(GS_AVX512) || defined(GS_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nbg; b++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(o8 + 8L * b), _mm256_set1_ps(xs[b]), acc);
    _mm256_storeu_ps(out, acc);
#elif defined(GS_NEON)
    float32x4_t lo = vdupq_n_f32(0.f), hi = vdupq_n_f32(0.f);
    for (int b = 0; b < nbg; b++) {
        const float32x4_t v = vdupq_n_f32(xs[b]);
        lo = vfmaq_f32(lo, vld1q_f32(o8 + 8L * b), v);
        hi = vfmaq_f32(hi, vld1q_f32(o8 + 8L * b + 4), v);
    }
    vst1q_f32(out, lo);
    vst1q_f32(out + 4, hi);
#else
    for (int r = 0; r < 8; r++) {
        float acc = 0.f;
        for (int b = 0; b < nbg; b++) acc = fmaf(o8[8L * b + r], xs[b], acc);
        out[r] = acc;
    }
#endif
}

/* The rows of scheduling unit t of an FMT_I8X8 segment with G values per scale (a compile-time constant)
 * for M rows of int8 activations (aq, da). */
static inline __attribute__((always_inline)) void i8x8_tile_g(const int G, const gs_segment *sg, int K,
                                                              const float *xsum, int M, const int8_t *aq,
                                                              const float *da, float *y, long ldy, int t) {
    const int nbg = K / G, N = sg->N;
    const int n0 = t * sg->tile, n1 = n0 + sg->tile < N ? n0 + sg->tile : N;
    const int8_t *lev = (const int8_t *)sg->w;
    const long gstride = (long)nbg * 8 * G, sstride = (long)nbg * 8;
    for (int m0 = 0; m0 < M; m0 += Q8_ROWS) {
        const int mm = M - m0 < Q8_ROWS ? M - m0 : Q8_ROWS;
        const int8_t *a = aq + (long)m0 * K;
        const float *d = da + (long)m0 * (K / 32);
        int32_t stack[Q8_ROWS * 512];
        int32_t *as = mm * nbg <= Q8_ROWS * 512 ? stack : (int32_t *)malloc(sizeof(int32_t) * (size_t)mm * nbg);
        if (!as) return;
        for (int m = 0; m < mm; m++) /* block sums of the activations, once per tile */
            for (int b = 0; b < nbg; b++) {
                int32_t s = 0;
                for (int j = 0; j < G; j++) s += a[(long)m * K + G * b + j];
                as[m * nbg + b] = s;
            }
        for (int n = n0; n < n1;) {
            const int ng = (n + 16 <= n1 && mm >= 2) ? 2 : 1;
            const int8_t *wg = lev + (long)(n >> 3) * gstride;
            const float *sg8 = sg->s + (long)(n >> 3) * sstride;
            float res[2 * Q8_ROWS * 8];
            if (ng == 2) {
                switch (mm) {
                    case 2: i8x8_groups(2, G, wg, gstride, sg8, sstride, K, a, d, as, 2, res); break;
                    case 3: i8x8_groups(2, G, wg, gstride, sg8, sstride, K, a, d, as, 3, res); break;
                    default: i8x8_groups(2, G, wg, gstride, sg8, sstride, K, a, d, as, 4, res); break;
                }
            } else {
                switch (mm) {
                    case 1: i8x8_groups(1, G, wg, gstride, sg8, sstride, K, a, d, as, 1, res); break;
                    case 2: i8x8_groups(1, G, wg, gstride, sg8, sstride, K, a, d, as, 2, res); break;
                    case 3: i8x8_groups(1, G, wg, gstride, sg8, sstride, K, a, d, as, 3, res); break;
                    default: i8x8_groups(1, G, wg, gstride, sg8, sstride, K, a, d, as, 4, res); break;
                }
            }
            for (int g = 0; g < ng; g++) {
                const long grp = (n >> 3) + g;
                for (int m = 0; m < mm; m++) {
                    float off[8] = {0};
                    if (sg->o) i8x8_offsets(sg->o + grp * sstride, xsum + (long)(m0 + m) * nbg, nbg, off);
                    for (int r = 0; r < 8; r++)
                        y[(long)(m0 + m) * ldy + sg->col + n + 8 * g + r] = res[8 * (g * mm + m) + r] + off[r];
                }
            }
            n += 8 * ng;
        }
        if (as != stack) free(as);
    }
}

/* The rows of scheduling unit t of an FMT_I8X8 segment, for M rows of int8 activations (aq, da) or, without
 * them, fp32 x (the rows rebuilt as the FMT_I8 form: the stored format's fp32 bits; correct, not fast). */
static void i8x8_tile(const gs_segment *sg, int K, const float *x, const float *xsum, int M, const int8_t *aq,
                      const float *da, float *y, long ldy, int t) {
    const int G = sg->G, nbg = K / G, N = sg->N;
    if (aq) {
        if (G == 16) i8x8_tile_g(16, sg, K, xsum, M, aq, da, y, ldy, t);
        else i8x8_tile_g(32, sg, K, xsum, M, aq, da, y, ldy, t);
        return;
    }
    const int n0 = t * sg->tile, n1 = n0 + sg->tile < N ? n0 + sg->tile : N, rows = n1 - n0;
    int8_t *q = (int8_t *)malloc((size_t)rows * (size_t)K + sizeof(float) * 2 * (size_t)rows * (size_t)nbg + 8);
    if (!q) return;
    float *rs = (float *)(q + (((size_t)rows * (size_t)K + 7) & ~(size_t)7)), *ro = rs + (long)rows * nbg;
    for (int n = n0; n < n1; n++)
        i8x8_row((const int8_t *)sg->w, sg->s, sg->o, K, G, n, q + (long)(n - n0) * K, rs + (long)(n - n0) * nbg,
                 ro + (long)(n - n0) * nbg);
    const gs_segment tmp = {FMT_I8, rows, G, sg->col + n0, q, rs, sg->o ? ro : NULL, rows};
    qmatmul_tile(FMT_I8, &tmp, K, x, xsum, M, NULL, NULL, y, ldy, 0);
    free(q);
}
