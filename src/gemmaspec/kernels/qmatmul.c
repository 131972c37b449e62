/*
 * gemmaspec CPU kernels: products of fp32 activations with block-quantized weights, read as stored.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k]   (fp32 accumulation; fp32 activations, or int8 ones in the
 * opt-in products of qdot8.h).
 *
 * Weight formats (fmt), each holding row n of W (output feature n, along the input dim K):
 *   FMT_I8   int8 levels q [N, K], fp32 scale [N, K/G] and optional fp32 offset [N, K/G], G = 16 or 32:
 *            W[n, k] = scale[n, k/G] * q[n, k] + offset[n, k/G]  (the form every GGML block type
 *            converts to without rounding; see ggml_blocks.py).
 *   FMT_Q4_0, FMT_Q8_0, FMT_Q5_0, FMT_Q4_K, FMT_Q6_K: the ggml blocks exactly as stored in a GGUF file
 *            (ggml-common.h: block_q4_0 18 bytes / 32 values, block_q8_0 34 / 32, block_q5_0 22 / 32,
 *            block_q4_K 144 / 256, block_q6_K 210 / 256), rows of K / block-size blocks.
 * A stored block is unpacked in registers into the same int8 levels, fp32 scale (and offset) that the
 * int8 form holds for it (Q4_0: nibble - 8, scale d; Q8_0: q, d; Q5_0: (nibble | bit << 4) - 16, d;
 * Q4_K: sub-block j of 32: nibble, scale d * sc_j, offset -(dmin * m_j); Q6_K: sub-block of 16:
 * (low4 | high2 << 4) - 32, scale d * sc), and then goes through exactly the same fp32 operations,
 * so every format gives bit-identical results to FMT_I8 on its converted weights.
 *
 * Order of operations per (m, n), the same on every path and for every M (batch invariance: a row of
 * x gives the same bits multiplied alone or with other rows): 16 lane accumulators; for G = 32, lane u
 * of block b adds scale * (q_u * x_u + q_{16+u} * x_{16+u}) (one multiply, then fused multiply-adds);
 * for G = 16, fma(q_u * scale, x_u, acc); the 16 lanes are reduced in one fixed tree (reduce16); the
 * offset term sum_b offset_b * sum(x over block b) is added last.
 *
 * Paths: AVX-512F when the compiler targets it (and GS_NO_AVX512 is not defined), else AVX2+FMA,
 * else ARM NEON (AArch64), else portable C (also forced with -DGS_PORTABLE). All keep the order above,
 * so they agree bit for bit. (Dot-product instructions such as AVX-512 VNNI or ARM's dotprod multiply
 * int8 by int8; with fp32 activations they do not apply. They do in the opt-in int8-activation
 * products, gs_qmatmul_multi_q8, qdot8.h: llama.cpp's numerics, same bits on every path too.) gemmaspec.kernels builds with -march=native;
 * GEMMASPEC_ISA=avx2 adds -mno-avx512f so the AVX2 path can be built and measured on an AVX-512 CPU.
 * Block formats: ggml's ggml-common.h, as documented by the gguf package (gguf/quants.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#if !defined(GS_PORTABLE) && defined(__AVX512F__) && !defined(GS_NO_AVX512)
#define GS_AVX512 1
#elif !defined(GS_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define GS_AVX2 1
#elif !defined(GS_PORTABLE) && defined(__aarch64__) && defined(__ARM_NEON)
#define GS_NEON 1
#endif
#if defined(GS_AVX512) || defined(GS_AVX2)
#include <immintrin.h>
#endif
#ifdef GS_NEON
#include <arm_neon.h>
#endif

/* The pool's self-check (tests/test_pool_and_ops.py): `jobs` back-to-back jobs of 2..8 tiny tasks on
 * `nthreads` threads, each task counting its runs; returns how many tasks had not run exactly once when
 * gs_parallel returned (0 when every job gives each task once and returns only after all finished). */
typedef struct { _Atomic int *runs; int spin; } gs_check_ctx;

static void gs_check_task(void *c, int t) {
    const gs_check_ctx *x = c;
    for (volatile int i = 0; i < x->spin; i++) {
    }
    atomic_fetch_add(&x->runs[t], 1);
}

long gs_pool_check(long jobs, int nthreads) {
    static _Atomic int runs[2][8];
    long bad = 0;
    for (long j = 0; j < jobs; j++) {
        _Atomic int *r = runs[j & 1];
        const int n = 2 + (int)(j % 7);
        for (int t = 0; t < 8; t++) atomic_store(&r[t], 0);
        gs_check_ctx c = {r, (int)(j % 5) * 20};
        gs_parallel(n, nthreads, gs_check_task, &c);
        for (int t = 0; t < n; t++) bad += atomic_load(&r[t]) != 1;
    }
    return bad;
}

