/* Exact Q4_0 packing: per 32-value block, recover the trained step and the levels in [-8, 7].
 *
 * The same search, candidate order and tie rules as gemmaspec/quant/q4_0_exact.py (the reference,
 * kept in numpy); this is its fast path. Every candidate fp16 step is scored by the float32
 * reconstruction d*k against the source (better(): within tolerance of every value beats not; then
 * more values reproduced bit-exactly after rounding d*k to the source format; then, among steps
 * reproducing all 32 that way, more reproduced in float32 itself; then the smaller worst error, in
 * units of the source's last place). The candidates: for each level k the block's peak may sit on,
 * s = peak / k, levels = rint(v / s) (round half to even, as numpy), a least-squares step over the
 * block (summed in numpy's pairwise order, so the fp16 rounding matches bit for bit), then the fp16
 * steps f16(s), f16(s_ls) and its two fp16 neighbours. Levels -8, 7, -7, 6, -6 first; the others only
 * on a block off the grid (full scoring) or on the grid but not all bit-exact (then only an fp16 step
 * peak / k reproducing every value bit-exactly is taken: exact_step); a block still off the grid then
 * scores f16(|v| / k) for every nonzero value v and k = 1..8, both signs (try_magnitudes); then, on the
 * grid and still not all bit-exact in float32, the steps read off single values (try_value_steps) and
 * every fp16 step within WINDOW units of the best (try_window).
 *
 * Built with -O3 -march=native -ffp-contract=off (no fused multiply-adds, so float results equal
 * numpy's), blocks spread over gemmaspec's thread pool (pool.h).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

#define QK 32

static double pow2(int e) {                       /* 2^e for -1022 <= e <= 1023, exactly */
    uint64_t b = (uint64_t)(e + 1023) << 52;
    double x;
    memcpy(&x, &b, 8);
    return x;
}

static uint16_t f64_to_f16(double x) {            /* round to nearest even, as numpy's astype(float16) */
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs(x);
    if (isnan(x)) return 0x7e00;
    if (a >= 65520.0) return sign | 0x7c00;       /* rounds past the largest half (65504) */
    if (a < 0x1p-14) {                            /* subnormal: multiples of 2^-24 */
        double m = rint(a * 0x1p24);
        return sign | (uint16_t)m;                /* m == 1024 is the smallest normal, as wanted */
    }
    uint64_t b;
    memcpy(&b, &a, 8);
    int e = (int)((b >> 52) & 0x7ff) - 1023;      /* a = g * 2^e, g in [1, 2) */
    double m = rint(a * pow2(10 - e));            /* 1024 .. 2048 */
    if (m >= 2048.0) { m = 1024.0; e += 1; }
    if (e + 15 >= 31) return sign | 0x7c00;
    return sign | (uint16_t)(((e + 15) << 10) | ((int)m - 1024));
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {                                  /* zero or subnormal: m * 2^-24, exact in float */
        float v = (float)m * 0x1p-24f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e - 15 + 127) << 23) | (m << 13);
    }
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static uint16_t f16_next(uint16_t h, int up) {    /* numpy.nextafter(h, +-inf) on float16 */
    if ((h & 0x7fff) > 0x7c00) return h;           /* NaN */
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    int neg = h >> 15;
    if ((h & 0x7fff) == 0x7c00 && (neg != up)) return h;  /* +inf upwards, -inf downwards */
    return (neg == !up) ? h + 1 : h - 1;           /* away from zero : towards zero */
}

