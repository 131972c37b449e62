/*
 * The small per-layer operations of a decode or verify step (a few rows of x), each one C call instead
 * of a dozen PyTorch ops (included by qmatmul.c). In a decode step of Gemma 3 270M these ops take a
 * few microseconds of arithmetic each but ~3-5 us of dispatch per PyTorch op, ~25 ops per layer.
 *
 * Plain C loops with fixed lane counts, so the compiler vectorizes them for the machine (-O3
 * -march=native) without reassociating anything (attention's score tiles, which it left without vector
 * multiply-adds, are written with AVX-512 / AVX2 intrinsics of the same operations: at_scores): every
 * instruction set computes the same bits, and a
 * row's result never depends on the other rows of the call (batch invariance, which speculative
 * verification needs). -ffp-contract=off: no multiply-add is fused unless written as one.
 *
 *   gs_attention_mt grouped-query attention of t query rows over L keys (softmax(q k^T * scale) v) in
 *                   blocks of keys, on the thread pool; gs_attention: the same on one thread;
 *                   gs_attention_seqs: several sequences' gs_attention in one call, across threads.
 *   gs_gelu_mul     gelu_tanh(gate) * up for a fused [gate | up] projection (Gemma's MLP).
 *   gs_add_rms_norm x + rms_norm(a) * w (Gemma's post-attention / post-MLP norm and residual add).
 *
 * exp: Cephes' single-precision expf polynomial (range reduction by ln 2 in two parts, degree-6
 * polynomial, 2^n through the exponent bits), about 1 ulp; written element-wise so that it vectorizes.
 * tanh(u) = 1 - 2 / (1 + exp(2u)).
 */

static inline float gs_expf(float x) {
    x = x > 88.f ? 88.f : x;
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.f) - 12582912.f; /* round to nearest (|t| < 2^22) */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* Lanes of the dot products below: 16 partial sums reduced in one fixed tree. */
#define AT_LANES 16

static inline float at_reduce16(const float a[AT_LANES]) {
    float b[8];
    for (int j = 0; j < 8; j++) b[j] = a[j] + a[j + 8];
    return ((b[0] + b[4]) + (b[2] + b[6])) + ((b[1] + b[5]) + (b[3] + b[7]));
}

/* Grouped-query attention in blocks of keys (flash-decoding's split; Dao et al., "Flash-Decoding for
 * long-context inference", 2023), with every order fixed so that a row's bits never depend on the other
 * rows of the call or on the thread count:
 *   - the keys are cut into blocks of AT_BLOCK positions (a constant: not a function of L, t or threads);
 *   - a task is one (K/V head, block): it reads each of the block's keys and values once, for all the
 *     g = h / hkv query heads that share that K/V head and all t rows (before: once per query head);
 *     scores s_l = (q . k_l) * scale (16 lanes, at_reduce16), the block's max m_b over visible keys,
 *     p_l = exp(s_l - m_b), s_b = sum p_l (lane l % 16, at_reduce16), o_b = sum_l p_l v_l (l ascending);
 *   - a second pass per query combines the blocks in ascending order: M = max m_b, w_b = exp(m_b - M),
 *     out = (sum_b w_b o_b) / (sum_b w_b s_b).
 * The tasks of both passes run on the thread pool (gs_parallel); each writes its own memory. Inside a
 * task, scores come in register tiles of AT_QB queries x AT_KB keys and the weighted values in tiles of
 * AT_QB queries x AT_DT dims, with fused multiply-adds (written as fmaf: one rounding, the same on every
 * instruction set; the tile shapes change which loads are shared, never a result's operations). */
#define AT_BLOCK 256
#define AT_QB 4 /* queries per tile */
#ifdef __AVX512F__
#define AT_KB 4 /* keys per score tile: 16 accumulators of 16 lanes fit the 32 vector registers */
#else
#define AT_KB 2
#endif
#define AT_DT 32 /* output dims per value tile (a last tile of 16 when d % 32 == 16) */

typedef struct {
    const float *q;
    long ldq;
    int t, h, hkv, d, g, nq, L, nblk;
    const float *k, *v;
    const uint8_t *mask;
    float scale, softcap;
    float *po, *pm, *ps, *sc; /* partials [hkv][nblk][nq][d], [hkv][nblk][nq] x 2; scores [hkv][nblk][nq][AT_BLOCK] */
    float *out;
} at_job;