const char *gs_isa(void) {
#if defined(GS_AVX512)
    return "avx512";
#elif defined(GS_AVX2)
    return "avx2";
#elif defined(GS_NEON)
    return "neon";
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
#ifndef NTILE
#define NTILE 64   /* output rows per scheduling unit (a multiple of NR and of 8) */
#endif
#ifndef NTILE_BIG
#define NTILE_BIG 512 /* ... for matrices of at least BIG_ROWS rows (the head): longer runs of one
                         sequential stream per thread, which two threads read faster from DRAM */
#endif
#define BIG_ROWS 16384
#ifndef PF_BYTES
#define PF_BYTES 8192 /* software prefetch distance along the weight stream: one core alone cannot
                         keep enough cache misses in flight to read at full memory bandwidth */
#endif

/* Weight formats (the numbers gemmaspec.kernels passes). */
#define FMT_I8 0
#define FMT_Q4_0 1
#define FMT_Q8_0 2
#define FMT_Q5_0 3
#define FMT_Q4_K 4
#define FMT_Q6_K 5
#define Q4_0_BYTES 18
#define Q8_0_BYTES 34
#define Q5_0_BYTES 22
#define Q4_K_BYTES 144
#define Q6_K_BYTES 210
/* Q4_0 and Q8_0 rows regrouped 8 at a time for the fp32-activation products (r8.h): group g, block b
 * at byte (g * nb + b) * 8 * (block bytes): the 8 rows' fp16 scales, then each row's level bytes in
 * turn (16 for Q4_0, 32 for Q8_0), so the same size as stored. (FMT 6 and 7: x8.h.) */
#define FMT_Q4_0R8 8
#define FMT_Q8_0R8 9
#define R8_Q4_BYTES (8 * Q4_0_BYTES)
#define R8_Q8_BYTES (8 * Q8_0_BYTES)
static inline int fmt_r8(const int fmt) { return fmt == FMT_Q4_0R8 || fmt == FMT_Q8_0R8; }

/* Values per scale (G) of a format; FMT_I8 carries its own. */
static inline int fmt_group(const int fmt, int G) { return fmt == FMT_I8 ? G : fmt == FMT_Q6_K ? 16 : 32; }

static inline int fmt_has_offsets(const int fmt, const float *o) { return fmt == FMT_Q4_K || (fmt == FMT_I8 && o); }

/* Bytes of one row of K values. */
static inline long row_bytes(const int fmt, int K) {
    switch (fmt) {
        case FMT_Q4_0: return (long)(K / 32) * Q4_0_BYTES;
        case FMT_Q8_0: return (long)(K / 32) * Q8_0_BYTES;
        case FMT_Q5_0: return (long)(K / 32) * Q5_0_BYTES;
        case FMT_Q4_K: return (long)(K / 256) * Q4_K_BYTES;
        case FMT_Q6_K: return (long)(K / 256) * Q6_K_BYTES;
        default: return K;
    }
}

/* Approximate byte position of group-block b in a row, and bytes per group-block (for prefetching). */
static inline int fmt_block_bytes(const int fmt, int G) {
    switch (fmt) {
        case FMT_Q4_0: return Q4_0_BYTES;
        case FMT_Q8_0: return Q8_0_BYTES;
        case FMT_Q5_0: return Q5_0_BYTES;
        case FMT_Q4_K: return Q4_K_BYTES / 8;
        case FMT_Q6_K: return Q6_K_BYTES / 16 + 1;
        case FMT_Q4_0R8: return R8_Q4_BYTES; /* a group's block: one stream for its 8 rows */
        case FMT_Q8_0R8: return R8_Q8_BYTES;
        default: return G;
    }
}

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

/* Q4_K sub-block j (0..7) of a super-block: its 6-bit scale and min from the 12 packed bytes. */
static inline void q4_k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* All 8 scales and mins of a Q4_K super-block (the 12 packed bytes at s) at once, with 32-bit word
 * operations: the same values as q4_k_scale_min for j = 0..7. */
static inline void q4_k_unpack(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a0, a1, a2, t[4];
    memcpy(&a0, s, 4);
    memcpy(&a1, s + 4, 4);
    memcpy(&a2, s + 8, 4);
    t[0] = a0 & 0x3f3f3f3fu;                                        /* sc 0..3 */
    t[1] = (a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4);    /* sc 4..7 */
    t[2] = a1 & 0x3f3f3f3fu;                                        /* min 0..3 */
    t[3] = ((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4); /* min 4..7 */
    memcpy(sc, t, 8);
    memcpy(mn, t + 2, 8);
}

/* Scale of group-block b of one stored row (G = 32 formats; Q6_K: b counts blocks of 16). */
static inline float stored_scale(const int fmt, const uint8_t *w, int b) {
    switch (fmt) {
        case FMT_Q4_0: return f16_to_f32(w + (long)b * Q4_0_BYTES);
        case FMT_Q8_0: return f16_to_f32(w + (long)b * Q8_0_BYTES);
        case FMT_Q5_0: return f16_to_f32(w + (long)b * Q5_0_BYTES);
        case FMT_Q4_K: {
            const uint8_t *blk = w + (long)(b >> 3) * Q4_K_BYTES;
            int sc, m;
            q4_k_scale_min(blk + 4, b & 7, &sc, &m);
            return f16_to_f32(blk) * (float)sc;
        }
        default: { /* FMT_Q6_K */
            const uint8_t *blk = w + (long)(b >> 4) * Q6_K_BYTES;
            return f16_to_f32(blk + 208) * (float)(int8_t)blk[192 + (b & 15)];
        }
    }
}

/* Group-blocks per super-block (K-quants: 8 of 32 values for Q4_K, 16 of 16 for Q6_K; others 1). */
static inline int fmt_per_super(const int fmt) { return fmt == FMT_Q4_K ? 8 : fmt == FMT_Q6_K ? 16 : 1; }

/* Group-blocks unrolled together: Q6_K's 16 per super-block, so that their positions inside it are
 * compile-time constants (immediate shifts and offsets: a third fewer instructions); 1 elsewhere (the
 * gain for Q4_K is small and every unrolled format costs compile time). */
static inline int fmt_unrolled(const int fmt) { return fmt == FMT_Q6_K ? 16 : fmt == FMT_Q4_K ? 8 : 1; }

#ifndef GS_Q5_PERM
#define GS_Q5_PERM 1 /* AVX-512 Q5_0 levels by table lookup (tile_dot); 0 = the cvt16 path, for A/B */
#endif

#ifndef GS_ONE_ROW_FMTS
#define GS_ONE_ROW_FMTS ((1 << FMT_Q8_0) | (1 << FMT_Q5_0))
#endif
/* Whether a product of M rows of x reads one weight row at a time (a single sequential stream that the
 * hardware prefetchers follow) instead of NR interleaved rows (NR independent accumulator chains).
 * Memory-bound formats gain: on a 2-core AMD EPYC (Zen 4, 32 MiB L3) a Q8_0 matrix streamed from DRAM
 * at M = 1 ran 19 GB/s one row at a time against 10 GB/s with 4 interleaved rows (2 threads: 24 vs
 * 12). Q5_0 gains at 2 threads (a Q5_0 matrix from DRAM: 9 -> 12 GB/s); decode of the default model
 * (Q8_0 head, Q5_0/Q4_K/Q6_K layers), medians of 3: 33.3 -> 37.1 tokens/s at 1 thread, 48.6 -> 50.8 at
 * 2 with Q5_0 added; Q4_0 lost (17.5 -> 12.3 GB/s at 2 threads), Q4_K and Q6_K changed nothing
 * measurable, and M >= 3 lost. The order of operations of a (row, m) result is the same either way,
 * so the bits are. GS_ONE_ROW_FMTS (a bit mask of formats) overrides the choice at build time
 * (GEMMASPEC_CFLAGS) for tuning. */
static inline int fmt_one_row(const int fmt, const int M) { return M <= 2 && ((GS_ONE_ROW_FMTS >> fmt) & 1); }

/* for each group-block b < nb, in order (see fmt_unrolled). */
#define FOR_BLOCKS(fmt, nb, b)                                          \
    for (int sb_ = 0; sb_ < (nb) / fmt_unrolled(fmt); sb_++)            \
        _Pragma("GCC unroll 16") for (int j_ = 0, b = sb_ * fmt_unrolled(fmt); j_ < fmt_unrolled(fmt); j_++, b++)

/* The scales of every group-block of super-block sb of one row (K-quants), computed once per
 * super-block by the SIMD paths: ks[j] = stored_scale(fmt, w, sb * per + j), the same expression. */
static inline void super_scales(const int fmt, const uint8_t *w, int sb, float ks[16]) {
    if (fmt == FMT_Q4_K) {
        const uint8_t *blk = w + (long)sb * Q4_K_BYTES;
        const float d = f16_to_f32(blk);
        uint8_t sc[8], mn[8];
        q4_k_unpack(blk + 4, sc, mn);
#if defined(GS_AVX512) || defined(GS_AVX2)
        /* the same 8 products, in one vector multiply */
        _mm256_storeu_ps(ks, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                                  _mm_loadl_epi64((const __m128i *)sc)))));
#else
        for (int j = 0; j < 8; j++) ks[j] = d * (float)sc[j];
#endif
    } else if (fmt == FMT_Q6_K) {
        const uint8_t *blk = w + (long)sb * Q6_K_BYTES;
        const float d = f16_to_f32(blk + 208);
#if defined(GS_AVX512) || defined(GS_AVX2)
        /* the same 16 products, 8 at a time */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 dv = _mm256_set1_ps(d);
        _mm256_storeu_ps(ks, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(ks + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#else
        for (int j = 0; j < 16; j++) ks[j] = d * (float)(int8_t)blk[192 + j];
#endif
    }
}

/* Offset of group-block b: FMT_I8 from o (0 when absent), Q4_K -(dmin * m_j), others 0. */
static inline float block_offset(const int fmt, const void *w, const float *o, int b) {
    if (fmt == FMT_Q4_K) {
        const uint8_t *blk = (const uint8_t *)w + (long)(b >> 3) * Q4_K_BYTES;
        int sc, m;
        q4_k_scale_min(blk + 4, b & 7, &sc, &m);
        return -(f16_to_f32(blk + 2) * (float)m);
    }
    return (fmt == FMT_I8 && o) ? o[b] : 0.f;
}

/* Levels of group-block b of one row as int8, portable C (the reference unpacking; also used by the
 * dequantizers): G values into q, their scale into *sc. */
static inline void levels_scalar(const int fmt, const void *wv, const float *s, int b, int G, int8_t q[32],
                                 float *sc) {
    const uint8_t *w = (const uint8_t *)wv;
    switch (fmt) {
        case FMT_Q4_0: {
            const uint8_t *blk = w + (long)b * Q4_0_BYTES;
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)((blk[2 + j] & 0x0F) - 8);
                q[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
            }
            break;
        }
        case FMT_Q8_0: memcpy(q, w + (long)b * Q8_0_BYTES + 2, 32); break;
        case FMT_Q5_0: {
            const uint8_t *blk = w + (long)b * Q5_0_BYTES;
            const uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) |
                                ((uint32_t)blk[5] << 24);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)(((blk[6 + j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
                q[j + 16] = (int8_t)(((blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
            }
            break;
        }
        case FMT_Q4_K: {
            const uint8_t *qs = w + (long)(b >> 3) * Q4_K_BYTES + 16 + ((b & 7) >> 1) * 32;
            const int shift = 4 * (b & 1);
            for (int j = 0; j < 32; j++) q[j] = (int8_t)((qs[j] >> shift) & 0x0F);
            break;
        }
        case FMT_Q6_K: {
            const uint8_t *blk = w + (long)(b >> 4) * Q6_K_BYTES;
            const int s16 = b & 15, h = s16 >> 3, i = (s16 & 7) >> 1, l0 = (s16 & 1) * 16;
            const uint8_t *ql = blk + h * 64 + (i & 1) * 32 + l0, *qh = blk + 128 + h * 32 + l0;
            for (int j = 0; j < 16; j++)
                q[j] = (int8_t)((((ql[j] >> (4 * (i >> 1))) & 0x0F) | (((qh[j] >> (2 * i)) & 3) << 4)) - 32);
            break;
        }
        default: memcpy(q, (const int8_t *)wv + (long)b * G, G); *sc = s[b]; return;
    }
    *sc = stored_scale(fmt, w, b);
}

static void offsets_term(const int fmt, const void *w, const float *o, int nb, const float *xsum, int M,
                         float *out) {
    /* out[m] = sum_b offset_b * xsum[m, b], b ascending */
    if (fmt == FMT_Q4_K && M <= 8) { /* the offsets of a super-block decoded once for all rows of x */
        float acc[8] = {0};
        for (int sb = 0; sb < nb / 8; sb++) {
            float ob[8]; /* block_offset(FMT_Q4_K, w, NULL, sb * 8 + j), all 8 decoded at once */
            const uint8_t *blk = (const uint8_t *)w + (long)sb * Q4_K_BYTES;
            const float dmin = f16_to_f32(blk + 2);
            uint8_t sc[8], mn[8];
            q4_k_unpack(blk + 4, sc, mn);
#if defined(GS_AVX512) || defined(GS_AVX2)
            _mm256_storeu_ps(ob, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                   _mm_loadl_epi64((const __m128i *)mn)))), _mm256_set1_ps(-0.f)));
#else
            for (int j = 0; j < 8; j++) ob[j] = -(dmin * (float)mn[j]);
#endif
            for (int m = 0; m < M; m++)
                for (int j = 0; j < 8; j++) acc[m] += ob[j] * xsum[(long)m * nb + sb * 8 + j];
        }
        for (int m = 0; m < M; m++) out[m] = acc[m];
        return;
    }
    for (int m = 0; m < M; m++) {
        float acc = 0.f;
        for (int b = 0; b < nb; b++) acc += block_offset(fmt, w, o, b) * xsum[(long)m * nb + b];
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

/* Prefetch the weight (and int8 scale) streams of nr rows ahead of group-block b, once per cache line
 * of the stream. */
static inline __attribute__((always_inline)) void prefetch_rows(const int fmt, const void *const wr[],
                                                                const float *const sr[], int nr, int b, int G) {
    const int bb = fmt_block_bytes(fmt, G);
    const long pos = (long)b * bb;
    if (fmt_r8(fmt)) { /* the rows share one stream: its next cache lines, once */
        for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)wr[0] + pos + PF_BYTES + l, _MM_HINT_T0);
        return;
    }
    if (b && (pos >> 6) == ((pos - bb) >> 6)) return; /* this cache line was prefetched already */
    for (int r = 0; r < nr; r++) {
        _mm_prefetch((const char *)wr[r] + pos + PF_BYTES, _MM_HINT_T0);
        if (fmt == FMT_I8 && (b & 15) == 0) _mm_prefetch((const char *)(sr[r] + b + PF_BYTES * 4 / G), _MM_HINT_T0);
    }
}

