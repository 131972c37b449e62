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
 * whether it is multiplied alone or with other rows (batch invariance). It does not depend on the
 * instruction set either: every path (AVX-512, AVX2+FMA, portable C) computes each output as 16
 * lane accumulators, lane u of block b adding scale * (q0*x0 + q1*x1) (G = 32: one multiply, then
 * fused multiply-adds) or fma(q*scale, x, acc) (G = 16), and reduces the 16 lanes in the same tree
 * (reduce16), so a machine's results do not depend on which path it was built with.
 *
 * Q4_0 as stored (gs_qmatmul_q4_0): N rows of K/32 ggml block_q4_0 (18 bytes: fp16 d, then 16
 * bytes whose low nibbles are values 0..15 and high nibbles values 16..31; value = d * (nibble - 8)),
 * read straight from the file's bytes (0.5625 bytes per weight instead of 1.125 as int8 levels). The
 * nibbles are unpacked in registers and go through exactly the same per-lane operations as int8 levels
 * q = nibble - 8 with scale = (float)d and G = 32, so its output is bit-identical to gs_qmatmul on the
 * converted weights. The tiling is shared: every tile function takes the weight format (FMT_I8,
 * FMT_Q4_0) as a compile-time constant and loads a block through load_block32_* for that format.
 *
 * Paths: AVX-512F when the compiler targets it (and GS_NO_AVX512 is not defined), else AVX2+FMA,
 * else portable C (also forced with -DGS_PORTABLE). gemmaspec.kernels builds with -march=native;
 * GEMMASPEC_ISA=avx2 adds -mno-avx512f so the AVX2 path can be built and measured on an AVX-512 CPU.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if !defined(GS_PORTABLE) && defined(__AVX512F__) && !defined(GS_NO_AVX512)
#define GS_AVX512 1
#elif !defined(GS_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define GS_AVX2 1
#endif
#if defined(GS_AVX512) || defined(GS_AVX2)
#include <immintrin.h>
#endif

const char *gs_isa(void) {
#if defined(GS_AVX512)
    return "avx512";
#elif defined(GS_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

#define MB 4        /* rows of x held in registers together */
#define RS 8        /* stride of the per-tile result buffer (most rows of x per pass) */
#ifdef GS_AVX512
#define MCHUNK 8    /* rows of x per pass over the weights: 1-4 in registers, 5-8 re-read from L1 */
#else
#define MCHUNK 4
#endif
#define NR 4        /* output rows handled together (independent accumulator chains) */
#define NTILE 64   /* output rows per scheduling unit (a multiple of NR) */
#define PF_BYTES 8192 /* software prefetch distance along the weight stream: one core alone cannot
                         keep enough cache misses in flight to read at full memory bandwidth */

/* Weight formats. A tile function sees row r of the weights as wr[r] (int8 levels, or Q4_0 blocks)
 * and sr[r] (its fp32 scales; unused for Q4_0, whose scales sit inside the blocks). */
#define FMT_I8 0
#define FMT_Q4_0 1
#define Q4_0_BYTES 18 /* ggml block_q4_0: fp16 d + 16 bytes of nibbles, 32 values */

static inline long row_bytes(const int fmt, int K) { return fmt == FMT_Q4_0 ? (long)(K / 32) * Q4_0_BYTES : K; }

/* IEEE fp16 (little-endian bytes at p) to fp32, exactly (every fp16 is an fp32). */
static inline float f16_to_f32(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8)); /* little-endian, as GGUF stores it */
#if defined(__F16C__) && (defined(GS_AVX512) || defined(GS_AVX2))
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: man * 2^-24, normalised */
        exp = 127 - 15 + 1;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static void offsets_term(const float *o, int nb, const float *xsum, int M, float *out) {
    /* out[m] = sum_b o[b] * xsum[m, b] */
    for (int m = 0; m < M; m++) {
        float acc = 0.f;
        for (int b = 0; b < nb; b++) acc += o[b] * xsum[(long)m * nb + b];
        out[m] = acc;
    }
}