static inline const float *at_query(const at_job *j, int kvh, int qi) { /* query qi = r * g + jj of K/V head kvh */
    const int r = qi / j->g, jj = qi % j->g;
    return j->q + (long)r * j->ldq + (long)(kvh * j->g + jj) * j->d;
}

/* out[a * ldo + u] = sum_l w[a][l] v[l0 + l, u] for AT_QB queries (the first nvalid written) and W dims
 * (a compile-time constant at each call), l ascending, fused multiply-adds, accumulators in registers. */
static inline __attribute__((always_inline)) void at_pv_tile(const float *const ws[AT_QB], const float *v, long ldk,
                                                             int n, int l0, const int W, float *out, int ldo, int nvalid) {
    float acc[AT_QB][AT_DT];
    for (int a = 0; a < AT_QB; a++)
        for (int u = 0; u < W; u++) acc[a][u] = 0.f;
    for (int l = 0; l < n; l++) {
        const float *vl = v + (long)(l0 + l) * ldk;
        for (int a = 0; a < AT_QB; a++) {
            const float w = ws[a][l];
            for (int u = 0; u < W; u++) acc[a][u] = fmaf(w, vl[u], acc[a][u]);
        }
    }
    for (int a = 0; a < AT_QB && a < nvalid; a++) memcpy(out + (long)a * ldo, acc[a], sizeof(float) * W);
}

/* sums[a][c] = at_reduce16 of the 16 lanes of query a's and key c's dot product, lane u = sum over dims
 * i = u (mod 16), ascending, of fmaf(qs[a][i], ks[c][i], .) from 0. Written with intrinsics where the
 * compiler left the plain loops scalar (GCC 12-14 do not vectorize the three nested constant loops: one
 * scalar fused multiply-add per value, and a scalar tree per sum). A vector fused multiply-add rounds each
 * lane once as fmaf does; with AVX-512 the 16 sums' trees run side by side (each fold adds the same pairs
 * as at_reduce16: lanes j and j + 8, then j + 4, j + 2, j + 1), so the bits are the same everywhere. */
static inline __attribute__((always_inline)) void at_scores(const float *const qs[AT_QB], const float *const ks[AT_KB],
                                                            int d, float sums[AT_QB][AT_KB]) {
#if defined(GS_AVX512) && AT_QB == 4 && AT_KB == 4
    __m512 v[AT_QB * AT_KB];
    for (int n = 0; n < AT_QB * AT_KB; n++) v[n] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += AT_LANES) {
        __m512 kv[AT_KB];
        for (int c = 0; c < AT_KB; c++) kv[c] = _mm512_loadu_ps(ks[c] + i);
        for (int a = 0; a < AT_QB; a++) {
            const __m512 qv = _mm512_loadu_ps(qs[a] + i);
            for (int c = 0; c < AT_KB; c++) v[a * AT_KB + c] = _mm512_fmadd_ps(qv, kv[c], v[a * AT_KB + c]);
        }
    }
    __m512 t[8], u[4], w[2];
    for (int p = 0; p < 8; p++) /* lanes j + j+8: [v(2p) b0..b7 | v(2p+1) b0..b7] */
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++) /* j + j+4: 128-bit chunk k holds v(4p + k)'s c0..c3 */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++) /* j + j+2, within each chunk: [d0, d1] of two vectors */
        w[p] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * p], u[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * p], u[2 * p + 1], 0xEE));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    float o[16]; /* lane 4k + e: the sum of v(4e + k), i.e. query e, key k */
    _mm512_storeu_ps(o, x);
    for (int a = 0; a < AT_QB; a++)
        for (int c = 0; c < AT_KB; c++) sums[a][c] = o[4 * c + a];
#else
    float acc[AT_QB][AT_KB][AT_LANES];
#if defined(GS_AVX2) || defined(GS_AVX512)
    __m256 v[AT_QB][AT_KB][2];
    for (int a = 0; a < AT_QB; a++)
        for (int c = 0; c < AT_KB; c++) v[a][c][0] = v[a][c][1] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += AT_LANES)
        for (int a = 0; a < AT_QB; a++)
            for (int c = 0; c < AT_KB; c++)
                for (int h = 0; h < 2; h++)
                    v[a][c][h] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[a] + i + 8 * h), _mm256_loadu_ps(ks[c] + i + 8 * h),
                                                 v[a][c][h]);
    for (int a = 0; a < AT_QB; a++)
        for (int c = 0; c < AT_KB; c++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc[a][c] + 8 * h, v[a][c][h]);