/* 16 bits (bit j for byte j) as bytes 0x10 where set, 0 elsewhere (Q5_0's fifth bit). */
static inline __m128i bits_to_0x10(uint32_t bits16) {
    const __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits16),
                                       _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m128i bit = _mm_set_epi8((char)0x80, 64, 32, 16, 8, 4, 2, 1, (char)0x80, 64, 32, 16, 8, 4, 2, 1);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, bit), bit), _mm_set1_epi8(0x10));
}

static inline __m128i nibbles(__m128i v, int shift) {
    return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(0x0F));
}

/* Group-block b (G = 32 formats) of one row as int8 levels: values 0..15 in *lo, 16..31 in *hi; its
 * scale in *sc. The same levels and scale as levels_scalar. */
static inline __attribute__((always_inline)) void levels32(const int fmt, const void *wv, const float *s, int b,
                                                           __m128i *lo, __m128i *hi, float *sc, const float *ks) {
    const uint8_t *w = (const uint8_t *)wv;
    switch (fmt) {
        case FMT_Q4_0: {
            const uint8_t *blk = w + (long)b * Q4_0_BYTES;
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 2)), eight = _mm_set1_epi8(8);
            *lo = _mm_sub_epi8(nibbles(v, 0), eight);
            *hi = _mm_sub_epi8(nibbles(v, 4), eight);
            *sc = f16_to_f32(blk);
            return;
        }
        case FMT_Q8_0: {
            const uint8_t *blk = w + (long)b * Q8_0_BYTES;
            *lo = _mm_loadu_si128((const __m128i *)(blk + 2));
            *hi = _mm_loadu_si128((const __m128i *)(blk + 18));
            *sc = f16_to_f32(blk);
            return;
        }
        case FMT_Q4_0R8: { /* w: the row's level bytes in block 0 of its group; s: its scale there (r8.h) */
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + (long)b * R8_Q4_BYTES)), eight = _mm_set1_epi8(8);
            *lo = _mm_sub_epi8(nibbles(v, 0), eight);
            *hi = _mm_sub_epi8(nibbles(v, 4), eight);
            *sc = f16_to_f32((const uint8_t *)s + (long)b * R8_Q4_BYTES);
            return;
        }
        case FMT_Q8_0R8: {
            const uint8_t *q = w + (long)b * R8_Q8_BYTES;
            *lo = _mm_loadu_si128((const __m128i *)q);
            *hi = _mm_loadu_si128((const __m128i *)(q + 16));
            *sc = f16_to_f32((const uint8_t *)s + (long)b * R8_Q8_BYTES);
            return;
        }
        case FMT_Q5_0: {
            const uint8_t *blk = w + (long)b * Q5_0_BYTES;
            uint32_t qh;
            memcpy(&qh, blk + 2, 4); /* little-endian, as x86 reads it */
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 6)), sixteen = _mm_set1_epi8(16);
#if defined(GS_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__)
            /* nibble - 16, plus 16 where the fifth bit is set: one masked add per 16 values */
            const __m128i l = _mm_sub_epi8(nibbles(v, 0), sixteen), h = _mm_sub_epi8(nibbles(v, 4), sixteen);
            *lo = _mm_mask_add_epi8(l, (__mmask16)(qh & 0xFFFF), l, sixteen);
            *hi = _mm_mask_add_epi8(h, (__mmask16)(qh >> 16), h, sixteen);
#else
            *lo = _mm_sub_epi8(_mm_or_si128(nibbles(v, 0), bits_to_0x10(qh & 0xFFFF)), sixteen);
            *hi = _mm_sub_epi8(_mm_or_si128(nibbles(v, 4), bits_to_0x10(qh >> 16)), sixteen);
#endif
            *sc = f16_to_f32(blk);
            return;
        }
        case FMT_Q4_K: {
            const uint8_t *qs = w + (long)(b >> 3) * Q4_K_BYTES + 16 + ((b & 7) >> 1) * 32;
            const int shift = 4 * (b & 1);
            *lo = nibbles(_mm_loadu_si128((const __m128i *)qs), shift);
            *hi = nibbles(_mm_loadu_si128((const __m128i *)(qs + 16)), shift);
            *sc = ks[b & 7];
            return;
        }
        default: { /* FMT_I8, G = 32 */
            const int8_t *q = (const int8_t *)wv + (long)b * 32;
            *lo = _mm_loadu_si128((const __m128i *)q);
            *hi = _mm_loadu_si128((const __m128i *)(q + 16));
            *sc = s[b];
        }
    }
}

/* Group-block b (G = 16 formats: FMT_I8 with G = 16, Q6_K) of one row as 16 int8 levels and scale. */
static inline __attribute__((always_inline)) __m128i levels16(const int fmt, const void *wv, const float *s, int b,
                                                              float *sc, const float *ks) {
    if (fmt == FMT_Q6_K) {
        const uint8_t *blk = (const uint8_t *)wv + (long)(b >> 4) * Q6_K_BYTES;
        const int s16 = b & 15, h = s16 >> 3, i = (s16 & 7) >> 1, l0 = (s16 & 1) * 16;
        const __m128i ql = _mm_loadu_si128((const __m128i *)(blk + h * 64 + (i & 1) * 32 + l0));
        const __m128i qh = _mm_loadu_si128((const __m128i *)(blk + 128 + h * 32 + l0));
        const __m128i hi2 = _mm_and_si128(_mm_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), _mm_set1_epi8(3));
        *sc = ks[b & 15];
        return _mm_sub_epi8(_mm_or_si128(nibbles(ql, 4 * (i >> 1)), _mm_slli_epi16(hi2, 4)), _mm_set1_epi8(32));
    }
    *sc = s[b];
    return _mm_loadu_si128((const __m128i *)((const int8_t *)wv + (long)b * 16));
}
#endif