/* numpy's float64 sum of 32 contiguous values: eight interleaved accumulators, then a fixed tree */
static double np_sum32(const double *a) {
    double r[8];
    for (int j = 0; j < 8; j++) r[j] = a[j];
    for (int i = 8; i < QK; i += 8)
        for (int j = 0; j < 8; j++) r[j] += a[i + j];
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

typedef struct {
    uint16_t d;
    int8_t l[QK];
    int src;                                      /* values equal to the source after rounding to its format */
    int f32;                                      /* values equal to the source in float32 itself */
    double err;
} best_t;

/* 1 where r, rounded to the source format (round half to even; mbits 7 bf16, 10 f16, 23 f32: unchanged),
 * equals v (q4_0_exact.round_to_source). For bf16 and f32 a branch-free form the compiler vectorizes:
 * bits + add + ((bits >> 16) & one), then the mask (SRC_PARAMS gives add, one, mask). */
static inline int src_eq(float r, float v, uint32_t add, uint32_t one, uint32_t mask) {
    uint32_t bits;
    float x;
    memcpy(&bits, &r, 4);
    bits = (bits + add + ((bits >> 16) & one)) & mask;
    memcpy(&x, &bits, 4);
    return x == v;
}

static inline int src_eq_f16(float r, float v) { return f16_to_f32(f64_to_f16((double)r)) == v; }

#define SRC_PARAMS(mbits)                                                                     \
    const uint32_t add = (mbits) == 7 ? 0x7fffu : 0u, one = (mbits) == 7 ? 1u : 0u,           \
                   mask = (mbits) == 7 ? 0xffff0000u : ~0u

/* Whether a candidate (src, f32, err) beats b: within tolerance beats not; then more values exact in
 * the source format; then, both reproducing all 32 that way, more exact in float32; then the smaller
 * worst error (q4_0_exact._key_better). */
static inline int better(int src, int f32, double err, const best_t *b, double tol) {
    int ok = err <= tol, best_ok = b->err <= tol;
    if (ok != best_ok) return ok;
    if (src != b->src) return src > b->src;
    int t = src == QK ? f32 : -1, bt = b->src == QK ? b->f32 : -1;
    if (t != bt) return t > bt;
    return err < b->err;
}

/* Score the fp16 step h with levels lv32 against the block; keep it in b when better(). Always inlined:
 * as a plain call, try_level's path was 1.4x slower. */
static inline __attribute__((always_inline)) void score_step(const float *v, const double *v64, const double *inv_ulp,
                                                             int mbits, uint16_t h, const float *lv32, double tol,
                                                             best_t *b) {
    float d = f16_to_f32(h);
    int counts = 0;                                /* src + 256 * f32 */
    int64_t errbits[QK];
    SRC_PARAMS(mbits);
    if (mbits == 10)
        for (int i = 0; i < QK; i++) {
            float r = d * lv32[i];
            counts += src_eq_f16(r, v[i]) + ((r == v[i]) << 8);
            double e = fabs((double)r - v64[i]) * inv_ulp[i];
            memcpy(&errbits[i], &e, 8);            /* non-negative doubles order as integers */
        }
    else
        for (int i = 0; i < QK; i++) {
            float r = d * lv32[i];
            counts += src_eq(r, v[i], add, one, mask) + ((r == v[i]) << 8);
            double e = fabs((double)r - v64[i]) * inv_ulp[i];
            memcpy(&errbits[i], &e, 8);
        }
    int src = counts & 255, f32 = counts >> 8;
    int64_t mx = 0;
    for (int i = 0; i < QK; i++) mx = errbits[i] > mx ? errbits[i] : mx;
    double err;
    memcpy(&err, &mx, 8);
    if (better(src, f32, err, b, tol)) {
        b->d = h;
        b->src = src;
        b->f32 = f32;
        b->err = err;
        for (int i = 0; i < QK; i++) b->l[i] = (int8_t)lv32[i];
    }
}

/* Levels rint(v / s), clamped to [-8, 7]; returns whether none needed clamping. */
static int levels_for(const double *v64, double s, double *lv, float *lv32) {
    int valid = 1;
    for (int i = 0; i < QK; i++) {
        double q = rint(v64[i] / s);
        valid &= (q >= -8.0) & (q <= 7.0);
        lv[i] = q < -8.0 ? -8.0 : (q > 7.0 ? 7.0 : q);
        lv32[i] = (float)lv[i];
    }
    return valid;
}

static void try_level(const float *v, const double *v64, const double *inv_ulp, int mbits, double peak, int k,
                      double tol, best_t *b) {
    double s = peak / (double)k, lv[QK], prod[QK];
    int valid = 1;
    for (int i = 0; i < QK; i++) {
        double q = rint(v64[i] / s);
        valid &= (q >= -8.0) & (q <= 7.0);
        lv[i] = q < -8.0 ? -8.0 : (q > 7.0 ? 7.0 : q);
    }
    if (!valid) return;
    for (int i = 0; i < QK; i++) prod[i] = lv[i] * lv[i];
    double den = np_sum32(prod);
    for (int i = 0; i < QK; i++) prod[i] = v64[i] * lv[i];
    double s_ls = den > 0 ? np_sum32(prod) / den : 0.0;
    uint16_t d_ls = f64_to_f16(s_ls);
    uint16_t steps[4] = {f64_to_f16(s), d_ls, f16_next(d_ls, 1), f16_next(d_ls, 0)};
    float lv32[QK];
    for (int i = 0; i < QK; i++) lv32[i] = (float)lv[i];
    for (int c = 0; c < 4; c++) {
        int seen = 0;                              /* a step already scored cannot be strictly better */
        for (int p = 0; p < c; p++) seen |= steps[p] == steps[c];
        if (!seen) score_step(v, v64, inv_ulp, mbits, steps[c], lv32, tol, b);
    }
}

/* On the grid, not all bit-exact: the step read off single values. With a step of at most 11
 * significant bits (bf16's 8 included), a value on level +-1, +-2, +-4 or -8 is step * level exactly,
 * so value / level is the step itself, where the peak (a rounded step * 3, 5, 6 or 7) and the least
 * squares fit only come near it. For each of those level magnitudes (8, 4, 2, 1) the block's current
 * levels hold, the first such value gives d = f16(v / level), scored with levels rint(v / d) unless it
 * is the block's step already (the usual case: then it costs one division). */
static void try_value_steps(const float *v, const double *v64, const double *inv_ulp, int mbits, double tol,
                            best_t *b) {
    static const int MAGS[4] = {8, 4, 2, 1};
    int8_t cur[QK];
    uint16_t tried[5] = {b->d};                   /* the current step is not scored again */
    int ntried = 1;
    memcpy(cur, b->l, QK);
    for (int m = 0; m < 4; m++) {
        int at = -1;
        for (int i = 0; i < QK && at < 0; i++)
            if (cur[i] == MAGS[m] || cur[i] == -MAGS[m]) at = i;
        if (at < 0) continue;
        uint16_t h = f64_to_f16(v64[at] / (double)cur[at]);
        int seen = 0;                              /* the same step gives the same levels and score */
        for (int p = 0; p < ntried; p++) seen |= tried[p] == h;
        if (seen) continue;
        tried[ntried++] = h;
        double lv[QK];
        float lv32[QK];
        if (levels_for(v64, (double)f16_to_f32(h), lv, lv32)) score_step(v, v64, inv_ulp, mbits, h, lv32, tol, b);
    }
}

/* Off the grid after every peak level: the plain search of issue 33 (q4_0_exact._magnitude_steps). For
 * k = 1..8, for each nonzero value in block order, d = f16(|v| / k), scored as +d, then -d, with levels
 * rint(v / d) clipped to [-8, 7]; a d rounding to 0 or past 65504 is skipped. Skipped too, as they
 * cannot be strictly better than what was scored before them (the choice is the reference's): a step
 * already scored (a repeated magnitude, or |v| / k equal to another |v'| / k'), which gives the same
 * levels and score; -d when every level is within +-7, where -d with the levels -n reconstructs
 * exactly what +d with n does. */
static void try_magnitudes(const float *v, const double *v64, const double *inv_ulp, int mbits, double tol,
                           best_t *b) {
    uint16_t seen[512];                           /* open addressing on |h| (at most 256 distinct steps) */
    memset(seen, 0, sizeof seen);
    for (int k = 1; k <= 8; k++)
        for (int i = 0; i < QK; i++) {
            if (v64[i] == 0.0) continue;
            uint16_t h = f64_to_f16(fabs(v64[i]) / (double)k);
            if (h == 0 || h >= 0x7c00) continue;
            unsigned slot = ((unsigned)h * 40503u >> 6) & 511u;
            while (seen[slot] != 0 && seen[slot] != h) slot = (slot + 1) & 511u;
            if (seen[slot] == h) continue;
            seen[slot] = h;
            double d = (double)f16_to_f32(h);
            float q[QK], lp[QK], lm[QK];
            int wide = 0;                         /* a level outside [-7, 7]: -d scores differently */
            /* one operation per loop, so that each vectorizes (nested selects do not); the levels are
             * whole numbers, exact in float (a huge one stays beyond the clip, or becomes inf) */
            for (int j = 0; j < QK; j++) q[j] = (float)rint(v64[j] / d);
            for (int j = 0; j < QK; j++) wide |= fabsf(q[j]) > 7.0f;
            for (int j = 0; j < QK; j++) lp[j] = q[j] < -8.0f ? -8.0f : q[j];
            for (int j = 0; j < QK; j++) lp[j] = lp[j] > 7.0f ? 7.0f : lp[j];
            for (int j = 0; j < QK; j++) lm[j] = q[j] > 8.0f ? -8.0f : -q[j];
            for (int j = 0; j < QK; j++) lm[j] = lm[j] > 7.0f ? 7.0f : lm[j];
            score_step(v, v64, inv_ulp, mbits, h, lp, tol, b);
            if (wide) score_step(v, v64, inv_ulp, mbits, (uint16_t)(h | 0x8000), lm, tol, b);
        }
}

/* The exact fit with the peak on level k, if there is one: d = f16(peak / k) such that every value is
 * d * rint(v / d) bit for bit with the level in [-8, 7]. Any bit-exact fit is of this form (the peak is
 * d * k for its own level k, and the correctly rounded quotient peak / k is then d itself). */
static int exact_step(const float *v, double peak, int k, best_t *b) {
    uint16_t h = f64_to_f16(peak / (double)k);
    float d = f16_to_f32(h);
    if ((double)d * (double)k != peak) return 0;  /* the peak is not on level k of an fp16 step */
    int8_t l[QK];
    for (int i = 0; i < QK; i++) {
        double q = rint((double)v[i] / (double)d);
        if (!(q >= -8.0 && q <= 7.0) || d * (float)q != v[i]) return 0;
        l[i] = (int8_t)q;
    }
    b->d = h;
    memcpy(b->l, l, QK);
    b->src = QK;
    b->f32 = QK;
    b->err = 0.0;
    return 1;
}

/* Values reproduced by the steps +d and -d with the levels q (clipped to [-8, 8]: level 8 only fits -d,
 * level -8 only +d), bit-exact after rounding to the source format (src) and in float32 (f32): the
 * cheap counts of try_window, the counts its full scoring makes (q4_0_exact._cheap_counts). Each sum
 * holds both (src + 256 * f32): over all values, and over those on level 8 and on -8, taken off. */
typedef struct {
    int src_plus, src_minus, f32_plus, f32_minus;
} counts_t;

static inline counts_t cheap_counts(const float *v, float d, const float *q, int mbits) {
    int sum = 0, at8 = 0, atm8 = 0;
    SRC_PARAMS(mbits);
    for (int i = 0; i < QK; i++) {
        float r = d * q[i];
        int e = (mbits == 10 ? src_eq_f16(r, v[i]) : src_eq(r, v[i], add, one, mask)) + ((r == v[i]) << 8);
        sum += e;
        at8 += q[i] == 8.0f ? e : 0;
        atm8 += q[i] == -8.0f ? e : 0;
    }
    int p = sum - at8, m = sum - atm8;
    counts_t c = {p & 255, m & 255, p >> 8, m >> 8};
    return c;
}

/* Whether counts (src, f32) could beat b: more values exact after rounding, or as many (then, at all
 * 32, at least as many exact in float32). */
static inline int reaches(int src, int f32, const best_t *b) {
    return src > b->src || (src == b->src && (src < QK || f32 >= b->f32));
}

#define WINDOW 8 /* fp16 units either side of the best step (q4_0_exact.WINDOW) */

/* On the grid, not all bit-exact in float32 (a trained step fp16 cannot hold): every fp16 step within
 * WINDOW units of the best, ascending, + before -, with the best's levels n taken for +|d_best|
 * (clipped to [-8, 7] for +d; -n clipped for -d); counted cheaply first, fully scored only when the
 * counts could beat the best (q4_0_exact._window_steps). */
static void try_window(const float *v, const double *v64, const double *inv_ulp, int mbits, double tol, best_t *b) {
    int h0 = b->d & 0x7fff;
    if (h0 == 0) return;
    float q[QK], lp[QK], lm[QK], sign = b->d & 0x8000 ? -1.0f : 1.0f;
    for (int i = 0; i < QK; i++) {
        q[i] = sign * (float)b->l[i];            /* the best's levels for +|d_best|, in [-8, 8] */
        lp[i] = q[i] > 7.0f ? 7.0f : q[i];
        lm[i] = -q[i] > 7.0f ? 7.0f : -q[i];
    }
    /* A block all reproduced after rounding can only gain values exact in float32. A value d0 * n == v
     * (n != 0) is exact at no other step with the same level, so when the c0 such values leave fewer
     * than the best's count to any other step, only h0 itself is scored: the same choice, cheaper. */
    int lo = h0 - WINDOW, hi = h0 + WINDOW, c0 = 0;
    if (b->src == QK) {
        float f0 = f16_to_f32((uint16_t)h0);
        for (int i = 0; i < QK; i++) c0 += (q[i] != 0.0f) & (f0 * q[i] == v[i]);
        if (QK - c0 < b->f32) lo = hi = h0;
    }
    if (mbits == 10)
        for (int h = lo; h <= hi; h++) {
            if (h <= 0 || h >= 0x7c00) continue;
            counts_t c = cheap_counts(v, f16_to_f32((uint16_t)h), q, 10);
            if (reaches(c.src_plus, c.f32_plus, b)) score_step(v, v64, inv_ulp, 10, (uint16_t)h, lp, tol, b);
            if (reaches(c.src_minus, c.f32_minus, b))
                score_step(v, v64, inv_ulp, 10, (uint16_t)(h | 0x8000), lm, tol, b);
        }
    else
        for (int h = lo; h <= hi; h++) {
            if (h <= 0 || h >= 0x7c00) continue;
            counts_t c = cheap_counts(v, f16_to_f32((uint16_t)h), q, mbits);
            if (reaches(c.src_plus, c.f32_plus, b)) score_step(v, v64, inv_ulp, mbits, (uint16_t)h, lp, tol, b);
            if (reaches(c.src_minus, c.f32_minus, b))
                score_step(v, v64, inv_ulp, mbits, (uint16_t)(h | 0x8000), lm, tol, b);
        }
}

static const int STAGE1[] = {-8, 7, -7, 6, -6};
static const int STAGE2[] = {5, 4, 3, 2, 1, -1, -2, -3, -4, -5};

/* v: float32 [nblocks, 32] source values (bf16/f16/f32 widened); mantissa_bits: the source's.
 * Out: d fp16 bits [nblocks], levels int8 [nblocks, 32], exact int32 [nblocks] (values equal to the source
 * in float32), src int32 [nblocks] (equal after rounding to the source format), err float64 [nblocks]
 * (worst error in ulps), packed uint8 [nblocks, 18] (ggml block_q4_0: d, then byte j = q[j] | q[j+16] << 4
 * with q = level + 8), sq_err / sq_src float64 [nblocks]: sum of (d*level - v)^2 and of v^2. */
typedef struct {
    const float *v;
    int64_t nblocks;
    int mantissa_bits;
    double tol;
    uint16_t *d_out;
    int8_t *lv_out;
    int32_t *exact_out, *src_out;
    double *err_out;
    uint8_t *packed;
    double *sq_err, *sq_src;
    int magnitudes; /* whether a block still off the grid scores the plain search's steps (try_magnitudes) */
} pack_job;

#define PACK_BLOCKS 256 /* blocks per task */
static void pack_task(void *ctx, int t) {
    const pack_job *j = (const pack_job *)ctx;
    const float *v = j->v;
    const int mbits = j->mantissa_bits;
    const double tol = j->tol;
    const int magnitudes = j->magnitudes;
    uint16_t *d_out = j->d_out;
    int8_t *lv_out = j->lv_out;
    int32_t *exact_out = j->exact_out, *src_out = j->src_out;
    double *err_out = j->err_out, *sq_err = j->sq_err, *sq_src = j->sq_src;
    uint8_t *packed = j->packed;
    const int64_t end = (int64_t)(t + 1) * PACK_BLOCKS < j->nblocks ? (int64_t)(t + 1) * PACK_BLOCKS : j->nblocks;
    for (int64_t blk = (int64_t)t * PACK_BLOCKS; blk < end; blk++) {
        const float *x = v + blk * QK;
        double v64[QK], inv_ulp[QK];
        double peak = 0.0, amax = -1.0;
        for (int i = 0; i < QK; i++) {
            v64[i] = (double)x[i];
            double a = fabs(v64[i]);
            if (a > amax) { amax = a; peak = v64[i]; }
        }
        for (int i = 0; i < QK; i++) {          /* 1 / ulp: 2^(mantissa_bits - exponent), exponent >= -126 */
            uint64_t bits;
            memcpy(&bits, &v64[i], 8);
            int64_t e = (int64_t)((bits >> 52) & 0x7ff) - 1023;
            e = e < -126 ? -126 : e;           /* also zero (biased exponent 0) */
            uint64_t ib = (uint64_t)(mbits - e + 1023) << 52;
            memcpy(&inv_ulp[i], &ib, 8);
        }
        best_t b;
        b.d = 0;
        memset(b.l, 0, QK);
        if (peak == 0.0) {
            b.src = b.f32 = QK;
            b.err = 0.0;
        } else {
            b.src = b.f32 = -1;
            b.err = INFINITY;
            /* a candidate reproducing all 32 values bit-exactly in float32 (error 0) cannot be beaten */
            for (int j = 0; j < 5 && b.f32 < QK; j++) try_level(x, v64, inv_ulp, mbits, peak, STAGE1[j], tol, &b);
            if (!(b.err <= tol)) {
                for (int j = 0; j < 10 && b.f32 < QK; j++) try_level(x, v64, inv_ulp, mbits, peak, STAGE2[j], tol, &b);
                if (!(b.err <= tol) && magnitudes) try_magnitudes(x, v64, inv_ulp, mbits, tol, &b);
            } else if (b.f32 < QK) {  /* on the grid, not all bit-exact: an exact fit on the other levels? */
                double m = amax;                  /* the smallest nonzero magnitude: an exact fit's |d| <= m, */
                for (int i = 0; i < QK; i++)      /* so |k| * m >= amax (a skipped k could not fit: same choice) */
                    if (v64[i] != 0.0 && fabs(v64[i]) < m) m = fabs(v64[i]);
                for (int j = 0; j < 10 && b.f32 < QK; j++)
                    if (fabs((double)STAGE2[j]) * m >= amax) exact_step(x, peak, STAGE2[j], &b);
            }
            if (b.err <= tol && b.f32 < QK) try_value_steps(x, v64, inv_ulp, mbits, tol, &b);
            if (b.err <= tol && b.f32 < QK) try_window(x, v64, inv_ulp, mbits, tol, &b);
            if (b.f32 < 0) b.f32 = 0;
            if (b.src < 0) b.src = 0;
        }
        float dq = f16_to_f32(b.d);
        double se = 0.0, ss = 0.0;
        for (int i = 0; i < QK; i++) {
            double e = (double)(dq * (float)b.l[i]) - v64[i];
            se += e * e;
            ss += v64[i] * v64[i];
        }
        sq_err[blk] = se;
        sq_src[blk] = ss;
        uint8_t *o = packed + blk * 18;
        memcpy(o, &b.d, 2);
        for (int j = 0; j < 16; j++)
            o[2 + j] = (uint8_t)((b.l[j] + 8) | ((b.l[j + 16] + 8) << 4));
        d_out[blk] = b.d;
        memcpy(lv_out + blk * QK, b.l, QK);
        exact_out[blk] = b.f32;
        src_out[blk] = b.src;
        err_out[blk] = b.err;
    }
}

void gs_q4_0_exact(const float *v, int64_t nblocks, int mantissa_bits, double tol, uint16_t *d_out,
                   int8_t *lv_out, int32_t *exact_out, int32_t *src_out, double *err_out, uint8_t *packed,
                   double *sq_err, double *sq_src, int magnitudes, int nthreads) {
    pack_job job = {v, nblocks, mantissa_bits, tol, d_out, lv_out, exact_out, src_out, err_out, packed, sq_err, sq_src,
                    magnitudes};
    gs_parallel((int)((nblocks + PACK_BLOCKS - 1) / PACK_BLOCKS), nthreads, pack_task, &job);
}