#else
    for (int a = 0; a < AT_QB; a++)
        for (int c = 0; c < AT_KB; c++)
            for (int u = 0; u < AT_LANES; u++) acc[a][c][u] = 0.f;
    for (int i = 0; i < d; i += AT_LANES)
        for (int a = 0; a < AT_QB; a++)
            for (int c = 0; c < AT_KB; c++)
                for (int u = 0; u < AT_LANES; u++) acc[a][c][u] = fmaf(qs[a][i + u], ks[c][i + u], acc[a][c][u]);
#endif
    for (int a = 0; a < AT_QB; a++)
        for (int c = 0; c < AT_KB; c++) sums[a][c] = at_reduce16(acc[a][c]);
#endif
}

static void at_block_task(void *ctx, int task) {
    const at_job *j = (const at_job *)ctx;
    const int kvh = task / j->nblk, b = task % j->nblk, d = j->d, nq = j->nq;
    const int l0 = b * AT_BLOCK, l1 = l0 + AT_BLOCK < j->L ? l0 + AT_BLOCK : j->L, n = l1 - l0;
    const long ldk = (long)j->hkv * d, part = (long)kvh * j->nblk + b;
    float *S = j->sc + part * nq * AT_BLOCK, *O = j->po + part * nq * d;
    float *pm = j->pm + part * nq, *ps = j->ps + part * nq;
    const float *kb = j->k + (long)kvh * d, *vb = j->v + (long)kvh * d;
    /* the visible keys of the block for any of its rows lie in [va, ve): keys outside it are skipped (a
     * hidden key's score is -inf and its p exactly 0, so skipping it changes no bit); a block with no
     * visible key is marked empty (the combine pass skips it). A sliding-window ring not yet full or a
     * short cache in a long buffer (the assistant reads the target's) then costs its visible keys only. */
    int va = l0, ve = l1;
    if (j->mask) {
        va = l1, ve = l0;
        for (int r = 0; r < j->t; r++) {
            const uint8_t *m = j->mask + (long)r * j->L;
            int x = l0, y = l1;
            while (x < y && !m[x]) x++;
            while (y > x && !m[y - 1]) y--;
            if (x < y) {
                va = x < va ? x : va;
                ve = y > ve ? y : ve;
            }
        }
        if (va >= ve) {
            for (int qi = 0; qi < nq; qi++) pm[qi] = -INFINITY, ps[qi] = 0.f;
            return;
        }
        for (int qi = 0; qi < nq; qi++) {
            float *p = S + (long)qi * AT_BLOCK;
            for (int l = l0; l < va; l++) p[l - l0] = -INFINITY;
            for (int l = ve; l < l1; l++) p[l - l0] = -INFINITY;
        }
    }
    /* scores in tiles of AT_QB queries x AT_KB keys (each query and key row loaded once per tile); each
     * dot in 16 lanes (lane u: dims i = u mod 16 ascending, fused multiply-add), then at_reduce16 */
    for (int q0 = 0; q0 < nq; q0 += AT_QB) {
        const float *qs[AT_QB];
        for (int a = 0; a < AT_QB; a++) qs[a] = at_query(j, kvh, q0 + a < nq ? q0 + a : nq - 1);
        for (int k0 = va; k0 < ve; k0 += AT_KB) {
            const float *ks[AT_KB];
            for (int c = 0; c < AT_KB; c++) ks[c] = kb + (long)(k0 + c < ve ? k0 + c : ve - 1) * ldk;
            float sums[AT_QB][AT_KB];
            at_scores(qs, ks, d, sums);
            for (int a = 0; a < AT_QB && q0 + a < nq; a++) {
                const int r = (q0 + a) / j->g;
                for (int c = 0; c < AT_KB && k0 + c < ve; c++) {
                    float s = sums[a][c] * j->scale;
                    if (j->softcap > 0.f) s = tanhf(s / j->softcap) * j->softcap;
                    if (j->mask && !j->mask[(long)r * j->L + k0 + c]) s = -INFINITY;
                    S[(long)(q0 + a) * AT_BLOCK + (k0 + c - l0)] = s;
                }
            }
        }
    }
    for (int qi = 0; qi < nq; qi++) { /* the block's softmax numerators and their sum */
        float *p = S + (long)qi * AT_BLOCK;
        float mx = -INFINITY;
        for (int l = 0; l < n; l++) mx = p[l] > mx ? p[l] : mx;
        pm[qi] = mx;
        float sa[AT_LANES] = {0};
        if (mx != -INFINITY) {
            int l = 0;
            for (; l + AT_LANES <= n; l += AT_LANES)
                for (int u = 0; u < AT_LANES; u++) {
                    const float e = gs_expf(p[l + u] - mx);
                    p[l + u] = p[l + u] == -INFINITY ? 0.f : e;
                    sa[u] += p[l + u];
                }
            for (int u = 0; l + u < n; u++) {
                const float e = gs_expf(p[l + u] - mx);
                p[l + u] = p[l + u] == -INFINITY ? 0.f : e;
                sa[u] += p[l + u];
            }
        } else {
            for (int l = 0; l < n; l++) p[l] = 0.f;
        }
        ps[qi] = at_reduce16(sa);
    }
    /* o_b = sum_l p_l v_l in tiles of AT_QB queries x AT_DT dims held in registers across the block's
     * keys (l ascending, fused multiply-add; a hidden key's p = 0 adds exactly 0) */
    for (int q0 = 0; q0 < nq; q0 += AT_QB) {
        const float *ws[AT_QB];
        for (int u = 0; u < AT_QB; u++) ws[u] = S + (long)(q0 + u < nq ? q0 + u : nq - 1) * AT_BLOCK + (va - l0);
        int i0 = 0;
        for (; i0 + AT_DT <= d; i0 += AT_DT) at_pv_tile(ws, vb + i0, ldk, ve - va, va, AT_DT, O + (long)q0 * d + i0, d, nq - q0);
        if (i0 < d) at_pv_tile(ws, vb + i0, ldk, ve - va, va, AT_LANES, O + (long)q0 * d + i0, d, nq - q0); /* d % 32 == 16 */
    }
}

