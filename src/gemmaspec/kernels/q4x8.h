/*
 * Q4_0 weights repacked 8 rows at a time for the int8-activation products (included by qmatmul.c after
 * qdot8.h). The idea is llama.cpp's (ggml-cpu repack.cpp, block_q4_0x8): interleave the blocks of 8
 * weight rows so that one activation load and one vector of 8 scales serve 8 rows, and the 8 rows'
 * integer dot products land in the 8 lanes of one register, with no horizontal sums. The layout and
 * the code here are this project's own.
 *
 * FMT_Q4_0X8 layout: rows in groups of 8 (N a multiple of 8); group g, block b (32 values of each of
 * the 8 rows) at byte (g * nb + b) * 144, nb = K / 32, the same 18 bytes per block as Q4_0:
 *   bytes   0..15   the 8 rows' fp16 scales d (row 0 first), as stored;
 *   bytes  16..143  four "byte groups" of 32 bytes: byte group c (0..3) holds, for rows r = 0..7 in
 *                   turn, bytes 4c .. 4c+3 of row r's 16 packed bytes (low nibble of byte j: value j,
 *                   high nibble: value j + 16, as in Q4_0).
 * So 4-byte lane r of byte group c holds the nibbles of values 4c..4c+3 (low) and 16+4c..16+4c+3
 * (high) of row r: a 256-bit load is one quad of values for 8 rows.
 *
 * Order of operations per (m, n) of FMT_Q4_0X8 (its own, the same on every path, batch-invariant):
 * for each block b ascending, the exact integer p_b = sum_j (q_j - 8) * aq_j over the block's 32 values
 * (q: nibble), then acc = fma(float(p_b), d_b * da[m, b], acc) from acc = 0; no lanes, no reduction.
 * It differs from FMT_Q4_0's int8-activation order (qdot8.h: 8 lanes of 4 values) by float rounding
 * only: the same exact integers per block, summed in a different order.
 */

#define FMT_Q4_0X8 6
#define X8_BLOCK 144 /* bytes of one block of 8 rows */

/* Q4_0 rows [N, nb * 18] (N a multiple of 8) into FMT_Q4_0X8. */
void gs_repack_q4_0x8(const uint8_t *src, long N, int K, uint8_t *dst) {
    const int nb = K / 32;
    const long rb = (long)nb * Q4_0_BYTES;
    for (long g = 0; g < N / 8; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = dst + (g * nb + b) * X8_BLOCK;
            for (int r = 0; r < 8; r++) {
                const uint8_t *blk = src + (g * 8 + r) * rb + (long)b * Q4_0_BYTES;
                memcpy(o + 2 * r, blk, 2);
                for (int c = 0; c < 4; c++) memcpy(o + 16 + 32 * c + 4 * r, blk + 2 + 4 * c, 4);
            }
        }
}

/* Row n of an FMT_Q4_0X8 matrix back as Q4_0 bytes (nb * 18). */
static void x8_row_to_q4_0(const uint8_t *w, int K, long n, uint8_t *row) {
    const int nb = K / 32, r = (int)(n & 7);
    const uint8_t *g = w + (n >> 3) * (long)nb * X8_BLOCK;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (long)b * X8_BLOCK;
        memcpy(row + b * Q4_0_BYTES, blk + 2 * r, 2);
        for (int c = 0; c < 4; c++) memcpy(row + b * Q4_0_BYTES + 2 + 4 * c, blk + 16 + 32 * c + 4 * r, 4);
    }
}

#ifndef X8_PF
#define X8_PF 4096 /* prefetch distance (bytes) along a group's stream */
#endif

/* res[m * 8 + r] for the 8 rows of group wg and M <= Q8_ROWS rows of int8 activations. */
static inline __attribute__((always_inline)) void x8_group(const uint8_t *wg, int K, const int8_t *aq,
                                                           const float *da, const int M, float *res) {
    const int nb = K / 32;
#if defined(GS_AVX512) || defined(GS_AVX2)
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[Q8_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wg + (long)b * X8_BLOCK;
        __builtin_prefetch(blk + X8_PF);
        __builtin_prefetch(blk + X8_PF + 64);
        __builtin_prefetch(blk + X8_PF + 128);
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            lo[c] = _mm256_and_si256(v, m4);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        for (int m = 0; m < M; m++) {
            const int8_t *a = aq + (long)m * K + 32 * b;
            int32_t aw[8], asum = 0;
            memcpy(aw, a, 32);
            for (int j = 0; j < 32; j++) asum += a[j];
            __m256i p = _mm256_set1_epi32(-8 * asum), p2 = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                p = q8_dot_u(p, lo[c], _mm256_set1_epi32(aw[c]));
                p2 = q8_dot_u(p2, hi[c], _mm256_set1_epi32(aw[4 + c]));
            }
            p = _mm256_add_epi32(p, p2);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sc, _mm256_set1_ps(da[(long)m * nb + b])),
                                     acc[m]);
        }
    }
    for (int m = 0; m < M; m++) _mm256_storeu_ps(res + 8 * m, acc[m]);
