/*
 * The small per-layer operations of a decode or verify step (a few rows of x), each one C call instead
 * of a dozen PyTorch ops (included by qmatmul.c). In a decode step of Gemma 3 270M these ops take a
 * few microseconds of arithmetic each but ~3-5 us of dispatch per PyTorch op, ~25 ops per layer.
 *
 * Plain C loops with fixed lane counts, so the compiler vectorizes them for the machine (-O3
 * -march=native) without reassociating anything: every instruction set computes the same bits, and a
 * row's result never depends on the other rows of the call (batch invariance, which speculative
 * verification needs). -ffp-contract=off: no multiply-add is fused unless written as one.
 *
 *   gs_attention    grouped-query attention of t query rows over L keys (softmax(q k^T * scale) v),
 *                   the operations of gemmaspec.models.base.attention row by row.
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

/* q: query row r, head j at q + r * ldq + j * d (d a multiple of 16). k, v: [L, hkv, d] rows of
 * hkv * d values. mask: uint8 [t, L] (nonzero = may attend) or NULL (every key visible). softcap > 0:
 * scores become tanh(s / softcap) * softcap (Gemma 2 style; 0 = none). out: [t, h, d] contiguous.
 * Per (row, head): s_l = (q . k_l) * scale; p_l = exp(s_l - max) over visible keys (0 elsewhere);
 * out = sum_l (p_l / sum p) * v_l, l ascending. Returns 0, or -1 when d is not a multiple of 16 or
 * scratch memory could not be had (the caller falls back to PyTorch). */
int gs_attention(const float *q, long ldq, int t, int h, int hkv, int d, const float *k, const float *v, int L,
                 const uint8_t *mask, float scale, float softcap, float *out) {
    if (d % AT_LANES || hkv <= 0 || h % hkv || L <= 0) return -1;
    float stackbuf[4096];
    float *p = L <= 4096 ? stackbuf : (float *)malloc(sizeof(float) * (size_t)L);
    if (!p) return -1;
    const int g = h / hkv;
    const long ldk = (long)hkv * d;
    for (int r = 0; r < t; r++) {
        const uint8_t *mr = mask ? mask + (long)r * L : NULL;
        for (int j = 0; j < h; j++) {
            const float *qh = q + (long)r * ldq + (long)j * d;
            const float *kh = k + (long)(j / g) * d, *vh = v + (long)(j / g) * d;
            float mx = -INFINITY;
            for (int l = 0; l < L; l++) {
                if (mr && !mr[l]) { p[l] = -INFINITY; continue; }
                const float *kl = kh + l * ldk;
                float a[AT_LANES] = {0};
                for (int i = 0; i < d; i += AT_LANES)
                    for (int u = 0; u < AT_LANES; u++) a[u] += qh[i + u] * kl[i + u];
                float s = at_reduce16(a) * scale;
                if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
                p[l] = s;
                mx = s > mx ? s : mx;
            }
            float *o = out + ((long)r * h + j) * d;
            for (int i = 0; i < d; i++) o[i] = 0.f;
            if (mx == -INFINITY) continue; /* no visible key (not reached by a causal mask) */
            /* p_l = exp(s_l - max), exactly 0 for hidden keys; lane l % 16 of the sum (a hidden key adds 0) */
            float sa[AT_LANES] = {0};
            int l = 0;
            for (; l + AT_LANES <= L; l += AT_LANES)
                for (int u = 0; u < AT_LANES; u++) {
                    const float e = gs_expf(p[l + u] - mx);
                    p[l + u] = p[l + u] == -INFINITY ? 0.f : e;
                    sa[u] += p[l + u];
                }
            for (int u = 0; l + u < L; u++) {
                const float e = gs_expf(p[l + u] - mx);
                p[l + u] = p[l + u] == -INFINITY ? 0.f : e;
                sa[u] += p[l + u];
            }
            const float sum = at_reduce16(sa);
            for (l = 0; l < L; l++) {
                if (p[l] == 0.f) continue; /* hidden key */
                const float w = p[l] / sum;
                const float *vl = vh + l * ldk;
                for (int i = 0; i < d; i++) o[i] += w * vl[i];
            }
        }
    }
    if (p != stackbuf) free(p);
    return 0;
}

/* out [n, f] = gelu_tanh(x[:, :f]) * x[:, f:2f] for x [n, ldx >= 2f]:
 * gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (transformers' gelu_pytorch_tanh). */
void gs_gelu_mul(const float *x, long ldx, int n, int f, float *out) {
    for (int r = 0; r < n; r++) {
        const float *g = x + (long)r * ldx, *u = g + f;
        float *o = out + (long)r * f;
        for (int i = 0; i < f; i++) {
            const float a = g[i];
            const float z = 0.7978845608028654f * (a + 0.044715f * (a * a * a));
            const float th = 1.f - 2.f / (1.f + gs_expf(2.f * z));
            o[i] = (0.5f * a * (1.f + th)) * u[i];
        }
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