#ifdef GS_AVX512
static inline float reduce512(__m512 a) {
    return reduce16(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

static inline __m512 cvt16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

/* res[r*RS + m] = sum_k x[m, k] * scale-applied q[r, k] for NR rows of weights (format fmt).
 * fmt and M are compile-time constants at each call site (always_inline), so the accumulators stay in
 * registers. The operation order for a given (r, m) does not depend on M or on the format. */
static inline __attribute__((always_inline)) void tile_dot(const int fmt, const void *const wr[],
                                                           const float *const sr[], const int R, int K, int G,
                                                           const float *x, long ldx, const int M, float *res) {
    __m512 acc[NR][MB];
    float ks[NR][16];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
    const int nb = K / G;
    const __m512 q4_levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
#if GS_Q5_PERM
    const __m512 q5_lo = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512 q5_hi = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    if (G == 32) {
        FOR_BLOCKS(fmt, nb, b) {
            const int k = b * 32;
            prefetch_rows(fmt, wr, sr, R, b, 32);
            if (fmt_per_super(fmt) > 1 && b % fmt_per_super(fmt) == 0)
                for (int r = 0; r < R; r++) super_scales(fmt, (const uint8_t *)wr[r], b / fmt_per_super(fmt), ks[r]);
            __m512 x0[MB], x1[MB];
            for (int m = 0; m < M; m++) {
                x0[m] = _mm512_loadu_ps(x + m * ldx + k);
                x1[m] = _mm512_loadu_ps(x + m * ldx + k + 16);
            }
            for (int r = 0; r < R; r++) {
                __m512 w0, w1, sc;
                if (fmt == FMT_Q4_0 || fmt == FMT_Q4_0R8) {
                    /* 16 bytes zero-extended to 16 dwords in one load; vpermps reads the low 4 bits of
                     * each dword as an index into the levels table: float(nibble - 8) straight from
                     * the stored byte, the same values cvt16 gives (7 fewer vector uops per block: head of
                     * the all-Q4_0 model 19.1 -> 14.7 ms, 1 thread). (Gathering 16 blocks' scales at once
                     * was slower: gathers are slow on this CPU.) */
                    const int r8 = fmt == FMT_Q4_0R8; /* levels at wr[r], scale at sr[r] (see levels32) */
                    const uint8_t *blk = (const uint8_t *)wr[r] + (long)b * (r8 ? R8_Q4_BYTES : Q4_0_BYTES);
                    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (r8 ? 0 : 2))));
                    w0 = _mm512_permutexvar_ps(q, q4_levels);
                    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), q4_levels);
                    sc = _mm512_set1_ps(f16_to_f32(r8 ? (const uint8_t *)sr[r] + (long)b * R8_Q4_BYTES : blk));
#if GS_Q5_PERM
                } else if (fmt == FMT_Q5_0) {
                    /* the same idea for 5-bit levels: the nibble with the fifth bit or-ed in (a masked
                     * or from the 32 stored bits) indexes a 32-entry table of float(level - 16) held in
                     * two registers (vpermt2ps reads 5 index bits): the values cvt16 gives, in 7 integer
                     * uops per block instead of 11 */
                    const uint8_t *blk = (const uint8_t *)wr[r] + (long)b * Q5_0_BYTES;
                    uint32_t qh;
                    memcpy(&qh, blk + 2, 4); /* little-endian, as x86 reads it */
                    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 6)));
                    const __m512i sixteen = _mm512_set1_epi32(16);
                    const __m512i l = _mm512_and_si512(q, _mm512_set1_epi32(15)), h = _mm512_srli_epi32(q, 4);
                    w0 = _mm512_permutex2var_ps(q5_lo, _mm512_mask_or_epi32(l, (__mmask16)(qh & 0xFFFF), l, sixteen), q5_hi);
                    w1 = _mm512_permutex2var_ps(q5_lo, _mm512_mask_or_epi32(h, (__mmask16)(qh >> 16), h, sixteen), q5_hi);
                    sc = _mm512_set1_ps(f16_to_f32(blk));
#endif
                } else {
                    __m128i lo, hi;
                    float s;
                    levels32(fmt, wr[r], sr[r], b, &lo, &hi, &s, ks[r]);
                    w0 = cvt16(lo), w1 = cvt16(hi), sc = _mm512_set1_ps(s);
                }
                for (int m = 0; m < M; m++) {
                    __m512 t = _mm512_mul_ps(w0, x0[m]);
                    t = _mm512_fmadd_ps(w1, x1[m], t);
                    acc[r][m] = _mm512_fmadd_ps(t, sc, acc[r][m]);
                }
            }
        }
    } else { /* G == 16 */
        FOR_BLOCKS(fmt, nb, b) {
            const int k = b * 16;
            prefetch_rows(fmt, wr, sr, R, b, 16);
            if (fmt_per_super(fmt) > 1 && b % fmt_per_super(fmt) == 0)
                for (int r = 0; r < R; r++) super_scales(fmt, (const uint8_t *)wr[r], b / fmt_per_super(fmt), ks[r]);
            __m512 x0[MB];
            for (int m = 0; m < M; m++) x0[m] = _mm512_loadu_ps(x + m * ldx + k);
            for (int r = 0; r < R; r++) {
                float s;
                const __m128i v = levels16(fmt, wr[r], sr[r], b, &s, ks[r]);
                const __m512 w = _mm512_mul_ps(cvt16(v), _mm512_set1_ps(s));
                for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(w, x0[m], acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
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
    float ks[2][16];
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < MW; m++) acc[r][m] = _mm512_setzero_ps();
    const int nb = K / G;
    if (G == 32) {
        FOR_BLOCKS(fmt, nb, b) {
            const int k = b * 32;
            prefetch_rows(fmt, wr, sr, 2, b, 32);
            if (fmt_per_super(fmt) > 1 && b % fmt_per_super(fmt) == 0)
                for (int r = 0; r < 2; r++) super_scales(fmt, (const uint8_t *)wr[r], b / fmt_per_super(fmt), ks[r]);
            for (int r = 0; r < 2; r++) {
                __m128i lo, hi;
                float s;
                levels32(fmt, wr[r], sr[r], b, &lo, &hi, &s, ks[r]);
                const __m512 w0 = cvt16(lo), w1 = cvt16(hi), sc = _mm512_set1_ps(s);
                for (int m = 0; m < M; m++) {
                    __m512 t = _mm512_mul_ps(w0, _mm512_loadu_ps(x + m * ldx + k));
                    t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * ldx + k + 16), t);
                    acc[r][m] = _mm512_fmadd_ps(t, sc, acc[r][m]);
                }
            }
        }
    } else {
        FOR_BLOCKS(fmt, nb, b) {
            const int k = b * 16;
            prefetch_rows(fmt, wr, sr, 2, b, 16);
            if (fmt_per_super(fmt) > 1 && b % fmt_per_super(fmt) == 0)
                for (int r = 0; r < 2; r++) super_scales(fmt, (const uint8_t *)wr[r], b / fmt_per_super(fmt), ks[r]);
            for (int r = 0; r < 2; r++) {
                float s;
                const __m128i v = levels16(fmt, wr[r], sr[r], b, &s, ks[r]);
                const __m512 w = _mm512_mul_ps(cvt16(v), _mm512_set1_ps(s));
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

#ifndef GS_AVX2_WF32
#define GS_AVX2_WF32 1 /* levels read straight into 32-bit lanes (wf32_avx2); 0 = levels32 + cvt8, for A/B */
#endif
#ifndef GS_Q5_STORE
#define GS_Q5_STORE 0 /* Q5_0's 32 levels widened from a stack copy (1) or from the register (0), for A/B */
#endif
#define LD8(q) _mm_loadl_epi64((const __m128i *)(const void *)(q)) /* 8 bytes: folded into vpmov*xbd */

/* Group-block b (G = 32 formats) of one row as fp32 levels in value order: w[i] = values 8i .. 8i + 7;
 * its scale in *sc. The same exact small integers as levels32, but each 8 levels widened from 8 bytes
 * in memory (vpmovzxbd / vpmovsxbd with a memory operand) instead of from int8 vectors: fewer shuffles,
 * which on AVX2 compete with the FMAs for the same ports. Q5_0 builds its 32 signed levels in one
 * 256-bit register first (the fifth bits spread to bytes by a shuffle and a compare; a clear bit ors
 * 0xF0 into the nibble, which is nibble - 16 in two's complement). */
static inline __attribute__((always_inline)) void wf32_avx2(const int fmt, const void *wv, const float *s, int b,
                                                            __m256 w[4], float *sc, const float *ks) {
    const uint8_t *p = (const uint8_t *)wv;
    switch (fmt) {
        case FMT_Q4_0:
        case FMT_Q4_0R8: {
            const uint8_t *q = fmt == FMT_Q4_0 ? p + (long)b * Q4_0_BYTES + 2 : p + (long)b * R8_Q4_BYTES;
            const __m256i d0 = _mm256_cvtepu8_epi32(LD8(q)), d1 = _mm256_cvtepu8_epi32(LD8(q + 8));
            const __m256i m = _mm256_set1_epi32(15), e = _mm256_set1_epi32(8);
            w[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(d0, m), e));
            w[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(d1, m), e));
            w[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(d0, 4), e));
            w[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(d1, 4), e));
            *sc = fmt == FMT_Q4_0 ? f16_to_f32(p + (long)b * Q4_0_BYTES) : f16_to_f32((const uint8_t *)s + (long)b * R8_Q4_BYTES);
            return;
        }
        case FMT_Q8_0:
        case FMT_Q8_0R8:
        case FMT_I8: {
            const uint8_t *q = fmt == FMT_Q8_0 ? p + (long)b * Q8_0_BYTES + 2
                               : fmt == FMT_Q8_0R8 ? p + (long)b * R8_Q8_BYTES : p + (long)b * 32;
            for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD8(q + 8 * i)));
            *sc = fmt == FMT_Q8_0 ? f16_to_f32(p + (long)b * Q8_0_BYTES)
                  : fmt == FMT_Q8_0R8 ? f16_to_f32((const uint8_t *)s + (long)b * R8_Q8_BYTES) : s[b];
            return;
        }
        case FMT_Q5_0: {
            const uint8_t *blk = p + (long)b * Q5_0_BYTES;
            int32_t qh;
            memcpy(&qh, blk + 2, 4);
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6));
            const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
            const __m256i spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(qh), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                         0x0101010101010101, 0x0000000000000000));
            const __m256i bit = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE)),
                                                  _mm256_set1_epi8(-1));
            const __m256i lv = _mm256_or_si256(nib, _mm256_andnot_si256(bit, _mm256_set1_epi8((char)0xF0)));
