/*
 * gemmaspec CPU kernels: products of fp32 activations with block-quantized int8 weights.
 *
 * Weight layout ("int8 blocks"): q int8 [N, K] (row n = output feature n, along the input dim K),
 * scale fp32 [N, K/G] and optional offset fp32 [N, K/G], with G = 16 or 32. Weight value:
 *     W[n, k] = scale[n, k/G] * q[n, k] + offset[n, k/G]
 * Every GGML block format whose values are small integers times a per-block scale (Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, and the K-quants Q4_K, Q5_K, Q6_K, whose sub-blocks are 16 or 32 wide) maps
 * onto this layout without rounding, so the product is the exact dequantized weight times fp32 x.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k]   (fp32 accumulation; activations are never quantized).
 *
 * The per-(m, n) order of operations does not depend on M: a row of x gives bit-identical output
 * whether it is multiplied alone or with other rows (batch invariance).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MB 4        /* rows of x held in registers together */
#define RS 8        /* stride of the per-tile result buffer (most rows of x per pass) */
#ifdef __AVX512F__
#define MCHUNK 8    /* rows of x per pass over the weights: 1-4 in registers, 5-8 re-read from L1 */
#else
#define MCHUNK 4
#endif
#define NR 4        /* output rows handled together (independent accumulator chains) */
#define NTILE 64   /* output rows per scheduling unit (a multiple of NR) */
#define PF_BYTES 8192 /* software prefetch distance along the weight stream: one core alone cannot
                         keep enough cache misses in flight to read at full memory bandwidth */

static void offsets_term(const float *o, int nb, const float *xsum, int M, float *out) {
    /* out[m] = sum_b o[b] * xsum[m, b] */
    for (int m = 0; m < M; m++) {
        float acc = 0.f;
        for (int b = 0; b < nb; b++) acc += o[b] * xsum[(long)m * nb + b];
        out[m] = acc;
    }
}

#ifdef __AVX512F__
/* Prefetch the weight and scale streams of nr rows ahead of block b (every 64 bytes of q). */
static inline __attribute__((always_inline)) void prefetch_rows(const int8_t *const qr[], const float *const sr[],
                                                                int nr, int b, int G) {
    const int k = b * G, per_line = 64 / G; /* blocks per cache line of q */
    if (b % per_line) return;
    for (int r = 0; r < nr; r++) {
        _mm_prefetch((const char *)(qr[r] + k + PF_BYTES), _MM_HINT_T0);
        if ((b & 15) == 0) _mm_prefetch((const char *)(sr[r] + b + PF_BYTES * 4 / G), _MM_HINT_T0);
    }
}

static inline __m512 load16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* res[r*RS + m] = sum_k x[m, k] * scale-applied q[r, k] for NR rows of q (row stride K).
 * M is a compile-time constant at each call site (always_inline), so the accumulators stay in
 * registers. The operation order for a given (r, m) does not depend on M. */
