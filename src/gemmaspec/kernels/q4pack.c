/* Exact Q4_0 packing: per 32-value block, recover the trained step and the levels in [-8, 7].
 *
 * The same search, candidate order and tie rules as gemmaspec/quant/q4_0_exact.py (the reference,
 * kept in numpy); this is its fast path. Per block: for each level k the block's peak may sit on,
 * s = peak / k, levels = rint(v / s) (round half to even, as numpy), a least-squares step over the
 * block (summed in numpy's pairwise order, so the fp16 rounding matches bit for bit), then the fp16
 * steps f16(s), f16(s_ls) and its two fp16 neighbours are scored by the float32 reconstruction d*k
 * against the source: within tolerance of every value beats not; then more bit-exact values; then
 * the smaller worst error (in units of the source's last place). Levels -8, 7, -7, 6, -6 first; the
 * others only on a block off the grid (full scoring) or on the grid but not all bit-exact (then only
 * an fp16 step peak / k reproducing every value bit-exactly is taken: exact_step); then, on the grid
 * and still not all bit-exact, the steps read off single values (try_value_steps).
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
    int exact;
    double err;
} best_t;

/* Score the fp16 step h with levels lv (lv32: the same as float) against the block; keep it in b when
 * better: within tolerance beats not, then more bit-exact values, then the smaller worst error. The
 * same scoring as try_level's loop (kept inline there: a shared call made that path 1.4x slower). */