#if GS_Q5_STORE
            int8_t t8[32] __attribute__((aligned(32)));
            _mm256_store_si256((__m256i *)t8, lv);
            for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD8(t8 + 8 * i)));
#else
            const __m128i l = _mm256_castsi256_si128(lv), h = _mm256_extracti128_si256(lv, 1);
            w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l));
            w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(l, l)));
            w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h));
            w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(h, h)));
#endif
            *sc = f16_to_f32(blk);
            return;
        }
        default: { /* FMT_Q4_K: sub-block b's 32 nibbles, the low or high ones of 32 bytes */
            const uint8_t *qs = p + (long)(b >> 3) * Q4_K_BYTES + 16 + ((b & 7) >> 1) * 32;
            for (int i = 0; i < 4; i++) {
                const __m256i d = _mm256_cvtepu8_epi32(LD8(qs + 8 * i));
                w[i] = _mm256_cvtepi32_ps(b & 1 ? _mm256_srli_epi32(d, 4) : _mm256_and_si256(d, _mm256_set1_epi32(15)));
            }
            *sc = ks[b & 7];
        }
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
    float ks[4][16];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) lo[r][m] = hi[r][m] = _mm256_setzero_ps();
    const int nb = K / G;
    if (G == 32) {
        FOR_BLOCKS(fmt, nb, b) {
            const int k = b * 32;
            prefetch_rows(fmt, wr, sr, R, b, 32);
            if (fmt_per_super(fmt) > 1 && b % fmt_per_super(fmt) == 0)
                for (int r = 0; r < R; r++) super_scales(fmt, (const uint8_t *)wr[r], b / fmt_per_super(fmt), ks[r]);
            for (int r = 0; r < R; r++) {
                float s;
                __m256 w0, w1, w2, w3;
                if (GS_AVX2_WF32) {
                    __m256 wv[4];
                    wf32_avx2(fmt, wr[r], sr[r], b, wv, &s, ks[r]);
                    w0 = wv[0], w1 = wv[1], w2 = wv[2], w3 = wv[3];
                } else {
                    __m128i ql, qhi;
                    levels32(fmt, wr[r], sr[r], b, &ql, &qhi, &s, ks[r]);
                    w0 = cvt8(ql), w1 = cvt8(_mm_srli_si128(ql, 8)), w2 = cvt8(qhi), w3 = cvt8(_mm_srli_si128(qhi, 8));
                }
                const __m256 sc = _mm256_set1_ps(s);
                for (int m = 0; m < M; m++) {
                    const float *xp = x + m * ldx + k;
                    __m256 tl = _mm256_mul_ps(w0, _mm256_loadu_ps(xp));
                    __m256 th = _mm256_mul_ps(w1, _mm256_loadu_ps(xp + 8));
                    tl = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xp + 16), tl);
                    th = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xp + 24), th);
                    lo[r][m] = _mm256_fmadd_ps(tl, sc, lo[r][m]);
                    hi[r][m] = _mm256_fmadd_ps(th, sc, hi[r][m]);
                }
            }
        }
    } else { /* G == 16 */
        FOR_BLOCKS(fmt, nb, b) {
            const int k = b * 16;
            prefetch_rows(fmt, wr, sr, R, b, 16);
            if (fmt_per_super(fmt) > 1 && b % fmt_per_super(fmt) == 0)
                for (int r = 0; r < R; r++) super_scales(fmt, (const uint8_t *)wr[r], b / fmt_per_super(fmt), ks[r]);
            for (int r = 0; r < R; r++) {
                float s;
                const __m128i v = levels16(fmt, wr[r], sr[r], b, &s, ks[r]);
                const __m256 sc = _mm256_set1_ps(s);
                const __m256 wl = _mm256_mul_ps(cvt8(v), sc), wh = _mm256_mul_ps(cvt8(_mm_srli_si128(v, 8)), sc);
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
#elif defined(GS_NEON)
/* AArch64 NEON: each 16-lane accumulator is four 4-lane registers (lanes 0-3, 4-7, 8-11, 12-15) with
 * the same per-lane operations (vfmaq_f32 is a fused multiply-add) and the same reduction tree. */
static inline float reduce16_neon(const float32x4_t a[4]) {
    const float32x4_t t6 = vaddq_f32(vaddq_f32(a[3], a[1]), vaddq_f32(a[2], a[0]));
    return (vgetq_lane_f32(t6, 0) + vgetq_lane_f32(t6, 2)) + (vgetq_lane_f32(t6, 1) + vgetq_lane_f32(t6, 3));
}

static inline void cvt16_neon(int8x16_t v, float32x4_t out[4]) {
    const int16x8_t l = vmovl_s8(vget_low_s8(v)), h = vmovl_s8(vget_high_s8(v));
    out[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(l)));
    out[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(l)));
    out[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
    out[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)));
}

static inline uint8x16_t nibbles_neon(uint8x16_t v, int shift) {
    return vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)-shift)), vdupq_n_u8(0x0F));
}

/* 16 bits (bit j for byte j) as bytes 0x10 where set (Q5_0's fifth bit). */
static inline uint8x16_t bits_to_0x10_neon(uint32_t bits16) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)(bits16 & 0xFF)), vdup_n_u8((uint8_t)(bits16 >> 8)));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(0x10));
}

static inline __attribute__((always_inline)) void levels32_neon(const int fmt, const void *wv, const float *s, int b,
                                                                int8x16_t *lo, int8x16_t *hi, float *sc,
                                                                const float *ks) {
    const uint8_t *w = (const uint8_t *)wv;
    switch (fmt) {
        case FMT_Q4_0: {
            const uint8_t *blk = w + (long)b * Q4_0_BYTES;
            const uint8x16_t v = vld1q_u8(blk + 2);
            *lo = vsubq_s8(vreinterpretq_s8_u8(nibbles_neon(v, 0)), vdupq_n_s8(8));
            *hi = vsubq_s8(vreinterpretq_s8_u8(nibbles_neon(v, 4)), vdupq_n_s8(8));
            *sc = f16_to_f32(blk);
            return;
        }
        case FMT_Q8_0: {
            const uint8_t *blk = w + (long)b * Q8_0_BYTES;
            *lo = vld1q_s8((const int8_t *)(blk + 2));
            *hi = vld1q_s8((const int8_t *)(blk + 18));
            *sc = f16_to_f32(blk);
            return;
        }
        case FMT_Q5_0: {
            const uint8_t *blk = w + (long)b * Q5_0_BYTES;
            const uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) |
                                ((uint32_t)blk[5] << 24);
            const uint8x16_t v = vld1q_u8(blk + 6);
            *lo = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(nibbles_neon(v, 0), bits_to_0x10_neon(qh & 0xFFFF))),
                           vdupq_n_s8(16));
            *hi = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(nibbles_neon(v, 4), bits_to_0x10_neon(qh >> 16))),
                           vdupq_n_s8(16));
            *sc = f16_to_f32(blk);
            return;
        }
        case FMT_Q4_K: {
            const uint8_t *qs = w + (long)(b >> 3) * Q4_K_BYTES + 16 + ((b & 7) >> 1) * 32;
            const int shift = 4 * (b & 1);
            *lo = vreinterpretq_s8_u8(nibbles_neon(vld1q_u8(qs), shift));
            *hi = vreinterpretq_s8_u8(nibbles_neon(vld1q_u8(qs + 16), shift));
            *sc = ks[b & 7];
            return;
        }
        default: {
            const int8_t *q = (const int8_t *)wv + (long)b * 32;
            *lo = vld1q_s8(q);
            *hi = vld1q_s8(q + 16);
            *sc = s[b];
        }
    }
}