static void at_combine_task(void *ctx, int task) { /* one (K/V head, query): the blocks in ascending order */
    const at_job *j = (const at_job *)ctx;
    const int kvh = task / j->nq, qi = task % j->nq, d = j->d, nq = j->nq;
    const int r = qi / j->g, head = kvh * j->g + qi % j->g;
    float *o = j->out + ((long)r * j->h + head) * d;
    float mx = -INFINITY;
    for (int b = 0; b < j->nblk; b++) {
        const float m = j->pm[((long)kvh * j->nblk + b) * nq + qi];
        mx = m > mx ? m : mx;
    }
    for (int i = 0; i < d; i++) o[i] = 0.f;
    if (mx == -INFINITY) return; /* no visible key (not reached by a causal mask) */
    float sum = 0.f;
    for (int b = 0; b < j->nblk; b++) {
        const long part = (long)kvh * j->nblk + b;
        const float m = j->pm[part * nq + qi];
        if (m == -INFINITY) continue; /* a block with no visible key adds nothing */
        const float w = gs_expf(m - mx);
        sum += w * j->ps[part * nq + qi];
        const float *ob = j->po + (part * nq + qi) * d;
        for (int i = 0; i < d; i++) o[i] += w * ob[i];
    }
    for (int i = 0; i < d; i++) o[i] = o[i] / sum;
}

/* q: query row r, head j at q + r * ldq + j * d (d a multiple of 16). k, v: [L, hkv, d] rows of
 * hkv * d values. mask: uint8 [t, L] (nonzero = may attend) or NULL (every key visible). softcap > 0:
 * scores become tanh(s / softcap) * softcap (Gemma 2 style; 0 = none). out: [t, h, d] contiguous.
 * softmax(q k^T * scale) v per (row, head), computed as described above on up to nthreads threads.
 * Returns 0, or -1 when d is not a multiple of 16, h not a multiple of hkv, or scratch memory could
 * not be had (the caller falls back to PyTorch). */