#elif defined(GS_NEON)
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    float32x4_t acc[Q8_ROWS][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wg + (long)b * X8_BLOCK;
        __builtin_prefetch(blk + X8_PF);
        __builtin_prefetch(blk + X8_PF + 64);
        __builtin_prefetch(blk + X8_PF + 128);
        const float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(blk));
        const float32x4_t sc[2] = {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
        int8x16_t lo[4][2], hi[4][2];
        for (int c = 0; c < 4; c++)
            for (int half = 0; half < 2; half++) {
                const uint8x16_t v = vld1q_u8(blk + 16 + 32 * c + 16 * half);
                lo[c][half] = vreinterpretq_s8_u8(vandq_u8(v, m4));
                hi[c][half] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
            }
        for (int m = 0; m < M; m++) {
            const int8_t *a = aq + (long)m * K + 32 * b;
            int32_t aw[8], asum = 0;
            memcpy(aw, a, 32);
            for (int j = 0; j < 32; j++) asum += a[j];
            const float32x4_t dv = vdupq_n_f32(da[(long)m * nb + b]);
            for (int half = 0; half < 2; half++) {
                int32x4_t p = vdupq_n_s32(-8 * asum);
                for (int c = 0; c < 4; c++) {
                    p = vaddq_s32(p, q8_dot16_neon(lo[c][half], vreinterpretq_s8_s32(vdupq_n_s32(aw[c]))));
                    p = vaddq_s32(p, q8_dot16_neon(hi[c][half], vreinterpretq_s8_s32(vdupq_n_s32(aw[4 + c]))));
                }
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
        const uint8_t *blk = wg + (long)b * X8_BLOCK;
        for (int r = 0; r < 8; r++) {
            const float d = f16_to_f32(blk + 2 * r);
            for (int m = 0; m < M; m++) {
                const int8_t *a = aq + (long)m * K + 32 * b;
                int32_t p = 0;
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = blk[16 + 32 * c + 4 * r + i];
                        p += ((int32_t)(byte & 0x0F) - 8) * a[4 * c + i];
                        p += ((int32_t)(byte >> 4) - 8) * a[16 + 4 * c + i];
                    }
                acc[m][r] = fmaf((float)p, d * da[(long)m * nb + b], acc[m][r]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < 8; r++) res[8 * m + r] = acc[m][r];
#endif
}

/* The rows of scheduling unit t (sg->tile rows, a multiple of 8) of an FMT_Q4_0X8 segment, for M rows of
 * int8 activations (aq, da) or, without them, fp32 x (each row rebuilt as Q4_0 into a buffer: correct,
 * not fast; the Python side passes this format only with int8 activations). */
static void x8_tile(const gs_segment *sg, int K, const float *x, int M, const int8_t *aq, const float *da,
                    float *y, long ldy, int t) {
    const int nb = K / 32, N = sg->N;
    const int n0 = t * sg->tile, n1 = n0 + sg->tile < N ? n0 + sg->tile : N;
    if (!aq) {
        const long rb = row_bytes(FMT_Q4_0, K);
        uint8_t *buf = (uint8_t *)malloc((size_t)(n1 - n0) * (size_t)rb);
        if (!buf) return;
        for (int n = n0; n < n1; n++) x8_row_to_q4_0((const uint8_t *)sg->w, K, n, buf + (long)(n - n0) * rb);
        const gs_segment tmp = {FMT_Q4_0, n1 - n0, 32, sg->col + n0, buf, NULL, NULL, n1 - n0};
        qmatmul_tile(FMT_Q4_0, &tmp, K, x, NULL, M, NULL, NULL, y, ldy, 0);
        free(buf);
        return;
    }
    for (int m0 = 0; m0 < M; m0 += Q8_ROWS) {
        const int mm = M - m0 < Q8_ROWS ? M - m0 : Q8_ROWS;
        const int8_t *a = aq + (long)m0 * K;
        const float *d = da + (long)m0 * nb;
        for (int n = n0; n < n1; n += 8) {
            const uint8_t *wg = (const uint8_t *)sg->w + (long)(n >> 3) * nb * X8_BLOCK;
            float res[Q8_ROWS * 8];
            switch (mm) {
                case 1: x8_group(wg, K, a, d, 1, res); break;
                case 2: x8_group(wg, K, a, d, 2, res); break;
                case 3: x8_group(wg, K, a, d, 3, res); break;
                default: x8_group(wg, K, a, d, 4, res); break;
            }
            for (int m = 0; m < mm; m++)
                for (int r = 0; r < 8; r++) y[(long)(m0 + m) * ldy + sg->col + n + r] = res[8 * m + r];
        }
    }
}