/* The 16-lane reduction every path uses: (hi8 + lo8), then (hi4 + lo4), then lanes {0+2, 1+3}, then
 * their sum (the tree GCC's _mm512_reduce_add_ps uses, written out so every compiler and ISA agrees). */
static inline float reduce16_scalar(const float a[16]) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = a[i + 8] + a[i];
    for (int j = 0; j < 4; j++) t6[j] = t3[j + 4] + t3[j];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

#if defined(GS_AVX512) || defined(GS_AVX2)
static inline float reduce16(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

/* Prefetch the weight (and scale) streams of nr rows ahead of block b: every 64 bytes of int8 q, and
 * every second 18-byte Q4_0 block (36 bytes, so no cache line of the stream is skipped). */
static inline __attribute__((always_inline)) void prefetch_rows(const int fmt, const void *const wr[],
                                                                const float *const sr[], int nr, int b, int G) {
    if (fmt == FMT_Q4_0) {
        if (b & 1) return;
        for (int r = 0; r < nr; r++)
            _mm_prefetch((const char *)wr[r] + (long)b * Q4_0_BYTES + PF_BYTES, _MM_HINT_T0);
        return;
    }
    const int k = b * G, per_line = 64 / G; /* blocks per cache line of q */
    if (b % per_line) return;
    for (int r = 0; r < nr; r++) {
        _mm_prefetch((const char *)wr[r] + k + PF_BYTES, _MM_HINT_T0);
        if ((b & 15) == 0) _mm_prefetch((const char *)(sr[r] + b + PF_BYTES * 4 / G), _MM_HINT_T0);
    }
}

/* The 32 nibbles of a Q4_0 block's 16 bytes as int8 levels nibble - 8: values 0..15 (low nibbles) in
 * *lo, values 16..31 (high nibbles) in *hi. */
static inline void q4_0_levels(const uint8_t *blk, __m128i *lo, __m128i *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 2));
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    *lo = _mm_sub_epi8(_mm_and_si128(v, mask), eight);
    *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight);
}
#endif