int gs_attention_mt(const float *q, long ldq, int t, int h, int hkv, int d, const float *k, const float *v, int L,
                    const uint8_t *mask, float scale, float softcap, float *out, int nthreads) {
    if (d % AT_LANES || hkv <= 0 || h % hkv || L <= 0 || t <= 0) return -1;
    const int g = h / hkv, nq = g * t, nblk = (L + AT_BLOCK - 1) / AT_BLOCK;
    const size_t parts = (size_t)hkv * nblk * nq;
    float *buf = (float *)malloc(sizeof(float) * parts * ((size_t)d + 2 + AT_BLOCK));
    if (!buf) return -1;
    at_job j = {q, ldq, t, h, hkv, d, g, nq, L, nblk, k, v, mask, scale, softcap,
                buf, buf + parts * d, buf + parts * d + parts, buf + parts * (d + 2), out};
    gs_parallel(hkv * nblk, nthreads, at_block_task, &j);
    gs_parallel(hkv * nq, nthreads, at_combine_task, &j);
    free(buf);
    return 0;
}

/* gs_attention_mt on the calling thread alone. */
int gs_attention(const float *q, long ldq, int t, int h, int hkv, int d, const float *k, const float *v, int L,
                 const uint8_t *mask, float scale, float softcap, float *out) {
    return gs_attention_mt(q, ldq, t, h, hkv, d, k, v, L, mask, scale, softcap, out, 1);
}

typedef struct {
    const float *const *q;
    long ldq;
    const int *t, *L;
    int h, hkv, d;
    const float *const *k, *const *v;
    const uint8_t *const *mask;
    float scale, softcap;
    float *const *out;
    _Atomic int failed;
} at_seqs_job;

static void at_seqs_task(void *ctx, int s) {
    at_seqs_job *j = (at_seqs_job *)ctx;
    if (gs_attention(j->q[s], j->ldq, j->t[s], j->h, j->hkv, j->d, j->k[s], j->v[s], j->L[s], j->mask[s], j->scale,
                     j->softcap, j->out[s]) != 0)
        atomic_store(&j->failed, 1);
}

/* gs_attention for nseq sequences in one call (a batched forward's layer: each sequence's rows against
 * its own cache), the sequences spread over up to nthreads threads, each on one thread: as the bits of
 * gs_attention_mt depend neither on the thread count nor on other rows, every sequence gets the bits
 * of a call of its own. Sequence s: query rows q[s] (row stride ldq), t[s] rows, keys and values k[s],
 * v[s] [L[s], hkv, d], mask[s] uint8 [t[s], L[s]] or NULL, output out[s] [t[s], h, d]. Returns 0, or -1
 * when a sequence's call failed (the caller then runs them one by one). */
int gs_attention_seqs(int nseq, const float *const *q, long ldq, const int *t, int h, int hkv, int d,
                      const float *const *k, const float *const *v, const int *L, const uint8_t *const *mask,
                      float scale, float softcap, float *const *out, int nthreads) {
    at_seqs_job j = {q, ldq, t, L, h, hkv, d, k, v, mask, scale, softcap, out, 0};
    gs_parallel(nseq, nthreads, at_seqs_task, &j);
    return atomic_load(&j.failed) ? -1 : 0;
}

/* out [n, f] = gelu_tanh(x[:, :f]) * x[:, f:2f] for x [n, ldx >= 2f]:
 * gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (transformers' gelu_pytorch_tanh). */
static inline float gs_gelu_tanh(const float a) {
    const float z = 0.7978845608028654f * (a + 0.044715f * (a * a * a));
    const float th = 1.f - 2.f / (1.f + gs_expf(2.f * z));
    return 0.5f * a * (1.f + th);
}

void gs_gelu_mul(const float *x, long ldx, int n, int f, float *out) {
    for (int r = 0; r < n; r++) {
        const float *g = x + (long)r * ldx, *u = g + f;
        float *o = out + (long)r * f;
        for (int i = 0; i < f; i++) o[i] = gs_gelu_tanh(g[i]) * u[i];
    }
}

/* out [rows, d] = x + rms_norm(a) * w: the bits of x + gs_rms_norm(a, w) (w NULL: no scale). out may be x. */
void gs_add_rms_norm(const float *a, const float *w, int rows, int d, float eps, const float *x, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *ar = a + (long)r * d, *xr = x + (long)r * d;
        float *o = out + (long)r * d;
        const float inv = rms_inv(ar, d, eps); /* gs_rms_norm's */
        if (w)
            for (int i = 0; i < d; i++) o[i] = xr[i] + (ar[i] * inv) * w[i];
        else
            for (int i = 0; i < d; i++) o[i] = xr[i] + ar[i] * inv;
    }
}
