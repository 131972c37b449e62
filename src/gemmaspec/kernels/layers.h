/*
 * A decode or verify step's decoder layers in one call (included at the end of qmatmul.c): for a few
 * rows of one sequence, every Gemma 3 layer's RMSNorm, fused q|k|v product, per-head norm + RoPE, KV
 * cache write, attention, output product, post-norm + residual, MLP norm, fused gate|up product,
 * gelu * up, down product and post-norm + residual, each through the same C function the per-op path
 * (gemmaspec.models.gemma3) calls, in the same order, so the bits are the same; only the ~25 Python and
 * PyTorch dispatches per layer are gone.
 */

typedef struct { /* one weight matrix's kernel segments (gs_qmatmul_multi's arguments) */
    int nseg;
    const int *fmts;
    const void *const *ws;
    const float *const *ss, *const *os;
    const int *Gs, *Ns;
    int q8; /* its products multiply int8 activations whatever the step's act_q8 (a weight marked auto_q8) */
} gs_prod;

/* gs_prod's product of x [n, K] into y [n, N]: int8 activations when the step asks for them or the weight does. */
static inline void prod_of(const gs_prod *p, int K, const float *x, int n, float *y, int nthreads, int act_q8) {
    qmatmul_multi(p->nseg, p->fmts, p->ws, p->ss, p->os, p->Gs, p->Ns, K, x, NULL, n, y, nthreads, act_q8 || p->q8);
}

typedef struct {
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm; /* float32 [D] or [hd] */
    gs_prod qkv, o, gate_up, down;
    int sliding; /* which gs_kind it reads: 1 = sliding window, 0 = full */
} gs_layer;

typedef struct { /* how the layers of one attention kind read and write the cache in this step */
    const float *cos, *sin; /* [n, hd] */
    int wrap;               /* new row i goes to cache row (start + i) % wrap (a ring), or start + i when 0 */
    int L;                  /* keys read: cache rows 0 .. L-1 */
    const uint8_t *mask;    /* [n, L] (nonzero = may attend) or NULL */
} gs_kind;

/* x [n, D] float32, updated in place through nl layers. kv[2 * l], kv[2 * l + 1]: layer l's key and value
 * cache [rows, hkv, hd]. kinds[0]: full layers, kinds[1]: sliding. F: MLP width. Returns 0, or -1 when
 * scratch memory could not be had (x is then unchanged only if the first allocation failed; the caller
 * treats -1 as an error). */
int gs_decode_layers(int nl, const gs_layer *layers, float *const *kv, const gs_kind *kinds, float *x, int n, int D,
                     int hq, int hkv, int hd, int F, float eps, float scale, int start, int nthreads, int act_q8) {
    const long wq = (long)(hq + 2 * hkv) * hd, wqk = (long)(hq + hkv) * hd;
    const size_t sz = (size_t)n * ((size_t)D + wq + wqk + (size_t)hq * hd + D + 2 * (size_t)F + F + D);
    float *buf = (float *)malloc(sizeof(float) * sz);
    if (!buf) return -1;
    float *h = buf, *qkv = h + (long)n * D, *qk = qkv + n * wq, *att = qk + n * wqk, *a = att + (long)n * hq * hd;
    float *gu = a + (long)n * D, *g = gu + 2L * n * F, *f = g + (long)n * F;
    for (int l = 0; l < nl; l++) {
        const gs_layer *ly = &layers[l];
        const gs_kind *kd = &kinds[ly->sliding ? 1 : 0];
        float *kc = kv[2 * l], *vc = kv[2 * l + 1];
        gs_rms_norm(x, ly->attn_norm, n, D, eps, h);
        prod_of(&ly->qkv, D, h, n, qkv, nthreads, act_q8);
        gs_norm_rope(qkv, wq, n, hq + hkv, hd, ly->q_norm, hq, ly->k_norm, kd->cos, kd->sin, eps, qk);
        for (int i = 0; i < n; i++) {
            const long row = kd->wrap ? (start + i) % kd->wrap : start + i;
            memcpy(kc + row * hkv * hd, qk + i * wqk + (long)hq * hd, sizeof(float) * hkv * hd);
            memcpy(vc + row * hkv * hd, qkv + i * wq + wqk, sizeof(float) * hkv * hd);
        }
        if (gs_attention_mt(qk, wqk, n, hq, hkv, hd, kc, vc, kd->L, kd->mask, scale, 0.f, att, nthreads) != 0) {
            free(buf);
            return -1;
        }
        prod_of(&ly->o, hq * hd, att, n, a, nthreads, act_q8);
        gs_add_rms_norm(a, ly->post_attn_norm, n, D, eps, x, x);
        gs_rms_norm(x, ly->ffn_norm, n, D, eps, h);
        prod_of(&ly->gate_up, D, h, n, gu, nthreads, act_q8);
        gs_gelu_mul(gu, 2L * F, n, F, g);
        prod_of(&ly->down, F, g, n, f, nthreads, act_q8);
        gs_add_rms_norm(f, ly->post_ffn_norm, n, D, eps, x, x);
    }
    free(buf);
    return 0;
}