static inline __attribute__((always_inline)) int8x16_t levels16_neon(const int fmt, const void *wv, const float *s,
                                                                     int b, float *sc, const float *ks) {
    if (fmt == FMT_Q6_K) {
        const uint8_t *blk = (const uint8_t *)wv + (long)(b >> 4) * Q6_K_BYTES;
        const int s16 = b & 15, h = s16 >> 3, i = (s16 & 7) >> 1, l0 = (s16 & 1) * 16;
        const uint8x16_t ql = vld1q_u8(blk + h * 64 + (i & 1) * 32 + l0), qh = vld1q_u8(blk + 128 + h * 32 + l0);
        const uint8x16_t hi2 = vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * i))), vdupq_n_u8(3));
        *sc = ks[b & 15];
        return vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(nibbles_neon(ql, 4 * (i >> 1)), vshlq_n_u8(hi2, 4))),
                        vdupq_n_s8(32));
    }
    *sc = s[b];
    return vld1q_s8((const int8_t *)wv + (long)b * 16);
}

/* R weight rows (R * M <= 4) against M rows of x, as tile_avx2. */
static inline __attribute__((always_inline)) void tile_neon(const int fmt, const void *const wr[],
                                                            const float *const sr[], const int R, int K, int G,
                                                            const float *x, long ldx, const int M, float *res) {
    float32x4_t acc[4][4][4];
    float ks[4][16];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) acc[r][m][j] = vdupq_n_f32(0.f);
    const int nb = K / G;
    const int bb = fmt_block_bytes(fmt, G);
    FOR_BLOCKS(fmt, nb, b) {
        const int k = b * G;
        for (int r = 0; r < R; r++) __builtin_prefetch((const char *)wr[r] + (long)b * bb + PF_BYTES);
        if (fmt_per_super(fmt) > 1 && b % fmt_per_super(fmt) == 0)
            for (int r = 0; r < R; r++) super_scales(fmt, (const uint8_t *)wr[r], b / fmt_per_super(fmt), ks[r]);
        for (int r = 0; r < R; r++) {
            float s;
            if (G == 32) {
                int8x16_t ql, qhv;
                levels32_neon(fmt, wr[r], sr[r], b, &ql, &qhv, &s, ks[r]);
                float32x4_t w0[4], w1[4];
                cvt16_neon(ql, w0);
                cvt16_neon(qhv, w1);
                const float32x4_t sc = vdupq_n_f32(s);
                for (int m = 0; m < M; m++) {
                    const float *xp = x + m * ldx + k;
                    for (int j = 0; j < 4; j++) {
                        float32x4_t t = vmulq_f32(w0[j], vld1q_f32(xp + 4 * j));
                        t = vfmaq_f32(t, w1[j], vld1q_f32(xp + 16 + 4 * j));
                        acc[r][m][j] = vfmaq_f32(acc[r][m][j], t, sc);
                    }
                }
            } else {
                float32x4_t w0[4];
                cvt16_neon(levels16_neon(fmt, wr[r], sr[r], b, &s, ks[r]), w0);
                const float32x4_t sc = vdupq_n_f32(s);
                for (int j = 0; j < 4; j++) w0[j] = vmulq_f32(w0[j], sc);
                for (int m = 0; m < M; m++) {
                    const float *xp = x + m * ldx + k;
                    for (int j = 0; j < 4; j++) acc[r][m][j] = vfmaq_f32(acc[r][m][j], w0[j], vld1q_f32(xp + 4 * j));
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) res[r * RS + m] = reduce16_neon(acc[r][m]);
}
#else
/* Portable C: the same per-lane operations (fmaf is a fused multiply-add, as the SIMD paths use) and
 * the same reduction, one weight row at a time (each block unpacked once for all M <= MCHUNK rows of
 * x). The reference the SIMD paths are tested against. */
static inline __attribute__((always_inline)) void tile_portable(const int fmt, const void *w, const float *s,
                                                                int K, int G, const float *x, long ldx, int M,
                                                                float *res) {
    const int nb = K / G;
    float acc[MCHUNK][16] = {{0}};
    for (int b = 0; b < nb; b++) {
        const int k = b * G;
        int8_t q[32];
        float sc;
        levels_scalar(fmt, w, s, b, G, q, &sc);
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
#if defined(GS_AVX512)
#define TILE tile_dot
#elif defined(GS_AVX2)
#define TILE tile_avx2
#elif defined(GS_NEON)
#define TILE tile_neon
#endif
#ifdef TILE /* every SIMD tile function: (fmt, wr, sr, R, K, G, x, ldx, M, res) */
    if (fmt_one_row(fmt, M)) { /* one weight row at a time (see fmt_one_row) */
        for (int r = 0; r < NR; r++) {
            if (M == 1) TILE(fmt, wr + r, sr + r, 1, K, G, x, ldx, 1, res + r * RS);
            else TILE(fmt, wr + r, sr + r, 1, K, G, x, ldx, 2, res + r * RS);
        }
        return;
    }
#endif
#if defined(GS_AVX2) || defined(GS_NEON)
    switch (M) { /* M <= MCHUNK = 4; R * M <= 4 keeps the accumulators in registers */
        case 1: TILE(fmt, wr, sr, 4, K, G, x, ldx, 1, res); break;
        case 2:
            TILE(fmt, wr, sr, 2, K, G, x, ldx, 2, res);
            TILE(fmt, wr + 2, sr + 2, 2, K, G, x, ldx, 2, res + 2 * RS);
            break;
        case 3:
            for (int r = 0; r < NR; r++) TILE(fmt, wr + r, sr + r, 1, K, G, x, ldx, 3, res + r * RS);
            break;
        default:
            for (int r = 0; r < NR; r++) TILE(fmt, wr + r, sr + r, 1, K, G, x, ldx, 4, res + r * RS);
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
        case 1: tile_dot(fmt, wr, sr, NR, K, G, x, ldx, 1, res); break;
        case 2: tile_dot(fmt, wr, sr, NR, K, G, x, ldx, 2, res); break;
        case 3: tile_dot(fmt, wr, sr, NR, K, G, x, ldx, 3, res); break;
        default: tile_dot(fmt, wr, sr, NR, K, G, x, ldx, 4, res); break;
    }
#endif
}

#include "qdot8.h" /* the int8-activation products (opt-in) */

/* One weight matrix of a product: rows in format fmt (s, o: FMT_I8's scales and offsets, else NULL),
 * N rows, written to columns col .. col + N - 1 of y. */
typedef struct {
    int fmt, N, G, col;
    const void *w;
    const float *s, *o;
    int tile; /* output rows per scheduling unit: NTILE, or NTILE_BIG for BIG_ROWS rows and more */
} gs_segment;

/* Output rows of scheduling unit t (sg->tile rows) of segment sg for every row of x; fmt is a
 * compile-time constant at each call (the switch in run_tile). xsum: sums of x over the segment's
 * G-value blocks (only read when it has offsets). y has ldy columns. */
static inline __attribute__((always_inline)) void qmatmul_tile(const int fmt, const gs_segment *sg, int K,
                                                               const float *x, const float *xsum, int M,
                                                               const int8_t *aq, const float *da,
                                                               float *y, long ldy, int t) {
    const int G = fmt_group(fmt, sg->G), nb = K / G, N = sg->N;
    const long stride = row_bytes(fmt, K);
    const int n0 = t * sg->tile, n1 = n0 + sg->tile < N ? n0 + sg->tile : N;
    const int offs = fmt_has_offsets(fmt, sg->o);
    for (int m0 = 0; m0 < M; m0 += MCHUNK) {
        const int mm = M - m0 < MCHUNK ? M - m0 : MCHUNK;
        for (int n = n0; n < n1; n += NR) {
            const void *wr[NR];
            const float *sr[NR];
            for (int r = 0; r < NR; r++) { /* rows past the end repeat the last row */
                const long row = n + r < N ? n + r : N - 1;
                wr[r] = (const char *)sg->w + row * stride;
                sr[r] = sg->s ? sg->s + row * nb : NULL;
            }
            float res[NR * RS], off[RS];
            if (aq) tile_q8_dispatch(fmt, wr, sr, K, aq + (long)m0 * K, da + (long)m0 * (K / 32), mm, res);
            else tile_dispatch(fmt, wr, sr, K, G, x + (long)m0 * K, K, mm, res);
            for (int r = 0; r < NR && n + r < n1; r++) {
                if (offs)
                    offsets_term(fmt, wr[r], sg->o ? sg->o + (long)(n + r) * nb : NULL, nb, xsum + (long)m0 * nb, mm,
                                 off);
                for (int m = 0; m < mm; m++)
                    y[(long)(m0 + m) * ldy + sg->col + n + r] = res[r * RS + m] + (offs ? off[m] : 0.f);
            }
        }
    }
}

#include "x8.h" /* Q4_0, Q8_0 (and Q5_0 as Q8_0) repacked 8 rows at a time (int8 activations) */
#include "r8.h" /* Q4_0 and Q8_0 regrouped 8 rows at a time (fp32 activations) */

static void run_tile(const gs_segment *sg, int K, const float *x, const float *xsum, int M, const int8_t *aq,
                     const float *da, float *y, long ldy, int t) {
    if (aq && !q8_supported(sg->fmt, sg->G)) aq = NULL, da = NULL; /* fp32 activations for this segment */
    switch (sg->fmt) {
        case FMT_Q4_0X8: x8_tile(FMT_Q4_0X8, sg, K, x, M, aq, da, y, ldy, t); break;
        case FMT_Q8_0X8: x8_tile(FMT_Q8_0X8, sg, K, x, M, aq, da, y, ldy, t); break;
        case FMT_I8X8: i8x8_tile(sg, K, x, xsum, M, aq, da, y, ldy, t); break;
        case FMT_Q4_0R8: r8_tile(FMT_Q4_0R8, sg, K, x, M, y, ldy, t); break;
        case FMT_Q8_0R8: r8_tile(FMT_Q8_0R8, sg, K, x, M, y, ldy, t); break;
        case FMT_Q4_0: qmatmul_tile(FMT_Q4_0, sg, K, x, xsum, M, aq, da, y, ldy, t); break;
        case FMT_Q8_0: qmatmul_tile(FMT_Q8_0, sg, K, x, xsum, M, aq, da, y, ldy, t); break;
        case FMT_Q5_0: qmatmul_tile(FMT_Q5_0, sg, K, x, xsum, M, aq, da, y, ldy, t); break;
        case FMT_Q4_K: qmatmul_tile(FMT_Q4_K, sg, K, x, xsum, M, aq, da, y, ldy, t); break;
        case FMT_Q6_K: qmatmul_tile(FMT_Q6_K, sg, K, x, xsum, M, aq, da, y, ldy, t); break;
        default: qmatmul_tile(FMT_I8, sg, K, x, xsum, M, aq, da, y, ldy, t);
    }
}

void gs_block_sums(const float *x, int M, int K, int G, float *xsum);

typedef struct {
    const gs_segment *sg;
    const int *first;
    int nseg, K;
    const float *x, *xsum;
    int M;
    float *y;
    int col;
    const int8_t *aq; /* int8 activations (qdot8.h) or NULL */
    const float *da;
} gs_multi_job;

static void multi_task(void *ctx, int t) {
    const gs_multi_job *j = (const gs_multi_job *)ctx;
    int i = 0;
    while (t >= j->first[i + 1]) i++;
    run_tile(&j->sg[i], j->K, j->x, j->xsum, j->M, j->aq, j->da, j->y, j->col, t - j->first[i]);
}

/* y [M, sum of N] fp32 = x [M, K] fp32 @ [W_0; W_1; ...]^T for nseg weight matrices of the same K in
 * any formats (fmts, ws, and for FMT_I8 ss, os, Gs; NULL entries elsewhere), their outputs side by side
 * in y; one parallel loop over the tiles of all of them. xsum [M, K/G]: gs_block_sums of x over the G
 * of the segments with offsets (Q4_K: 32, or FMT_I8 with o; all the same G), or NULL: computed here
 * when a segment needs it. K: a multiple of each format's block (32; 256 for Q4_K, Q6_K). At most 8 segments. */
static void qmatmul_multi(int nseg, const int *fmts, const void *const *ws, const float *const *ss,
                          const float *const *os, const int *Gs, const int *Ns, int K, const float *x,
                          const float *xsum, int M, float *y, int nthreads, int act_q8) {
    gs_segment sg[8];
    int first[9], col = 0;
    first[0] = 0;
    if (nseg > 8) nseg = 8;
    for (int i = 0; i < nseg; i++) {
        const int tile = Ns[i] >= BIG_ROWS ? NTILE_BIG : NTILE;
        sg[i] = (gs_segment){fmts[i], Ns[i], Gs ? Gs[i] : 32, col, ws[i], ss ? ss[i] : NULL, os ? os[i] : NULL, tile};
        col += Ns[i];
        first[i + 1] = first[i] + (Ns[i] + tile - 1) / tile;
    }
    float *own = NULL;
    if (!xsum) { /* segments with offsets read sums of x over their G-value blocks: computed here */
        int g = 0;
        for (int i = 0; i < nseg; i++)
            if (sg[i].fmt == FMT_Q4_K) g = 32;
            else if ((sg[i].fmt == FMT_I8 || sg[i].fmt == FMT_I8X8) && sg[i].o) g = sg[i].G;
        if (g) {
            own = (float *)malloc(sizeof(float) * (size_t)M * (size_t)(K / g));
            if (!own) return;
            gs_block_sums(x, M, K, g, own);
            xsum = own;
        }
    }
    int8_t *aq = NULL;
    float *da = NULL;
    if (act_q8 && K % 32 == 0) { /* int8 activations, quantized once for every segment */
        aq = (int8_t *)malloc((size_t)M * (size_t)K + 4 + sizeof(float) * (size_t)M * (size_t)(K / 32));
        if (!aq) {
            free(own);
            return;
        }
        da = (float *)(aq + (size_t)M * (size_t)K + (4 - (size_t)M * (size_t)K % 4) % 4);
        gs_quantize_act(x, M, K, aq, da);
    }
    gs_multi_job job = {sg, first, nseg, K, x, xsum, M, y, col, aq, da};
    gs_parallel(first[nseg], nthreads, multi_task, &job);
    free(aq);
    free(own);
}

void gs_qmatmul_multi(int nseg, const int *fmts, const void *const *ws, const float *const *ss,
                      const float *const *os, const int *Gs, const int *Ns, int K, const float *x,
                      const float *xsum, int M, float *y, int nthreads) {
    qmatmul_multi(nseg, fmts, ws, ss, os, Gs, Ns, K, x, xsum, M, y, nthreads, 0);
}

/* gs_qmatmul_multi with int8 activations (qdot8.h): x is quantized per 32 values first; segments without
 * an int8 path (FMT_I8 with G = 16) keep fp32 activations. */
void gs_qmatmul_multi_q8(int nseg, const int *fmts, const void *const *ws, const float *const *ss,
                         const float *const *os, const int *Gs, const int *Ns, int K, const float *x,
                         const float *xsum, int M, float *y, int nthreads) {
    qmatmul_multi(nseg, fmts, ws, ss, os, Gs, Ns, K, x, xsum, M, y, nthreads, 1);
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

/* y [M, N] fp32 = x [M, K] fp32 @ W^T for int8 weights (q, s, optional o; see the header). */
void gs_qmatmul(const int8_t *q, const float *s, const float *o, int N, int K, int G,
                const float *x, const float *xsum, int M, float *y, int nthreads) {
    const int f = FMT_I8;
    const void *w = q;
    gs_qmatmul_multi(1, &f, &w, &s, &o, &G, &N, K, x, xsum, M, y, nthreads);
}

/* y [M, N] fp32 = x [M, K] fp32 @ W^T for W stored in format fmt (not FMT_I8): blocks holds N rows of
 * ggml blocks as in the GGUF file. xsum as for gs_qmatmul_multi (Q4_K needs it). */
void gs_qmatmul_stored(int fmt, const uint8_t *blocks, int N, int K, const float *x, const float *xsum, int M,
                       float *y, int nthreads) {
    const void *w = blocks;
    gs_qmatmul_multi(1, &fmt, &w, NULL, NULL, NULL, &N, K, x, xsum, M, y, nthreads);
}

/* Row n of W (format fmt; s, o, G for FMT_I8) as fp32: scale * (float)q + offset, the same values for
 * every format holding the same weights. */
static void dequant_row(int fmt, const void *w, const float *s, const float *o, int G, int K, long n, float *out) {
    if (fmt == FMT_I8X8) { /* its FMT_I8 form first */
        const int nbg = K / G;
        int8_t *q = (int8_t *)malloc((size_t)K + sizeof(float) * 2 * (size_t)nbg + 8);
        if (!q) return;
        float *rs = (float *)(q + (((size_t)K + 7) & ~(size_t)7)), *ro = rs + nbg;
        i8x8_row((const int8_t *)w, s, o, K, G, n, q, rs, ro);
        for (int b = 0; b < nbg; b++)
            for (int j = 0; j < G; j++) out[b * G + j] = rs[b] * (float)q[b * G + j] + (o ? ro[b] : 0.f);
        free(q);
        return;
    }
    if (fmt == FMT_Q4_0X8 || fmt == FMT_Q8_0X8 || fmt_r8(fmt)) { /* a regrouped layout: rebuilt as a stored row first */
        const int sf = fmt_r8(fmt) ? r8_stored(fmt) : x8_stored(fmt);
        uint8_t stack[8192];
        const size_t rb = (size_t)row_bytes(sf, K);
        uint8_t *row = rb <= sizeof stack ? stack : (uint8_t *)malloc(rb);
        if (!row) return;
        if (fmt_r8(fmt)) r8_row_to_stored(fmt, (const uint8_t *)w, K, n, row);
        else x8_row_to_stored(fmt, (const uint8_t *)w, K, n, row);
        dequant_row(sf, row, NULL, NULL, 32, K, 0, out);
        if (row != stack) free(row);
        return;
    }
    G = fmt_group(fmt, G);
    const int nb = K / G;
    const char *wr = (const char *)w + n * row_bytes(fmt, K);
    const float *sr = s ? s + n * nb : NULL, *orow = o ? o + n * nb : NULL;
    for (int b = 0; b < nb; b++) {
        int8_t q[32];
        float sc;
        levels_scalar(fmt, wr, sr, b, G, q, &sc);
        const float of = block_offset(fmt, wr, orow, b);
        for (int j = 0; j < G; j++) out[b * G + j] = sc * (float)q[j] + of;
    }
}

/* out [n1 - n0, K] fp32 = rows n0..n1-1 of W (any format), for products with many rows. */
typedef struct {
    int fmt;
    const void *w;
    const float *s, *o;
    int G, n0, n1, K;
    float *out;
} gs_dequant_job;

#define DQ_ROWS 64 /* rows per task */
static void dequant_task(void *ctx, int t) {
    const gs_dequant_job *j = (const gs_dequant_job *)ctx;
    const int a = j->n0 + t * DQ_ROWS, b = a + DQ_ROWS < j->n1 ? a + DQ_ROWS : j->n1;
    for (int n = a; n < b; n++) dequant_row(j->fmt, j->w, j->s, j->o, j->G, j->K, n, j->out + (long)(n - j->n0) * j->K);
}

void gs_dequant_rows(int fmt, const void *w, const float *s, const float *o, int G, int n0, int n1, int K,
                     float *out, int nthreads) {
    gs_dequant_job job = {fmt, w, s, o, G, n0, n1, K, out};
    gs_parallel((n1 - n0 + DQ_ROWS - 1) / DQ_ROWS, nthreads, dequant_task, &job);
}

/* out [nids, K] fp32 = rows ids[0..nids-1] of W (an embedding lookup). */
void gs_dequant_ids(int fmt, const void *w, const float *s, const float *o, int G, const int64_t *ids, int nids,
                    int K, float *out) {
    for (int i = 0; i < nids; i++) dequant_row(fmt, w, s, o, G, K, ids[i], out + (long)i * K);
}

/* out[i] = row ids[i] of W (any format) . x, for i < nids: each row unpacked as gs_dequant_ids does, then
 * a dot product in 16 lanes (lane u: values j = u mod 16 ascending, fused multiply-add), reduced in a
 * fixed tree; the ids split over nthreads threads in runs of 64. What an MTP assistant's clustered head
 * scores its 4,096 candidate tokens with (before: the rows unpacked to memory, then a matmul). */
typedef struct {
    int fmt;
    const void *w;
    const float *s, *o;
    int G;
    const int64_t *ids;
    int nids, K;
    const float *x;
    float *out;
} gs_dot_ids_job;

static void dot_ids_task(void *ctx, int t) {
    const gs_dot_ids_job *j = (const gs_dot_ids_job *)ctx;
    float stack[4096];
    float *row = j->K <= 4096 ? stack : (float *)malloc(sizeof(float) * (size_t)j->K);
    if (!row) return;
    const int a = t * DQ_ROWS, b = a + DQ_ROWS < j->nids ? a + DQ_ROWS : j->nids;
    for (int i = a; i < b; i++) {
        dequant_row(j->fmt, j->w, j->s, j->o, j->G, j->K, j->ids[i], row);
        float acc[16] = {0};
        for (int k = 0; k < j->K; k += 16)
            for (int u = 0; u < 16; u++) acc[u] = fmaf(row[k + u], j->x[k + u], acc[u]);
        j->out[i] = reduce16_scalar(acc);
    }
    if (row != stack) free(row);
}

/* Returns 0, or -1 when K is not a multiple of 16. */
int gs_dot_ids(int fmt, const void *w, const float *s, const float *o, int G, const int64_t *ids, int nids, int K,
               const float *x, float *out, int nthreads) {
    if (K % 16) return -1;
    gs_dot_ids_job job = {fmt, w, s, o, G, ids, nids, K, x, out};
    gs_parallel((nids + DQ_ROWS - 1) / DQ_ROWS, nthreads, dot_ids_task, &job);
    return 0;
}

/* out [rows, d] fp32 = x [rows, d] * (1 / sqrt(mean over d of x^2 + eps)) * w (w NULL: no scale), row by
 * row (RMSNorm, Zhang & Sennrich 2019, as transformers' Gemma3RMSNorm / Gemma4RMSNorm compute it in
 * float32 with the (1 + w) or w weight already folded in by the loader). The sum of squares runs in 8
 * lane sums over d (d a multiple of 8), added in a fixed order: the same bits for a row whatever the
 * number of rows, so norms keep batch invariance. For a few rows (decode): one call instead of the ten
 * small PyTorch ops of torch.nn.functional.rms_norm. */
static inline float rms_inv(const float *xr, int d, float eps) { /* 1 / sqrt(mean(x^2) + eps), fixed order */
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < d; i += 8)
        for (int j = 0; j < 8; j++) a[j] += xr[i + j] * xr[i + j];
    const float ss = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    return 1.0f / sqrtf(ss / (float)d + eps);
}

void gs_rms_norm(const float *x, const float *w, int rows, int d, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * d;
        float *o = out + (long)r * d;
        const float inv = rms_inv(xr, d, eps);
        if (w)
            for (int i = 0; i < d; i++) o[i] = (xr[i] * inv) * w[i];
        else
            for (int i = 0; i < d; i++) o[i] = xr[i] * inv;
    }
}

/* Per-head RMSNorm, then rotate-half RoPE, for the query and key heads of n rows (Gemma's q_norm/k_norm
 * before RoPE; transformers' apply_rotary_pos_emb layout). x: row r at x + r * ldx holds `heads` heads
 * of d values (the query heads, then the key heads: adjacent in a fused q|k|v projection); heads below
 * first_heads are scaled by w_first [d], the rest by w_rest [d]. cos, sin [n, d]. out [n, heads, d]:
 * y = x_head * (1 / sqrt(mean(x_head^2) + eps)) * w (the sum of squares in gs_rms_norm's lane order),
 * then out_i = y_i * cos_i + (-y_{i+d/2}) * sin_i for i < d/2 and y_i * cos_i + y_{i-d/2} * sin_i after:
 * the operations of x * cos + rotate_half(x) * sin, so the same bits as PyTorch's ops, row by row. */
void gs_norm_rope(const float *x, long ldx, int n, int heads, int d, const float *w_first, int first_heads,
                  const float *w_rest, const float *cos, const float *sin, float eps, float *out) {
    const int half = d / 2;
    float y[1024];
    if (d > 1024 || d % 8) return;
    for (int r = 0; r < n; r++) {
        const float *c = cos + (long)r * d, *s = sin + (long)r * d;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + (long)r * ldx + (long)h * d;
            const float *w = h < first_heads ? w_first : w_rest;
            float *o = out + ((long)r * heads + h) * d;
            const float inv = rms_inv(xh, d, eps);
            for (int i = 0; i < d; i++) y[i] = (xh[i] * inv) * w[i];
            for (int i = 0; i < half; i++) o[i] = y[i] * c[i] + (-y[i + half]) * s[i];
            for (int i = half; i < d; i++) o[i] = y[i] * c[i] + y[i - half] * s[i];
        }
    }
}

#include "stepops.h" /* attention, gelu * up, norm + residual of a decode step */
#include "layers.h" /* a decode step's layers in one call */
#include "layers4.h" /* a Gemma 4 decode step's layers in one call */
#include "assistant.h" /* an MTP assistant's draft step in one call */