static void score_step(const float *v, const double *v64, const double *inv_ulp, uint16_t h, const double *lv,
                       const float *lv32, double tol, best_t *b) {
    float d = f16_to_f32(h);
    int exact = 0;
    int64_t errbits[QK];
    for (int i = 0; i < QK; i++) {
        float r = d * lv32[i];
        exact += r == v[i];
        double e = fabs((double)r - v64[i]) * inv_ulp[i];
        memcpy(&errbits[i], &e, 8);                /* non-negative doubles order as integers */
    }
    int64_t mx = 0;
    for (int i = 0; i < QK; i++) mx = errbits[i] > mx ? errbits[i] : mx;
    double err;
    memcpy(&err, &mx, 8);
    int ok = err <= tol, best_ok = b->err <= tol;
    int better = (ok && !best_ok) || (ok == best_ok && (exact > b->exact || (exact == b->exact && err < b->err)));
    if (better) {
        b->d = h;
        b->exact = exact;
        b->err = err;
        for (int i = 0; i < QK; i++) b->l[i] = (int8_t)lv[i];
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

static void try_level(const float *v, const double *v64, const double *inv_ulp, double peak, int k,
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
        if (seen) continue;
        float d = f16_to_f32(steps[c]);
        int exact = 0;
        int64_t errbits[QK];
        for (int i = 0; i < QK; i++) {
            float r = d * lv32[i];
            exact += r == v[i];
            double e = fabs((double)r - v64[i]) * inv_ulp[i];
            memcpy(&errbits[i], &e, 8);            /* non-negative doubles order as integers */
        }
        int64_t mx = 0;
        for (int i = 0; i < QK; i++) mx = errbits[i] > mx ? errbits[i] : mx;
        double err;
        memcpy(&err, &mx, 8);
        int ok = err <= tol, best_ok = b->err <= tol;
        int better = (ok && !best_ok) || (ok == best_ok && (exact > b->exact || (exact == b->exact && err < b->err)));
        if (better) {
            b->d = steps[c];
            b->exact = exact;
            b->err = err;
            for (int i = 0; i < QK; i++) b->l[i] = (int8_t)lv[i];
        }
    }
}

/* On the grid, not all bit-exact: the step read off single values. With a step of at most 11
 * significant bits (bf16's 8 included), a value on level +-1, +-2, +-4 or -8 is step * level exactly,
 * so value / level is the step itself, where the peak (a rounded step * 3, 5, 6 or 7) and the least
 * squares fit only come near it. For each of those level magnitudes (8, 4, 2, 1) the block's current
 * levels hold, the first such value gives d = f16(v / level), scored with levels rint(v / d) unless it
 * is the block's step already (the usual case: then it costs one division). */
static void try_value_steps(const float *v, const double *v64, const double *inv_ulp, double tol, best_t *b) {
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
        if (levels_for(v64, (double)f16_to_f32(h), lv, lv32)) score_step(v, v64, inv_ulp, h, lv, lv32, tol, b);
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
    b->exact = QK;
    b->err = 0.0;
    return 1;
}

static const int STAGE1[] = {-8, 7, -7, 6, -6};
static const int STAGE2[] = {5, 4, 3, 2, 1, -1, -2, -3, -4, -5};

/* v: float32 [nblocks, 32] source values (bf16/f16/f32 widened); mantissa_bits: the source's.
 * Out: d fp16 bits [nblocks], levels int8 [nblocks, 32], exact int32 [nblocks], err float64 [nblocks]
 * (worst error in ulps), packed uint8 [nblocks, 18] (ggml block_q4_0: d, then byte j = q[j] | q[j+16] << 4
 * with q = level + 8), sq_err / sq_src float64 [nblocks]: sum of (d*level - v)^2 and of v^2. */
typedef struct {
    const float *v;
    int64_t nblocks;
    int mantissa_bits;
    double tol;
    uint16_t *d_out;
    int8_t *lv_out;
    int32_t *exact_out;
    double *err_out;
    uint8_t *packed;
    double *sq_err, *sq_src;
} pack_job;

#define PACK_BLOCKS 256 /* blocks per task */
static void pack_task(void *ctx, int t) {
    const pack_job *j = (const pack_job *)ctx;
    const float *v = j->v;
    const int mantissa_bits = j->mantissa_bits;
    const double tol = j->tol;
    uint16_t *d_out = j->d_out;
    int8_t *lv_out = j->lv_out;
    int32_t *exact_out = j->exact_out;
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
            uint64_t ib = (uint64_t)(mantissa_bits - e + 1023) << 52;
            memcpy(&inv_ulp[i], &ib, 8);
        }
        best_t b;
        b.d = 0;
        memset(b.l, 0, QK);
        if (peak == 0.0) {
            b.exact = QK;
            b.err = 0.0;
        } else {
            b.exact = -1;
            b.err = INFINITY;
            /* a candidate reproducing all 32 values bit-exactly (error 0) cannot be beaten */
            for (int j = 0; j < 5 && b.exact < QK; j++) try_level(x, v64, inv_ulp, peak, STAGE1[j], tol, &b);
            if (!(b.err <= tol))
                for (int j = 0; j < 10 && b.exact < QK; j++) try_level(x, v64, inv_ulp, peak, STAGE2[j], tol, &b);
            else if (b.exact < QK) { /* on the grid, not all bit-exact: an exact fit on the other levels? */
                double m = amax;                  /* the smallest nonzero magnitude: an exact fit's |d| <= m, */
                for (int i = 0; i < QK; i++)      /* so |k| * m >= amax (a skipped k could not fit: same choice) */
                    if (v64[i] != 0.0 && fabs(v64[i]) < m) m = fabs(v64[i]);
                for (int j = 0; j < 10 && b.exact < QK; j++)
                    if (fabs((double)STAGE2[j]) * m >= amax) exact_step(x, peak, STAGE2[j], &b);
            }
            if (b.err <= tol && b.exact < QK) try_value_steps(x, v64, inv_ulp, tol, &b);
            if (b.exact < 0) b.exact = 0;
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
        exact_out[blk] = b.exact;
        err_out[blk] = b.err;
    }
}

void gs_q4_0_exact(const float *v, int64_t nblocks, int mantissa_bits, double tol, uint16_t *d_out,
                   int8_t *lv_out, int32_t *exact_out, double *err_out, uint8_t *packed, double *sq_err,
                   double *sq_src, int nthreads) {
    pack_job job = {v, nblocks, mantissa_bits, tol, d_out, lv_out, exact_out, err_out, packed, sq_err, sq_src};
    gs_parallel((int)((nblocks + PACK_BLOCKS - 1) / PACK_BLOCKS), nthreads, pack_task, &job);
}