static inline __attribute__((always_inline)) void tile_dot(const int8_t *const qr[NR], const float *const sr[NR],
                                                           int K, int G, const float *x, long ldx, const int M,
                                                           float *res) {
    __m512 acc[NR][MB];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
    const int nb = K / G;
    if (G == 32) {
        for (int b = 0; b < nb; b++) {
            const int k = b * 32;
            prefetch_rows(qr, sr, NR, b, 32);
            __m512 x0[MB], x1[MB];
            for (int m = 0; m < M; m++) {
                x0[m] = _mm512_loadu_ps(x + m * ldx + k);
                x1[m] = _mm512_loadu_ps(x + m * ldx + k + 16);
            }
            for (int r = 0; r < NR; r++) {
                const __m512 w0 = load16(qr[r] + k), w1 = load16(qr[r] + k + 16);
                const __m512 sc = _mm512_set1_ps(sr[r][b]);
                for (int m = 0; m < M; m++) {
                    __m512 t = _mm512_mul_ps(w0, x0[m]);
                    t = _mm512_fmadd_ps(w1, x1[m], t);
                    acc[r][m] = _mm512_fmadd_ps(t, sc, acc[r][m]);
                }
            }
        }
    } else { /* G == 16 */
        for (int b = 0; b < nb; b++) {
            const int k = b * 16;
            prefetch_rows(qr, sr, NR, b, 16);
            __m512 x0[MB];
            for (int m = 0; m < M; m++) x0[m] = _mm512_loadu_ps(x + m * ldx + k);
            for (int r = 0; r < NR; r++) {
                const __m512 w = _mm512_mul_ps(load16(qr[r] + k), _mm512_set1_ps(sr[r][b]));
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(w, x0[m], acc[r][m]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) res[r * RS + m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* Same arithmetic as tile_dot for 2 rows of q and M = 5..8 rows of x (x re-read from L1 instead of
 * held in registers), so a row's result is bit-identical to the M <= 4 path. */
#define MW 8
static inline __attribute__((always_inline)) void tile_dot_wide(const int8_t *const qr[2], const float *const sr[2],
                                                                int K, int G, const float *x, long ldx, const int M,
                                                                float *res /* [2][MW] */) {
    __m512 acc[2][MW];
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < MW; m++) acc[r][m] = _mm512_setzero_ps();
    const int nb = K / G;
    if (G == 32) {
        for (int b = 0; b < nb; b++) {
            const int k = b * 32;
            prefetch_rows(qr, sr, 2, b, 32);
            for (int r = 0; r < 2; r++) {
                const __m512 w0 = load16(qr[r] + k), w1 = load16(qr[r] + k + 16);
                const __m512 sc = _mm512_set1_ps(sr[r][b]);
                for (int m = 0; m < M; m++) {
                    __m512 t = _mm512_mul_ps(w0, _mm512_loadu_ps(x + m * ldx + k));
                    t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * ldx + k + 16), t);
                    acc[r][m] = _mm512_fmadd_ps(t, sc, acc[r][m]);
                }
            }
        }
    } else {
        for (int b = 0; b < nb; b++) {
            const int k = b * 16;
            prefetch_rows(qr, sr, 2, b, 16);
            for (int r = 0; r < 2; r++) {
                const __m512 w = _mm512_mul_ps(load16(qr[r] + k), _mm512_set1_ps(sr[r][b]));
                for (int m = 0; m < M; m++)
                    acc[r][m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * ldx + k), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < M; m++) res[r * MW + m] = _mm512_reduce_add_ps(acc[r][m]);
}
#else
static inline void tile_dot(const int8_t *const qr[NR], const float *const sr[NR], int K, int G,
                            const float *x, long ldx, const int M, float *res) {
    const int nb = K / G;
    for (int r = 0; r < NR; r++) {
        float acc[MB][16] = {{0}};
        for (int b = 0; b < nb; b++) {
            float t[MB][16] = {{0}};
            for (int j = 0; j < G; j += 16) {
                const int k = b * G + j;
                for (int m = 0; m < M; m++)
                    for (int u = 0; u < 16; u++) t[m][u] += (float)qr[r][k + u] * x[m * ldx + k + u];
            }
            for (int m = 0; m < M; m++)
                for (int u = 0; u < 16; u++) acc[m][u] += t[m][u] * sr[r][b];
        }
        for (int m = 0; m < M; m++) {
            float v = 0.f;
            for (int u = 0; u < 16; u++) v += acc[m][u];
            res[r * RS + m] = v;
        }
    }
}
#endif

static void tile_dispatch(const int8_t *const qr[NR], const float *const sr[NR], int K, int G,
                          const float *x, long ldx, int M, float *res) {
#ifdef __AVX512F__
    if (M > MB) { /* 5..8 rows: weights converted once for all of them, two q rows at a time */
        float w[2 * MW];
        for (int r0 = 0; r0 < NR; r0 += 2) {
            switch (M) {
                case 5: tile_dot_wide(qr + r0, sr + r0, K, G, x, ldx, 5, w); break;
                case 6: tile_dot_wide(qr + r0, sr + r0, K, G, x, ldx, 6, w); break;
                case 7: tile_dot_wide(qr + r0, sr + r0, K, G, x, ldx, 7, w); break;
                default: tile_dot_wide(qr + r0, sr + r0, K, G, x, ldx, 8, w); break;
            }
            for (int r = 0; r < 2; r++)
                for (int m = 0; m < M; m++) res[(r0 + r) * RS + m] = w[r * MW + m];
        }
        return;
    }
#endif
    switch (M) {
        case 1: tile_dot(qr, sr, K, G, x, ldx, 1, res); break;
        case 2: tile_dot(qr, sr, K, G, x, ldx, 2, res); break;
        case 3: tile_dot(qr, sr, K, G, x, ldx, 3, res); break;
        default: tile_dot(qr, sr, K, G, x, ldx, 4, res); break;
    }
}

/* xsum[m, b] = sum of x[m, b*G : (b+1)*G]; needed only when offsets are present. */
void gs_block_sums(const float *x, int M, int K, int G, float *xsum) {
    const int nb = K / G;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            float a = 0.f;
            for (int j = 0; j < G; j++) a += x[(long)m * K + b * G + j];
            xsum[(long)m * nb + b] = a;
        }
}

/* y [M, N] fp32 = x [M, K] fp32 @ W^T; see the header comment for W. o and xsum may be NULL. */
void gs_qmatmul(const int8_t *q, const float *s, const float *o, int N, int K, int G,
                const float *x, const float *xsum, int M, float *y, int nthreads) {
    const int nb = K / G;
    const int ntiles = (N + NTILE - 1) / NTILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * NTILE, n1 = n0 + NTILE < N ? n0 + NTILE : N;
        for (int m0 = 0; m0 < M; m0 += MCHUNK) {
            const int mm = M - m0 < MCHUNK ? M - m0 : MCHUNK;
            for (int n = n0; n < n1; n += NR) {
                const int8_t *qr[NR];
                const float *sr[NR];
                for (int r = 0; r < NR; r++) { /* rows past the end repeat the last row */
                    const long row = n + r < N ? n + r : N - 1;
                    qr[r] = q + row * K;
                    sr[r] = s + row * nb;
                }
                float res[NR * RS], off[RS];
                tile_dispatch(qr, sr, K, G, x + (long)m0 * K, K, mm, res);
                for (int r = 0; r < NR && n + r < n1; r++) {
                    if (o) offsets_term(o + (long)(n + r) * nb, nb, xsum + (long)m0 * nb, mm, off);
                    for (int m = 0; m < mm; m++)
                        y[(long)(m0 + m) * N + n + r] = res[r * RS + m] + (o ? off[m] : 0.f);
                }
            }
        }
    }
}

/* out [N, K] fp32 = W, for large-M products that go through a dense matmul. */
void gs_dequant(const int8_t *q, const float *s, const float *o, int N, int K, int G, float *out,
                int nthreads) {
    const int nb = K / G;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const float sc = s[(long)n * nb + b], of = o ? o[(long)n * nb + b] : 0.f;
            for (int j = 0; j < G; j++) {
                const long k = (long)n * K + b * G + j;
                out[k] = sc * (float)q[k] + of;
            }
        }
}