#ifdef GS_AVX512
static inline float reduce512(__m512 a) {
    return reduce16(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

static inline __m512 cvt16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

static inline __m512 load16(const int8_t *p) { return cvt16(_mm_loadu_si128((const __m128i *)p)); }

/* Block b (G = 32) of one weight row: values 0..15 in *w0, 16..31 in *w1, its scale broadcast in *sc. */
static inline __attribute__((always_inline)) void load_block32_512(const int fmt, const void *w, const float *s,
                                                                   int b, __m512 *w0, __m512 *w1, __m512 *sc) {
    if (fmt == FMT_Q4_0) {
        const uint8_t *blk = (const uint8_t *)w + (long)b * Q4_0_BYTES;
        __m128i lo, hi;
        q4_0_levels(blk, &lo, &hi);
        *w0 = cvt16(lo);
        *w1 = cvt16(hi);
        *sc = _mm512_set1_ps(f16_to_f32(blk));
    } else {
        const int8_t *q = (const int8_t *)w + b * 32;
        *w0 = load16(q);
        *w1 = load16(q + 16);
        *sc = _mm512_set1_ps(s[b]);
    }
}

/* res[r*RS + m] = sum_k x[m, k] * scale-applied q[r, k] for NR rows of weights (format fmt).
 * fmt and M are compile-time constants at each call site (always_inline), so the accumulators stay in
 * registers. The operation order for a given (r, m) does not depend on M or on the format. */
static inline __attribute__((always_inline)) void tile_dot(const int fmt, const void *const wr[NR],
                                                           const float *const sr[NR], int K, int G, const float *x,
                                                           long ldx, const int M, float *res) {
    __m512 acc[NR][MB];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
    const int nb = K / G;
    if (fmt == FMT_Q4_0 || G == 32) {
        for (int b = 0; b < nb; b++) {
            const int k = b * 32;
            prefetch_rows(fmt, wr, sr, NR, b, 32);
            __m512 x0[MB], x1[MB];
            for (int m = 0; m < M; m++) {
                x0[m] = _mm512_loadu_ps(x + m * ldx + k);
                x1[m] = _mm512_loadu_ps(x + m * ldx + k + 16);
            }
            for (int r = 0; r < NR; r++) {
                __m512 w0, w1, sc;
                load_block32_512(fmt, wr[r], sr[r], b, &w0, &w1, &sc);
                for (int m = 0; m < M; m++) {
                    __m512 t = _mm512_mul_ps(w0, x0[m]);
                    t = _mm512_fmadd_ps(w1, x1[m], t);
                    acc[r][m] = _mm512_fmadd_ps(t, sc, acc[r][m]);
                }
            }
        }
    } else { /* int8, G == 16 */
        for (int b = 0; b < nb; b++) {
            const int k = b * 16;
            prefetch_rows(fmt, wr, sr, NR, b, 16);
            __m512 x0[MB];
            for (int m = 0; m < M; m++) x0[m] = _mm512_loadu_ps(x + m * ldx + k);
            for (int r = 0; r < NR; r++) {
                const __m512 w = _mm512_mul_ps(load16((const int8_t *)wr[r] + k), _mm512_set1_ps(sr[r][b]));
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(w, x0[m], acc[r][m]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) res[r * RS + m] = reduce512(acc[r][m]);
}

/* Same arithmetic as tile_dot for 2 weight rows and M = 5..8 rows of x (x re-read from L1 instead of
 * held in registers), so a row's result is bit-identical to the M <= 4 path. */
#define MW 8
static inline __attribute__((always_inline)) void tile_dot_wide(const int fmt, const void *const wr[2],
                                                                const float *const sr[2], int K, int G,
                                                                const float *x, long ldx, const int M,
                                                                float *res /* [2][MW] */) {
    __m512 acc[2][MW];
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < MW; m++) acc[r][m] = _mm512_setzero_ps();
    const int nb = K / G;
    if (fmt == FMT_Q4_0 || G == 32) {
        for (int b = 0; b < nb; b++) {
            const int k = b * 32;
            prefetch_rows(fmt, wr, sr, 2, b, 32);
            for (int r = 0; r < 2; r++) {
                __m512 w0, w1, sc;
                load_block32_512(fmt, wr[r], sr[r], b, &w0, &w1, &sc);
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
            prefetch_rows(fmt, wr, sr, 2, b, 16);
            for (int r = 0; r < 2; r++) {
                const __m512 w = _mm512_mul_ps(load16((const int8_t *)wr[r] + k), _mm512_set1_ps(sr[r][b]));
                for (int m = 0; m < M; m++)
                    acc[r][m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * ldx + k), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < M; m++) res[r * MW + m] = reduce512(acc[r][m]);
}
#elif defined(GS_AVX2)
static inline __m256 cvt8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

static inline __m256 load8(const int8_t *p) { return cvt8(_mm_loadl_epi64((const __m128i *)p)); }

/* Block b (G = 32) of one weight row as four 8-lane vectors (values 0-7, 8-15, 16-23, 24-31) and its
 * scale broadcast in *sc. */
static inline __attribute__((always_inline)) void load_block32_256(const int fmt, const void *w, const float *s,
                                                                   int b, __m256 v[4], __m256 *sc) {
    if (fmt == FMT_Q4_0) {
        const uint8_t *blk = (const uint8_t *)w + (long)b * Q4_0_BYTES;
        __m128i lo, hi;
        q4_0_levels(blk, &lo, &hi);
        v[0] = cvt8(lo);
        v[1] = cvt8(_mm_srli_si128(lo, 8));
        v[2] = cvt8(hi);
        v[3] = cvt8(_mm_srli_si128(hi, 8));
        *sc = _mm256_set1_ps(f16_to_f32(blk));
    } else {
        const int8_t *q = (const int8_t *)w + b * 32;
        v[0] = load8(q);
        v[1] = load8(q + 8);
        v[2] = load8(q + 16);
        v[3] = load8(q + 24);
        *sc = _mm256_set1_ps(s[b]);
    }
}

/* R weight rows (R * M <= 4: 8 accumulator registers of the 16 AVX2 has) against M rows of x. Each
 * 16-lane accumulator of the AVX-512 path is a (lo, hi) pair of 8-lane registers here, with the same
 * operations per lane, so results are bit-identical to it. fmt, R and M are compile-time constants
 * at each call site. */
static inline __attribute__((always_inline)) void tile_avx2(const int fmt, const void *const wr[],
                                                            const float *const sr[], const int R, int K, int G,
                                                            const float *x, long ldx, const int M, float *res) {
    __m256 lo[4][4], hi[4][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) lo[r][m] = hi[r][m] = _mm256_setzero_ps();
    const int nb = K / G;
    if (fmt == FMT_Q4_0 || G == 32) {
        for (int b = 0; b < nb; b++) {
            const int k = b * 32;
            prefetch_rows(fmt, wr, sr, R, b, 32);
            for (int r = 0; r < R; r++) {
                __m256 w[4], sc;
                load_block32_256(fmt, wr[r], sr[r], b, w, &sc);
                for (int m = 0; m < M; m++) {
                    const float *xp = x + m * ldx + k;
                    __m256 tl = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
                    __m256 th = _mm256_mul_ps(w[1], _mm256_loadu_ps(xp + 8));
                    tl = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp + 16), tl);
                    th = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp + 24), th);
                    lo[r][m] = _mm256_fmadd_ps(tl, sc, lo[r][m]);
                    hi[r][m] = _mm256_fmadd_ps(th, sc, hi[r][m]);
                }
            }
        }
    } else { /* int8, G == 16 */
        for (int b = 0; b < nb; b++) {
            const int k = b * 16;
            prefetch_rows(fmt, wr, sr, R, b, 16);
            for (int r = 0; r < R; r++) {
                const int8_t *q = (const int8_t *)wr[r] + k;
                const __m256 sc = _mm256_set1_ps(sr[r][b]);
                const __m256 wl = _mm256_mul_ps(load8(q), sc), wh = _mm256_mul_ps(load8(q + 8), sc);
                for (int m = 0; m < M; m++) {
                    const float *xp = x + m * ldx + k;
                    lo[r][m] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xp), lo[r][m]);
                    hi[r][m] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xp + 8), hi[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) res[r * RS + m] = reduce16(lo[r][m], hi[r][m]);
}
#else
/* Block b of one weight row as int8 levels and its scale: int8 rows point into q (G values), Q4_0
 * blocks are unpacked into buf (32 values). */
static inline __attribute__((always_inline)) const int8_t *load_block_portable(const int fmt, const void *w,
                                                                              const float *s, int b, int G,
                                                                              int8_t buf[32], float *sc) {
    if (fmt == FMT_Q4_0) {
        const uint8_t *blk = (const uint8_t *)w + (long)b * Q4_0_BYTES;
        for (int j = 0; j < 16; j++) {
            buf[j] = (int8_t)((blk[2 + j] & 0x0F) - 8);
            buf[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
        }
        *sc = f16_to_f32(blk);
        return buf;
    }
    *sc = s[b];
    return (const int8_t *)w + b * G;
}

/* Portable C: the same per-lane operations (fmaf is a fused multiply-add, as the SIMD paths use) and
 * the same reduction, one weight row at a time (each block loaded once for all M <= MCHUNK rows of x).
 * The reference the SIMD paths are tested against. */
static inline __attribute__((always_inline)) void tile_portable(const int fmt, const void *w, const float *s,
                                                                int K, int G, const float *x, long ldx, int M,
                                                                float *res) {
    if (fmt == FMT_Q4_0) G = 32;
    const int nb = K / G;
    float acc[MCHUNK][16] = {{0}};
    for (int b = 0; b < nb; b++) {
        const int k = b * G;
        int8_t buf[32];
        float sc;
        const int8_t *q = load_block_portable(fmt, w, s, b, G, buf, &sc);
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * ldx;
            for (int u = 0; u < 16; u++) {
                if (G == 32) {
                    float t = (float)q[u] * xm[k + u];
                    t = fmaf((float)q[16 + u], xm[k + 16 + u], t);
                    acc[m][u] = fmaf(t, sc, acc[m][u]);
                } else {
                    acc[m][u] = fmaf((float)q[u] * sc, xm[k + u], acc[m][u]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++) res[m] = reduce16_scalar(acc[m]);
}
#endif

static inline __attribute__((always_inline)) void tile_dispatch(const int fmt, const void *const wr[NR],
                                                                const float *const sr[NR], int K, int G,
                                                                const float *x, long ldx, int M, float *res) {
#if defined(GS_AVX2)
    switch (M) { /* M <= MCHUNK = 4; R * M <= 4 keeps the accumulators in registers */
        case 1: tile_avx2(fmt, wr, sr, 4, K, G, x, ldx, 1, res); break;
        case 2:
            tile_avx2(fmt, wr, sr, 2, K, G, x, ldx, 2, res);
            tile_avx2(fmt, wr + 2, sr + 2, 2, K, G, x, ldx, 2, res + 2 * RS);
            break;
        case 3:
            for (int r = 0; r < NR; r++) tile_avx2(fmt, wr + r, sr + r, 1, K, G, x, ldx, 3, res + r * RS);
            break;
        default:
            for (int r = 0; r < NR; r++) tile_avx2(fmt, wr + r, sr + r, 1, K, G, x, ldx, 4, res + r * RS);
            break;
    }
    return;
#elif !defined(GS_AVX512)
    for (int r = 0; r < NR; r++) tile_portable(fmt, wr[r], sr[r], K, G, x, ldx, M, res + r * RS);
    return;
#else
    if (M > MB) { /* 5..8 rows: weights converted once for all of them, two rows at a time */
        float w[2 * MW];
        for (int r0 = 0; r0 < NR; r0 += 2) {
            switch (M) {
                case 5: tile_dot_wide(fmt, wr + r0, sr + r0, K, G, x, ldx, 5, w); break;
                case 6: tile_dot_wide(fmt, wr + r0, sr + r0, K, G, x, ldx, 6, w); break;
                case 7: tile_dot_wide(fmt, wr + r0, sr + r0, K, G, x, ldx, 7, w); break;
                default: tile_dot_wide(fmt, wr + r0, sr + r0, K, G, x, ldx, 8, w); break;
            }
            for (int r = 0; r < 2; r++)
                for (int m = 0; m < M; m++) res[(r0 + r) * RS + m] = w[r * MW + m];
        }
        return;
    }
    switch (M) {
        case 1: tile_dot(fmt, wr, sr, K, G, x, ldx, 1, res); break;
        case 2: tile_dot(fmt, wr, sr, K, G, x, ldx, 2, res); break;
        case 3: tile_dot(fmt, wr, sr, K, G, x, ldx, 3, res); break;
        default: tile_dot(fmt, wr, sr, K, G, x, ldx, 4, res); break;
    }
#endif
}

/* Output rows of scheduling unit t (NTILE rows) for every row of x: the body of the parallel loop of
 * gs_qmatmul and gs_qmatmul_q4_0, with fmt a compile-time constant at both. w: the weight rows (format
 * fmt), s/o: int8 scales and offsets (NULL for Q4_0; o NULL when absent). */
static inline __attribute__((always_inline)) void qmatmul_tile(const int fmt, const void *w, const float *s,
                                                               const float *o, int N, int K, int G,
                                                               const float *x, const float *xsum, int M,
                                                               float *y, int t) {
    const int nb = K / G;
    const long stride = row_bytes(fmt, K);
    const int n0 = t * NTILE, n1 = n0 + NTILE < N ? n0 + NTILE : N;
    for (int m0 = 0; m0 < M; m0 += MCHUNK) {
        const int mm = M - m0 < MCHUNK ? M - m0 : MCHUNK;
        for (int n = n0; n < n1; n += NR) {
            const void *wr[NR];
            const float *sr[NR];
            for (int r = 0; r < NR; r++) { /* rows past the end repeat the last row */
                const long row = n + r < N ? n + r : N - 1;
                wr[r] = (const char *)w + row * stride;
                sr[r] = s ? s + row * nb : NULL;
            }
            float res[NR * RS], off[RS];
            tile_dispatch(fmt, wr, sr, K, G, x + (long)m0 * K, K, mm, res);
            for (int r = 0; r < NR && n + r < n1; r++) {
                if (o) offsets_term(o + (long)(n + r) * nb, nb, xsum + (long)m0 * nb, mm, off);
                for (int m = 0; m < mm; m++)
                    y[(long)(m0 + m) * N + n + r] = res[r * RS + m] + (o ? off[m] : 0.f);
            }
        }
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
    const int ntiles = (N + NTILE - 1) / NTILE;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int t = 0; t < ntiles; t++) qmatmul_tile(FMT_I8, q, s, o, N, K, G, x, xsum, M, y, t);
}

/* y [M, N] fp32 = x [M, K] fp32 @ W^T for W stored as Q4_0: blocks holds N rows of K/32 ggml
 * block_q4_0 (18 bytes each, as in the GGUF file); K a multiple of 32. Bit-identical to gs_qmatmul on
 * the same weights as int8 levels nibble - 8 with fp32 scales d and G = 32. */
void gs_qmatmul_q4_0(const uint8_t *blocks, int N, int K, const float *x, int M, float *y, int nthreads) {
    const int ntiles = (N + NTILE - 1) / NTILE;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int t = 0; t < ntiles; t++) qmatmul_tile(FMT_Q4_0, blocks, NULL, NULL, N, K, 32, x, NULL, M, y, t);
}

/* out [N, K] fp32 = W, for large-M products that go through a dense matmul. */
void gs_dequant(const int8_t *q, const float *s, const float *o, int N, int K, int G, float *out,
                int nthreads) {
    const int nb = K / G;
#pragma omp parallel for schedule(dynamic, 64) num_threads(nthreads)
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const float sc = s[(long)n * nb + b], of = o ? o[(long)n * nb + b] : 0.f;
            for (int j = 0; j < G; j++) {
                const long k = (long)n * K + b * G + j;
                out[k] = sc * (float)q[k] + of;
            }
        }
}

/* out [n1 - n0, K] fp32 = rows n0..n1-1 of a Q4_0 matrix (blocks: all its rows, as in the file), the
 * same values gs_dequant gives for the converted int8 form (d * (nibble - 8) + 0). */
void gs_dequant_q4_0(const uint8_t *blocks, int n0, int n1, int K, float *out, int nthreads) {
    const int nb = K / 32;
#pragma omp parallel for schedule(dynamic, 64) num_threads(nthreads)
    for (int n = n0; n < n1; n++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = blocks + ((long)n * nb + b) * Q4_0_BYTES;
            const float sc = f16_to_f32(blk);
            float *o = out + (long)(n - n0) * K + b * 32;
            for (int j = 0; j < 16; j++) {
                o[j] = sc * (float)((blk[2 + j] & 0x0F) - 8) + 0.f;
                o[j + 16] = sc * (float)((blk[2 + j] >> 4) - 8) + 0.f;
            }
        }
}
