/*
 * A Gemma 4 decode or verify step's decoder layers in one call (included at the end of qmatmul.c, after
 * layers.h, whose gs_prod and gs_kind it uses). For a few rows of one sequence, every layer's RMSNorm,
 * fused q|k|v product (q|k on attention_k_eq_v layers, q alone on KV-shared ones), per-head norm + RoPE
 * (proportional RoPE on full layers: the cos/sin tables leave the still frequencies at cos 1, sin 0),
 * weightless V norm and KV cache write, attention (scale 1) over the layer's own cache or, on a
 * KV-shared layer, its source layer's, output product, post-norm + residual, MLP norm, fused gate|up
 * product, gelu * up, down product, post-norm + residual, the per-layer input (gate product, gelu *
 * the layer's input vector, projection, post-norm + residual) and the layer's output scale; each
 * through the same C function the per-op path (gemmaspec.models.gemma4.Gemma4Model._layer) calls, in
 * the same order, so the bits are the same. Reference: transformers models/gemma4/modeling_gemma4.py
 * (Gemma4TextDecoderLayer, Gemma4TextAttention).
 */

typedef struct {
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm; /* [D] or [hd] */
    const float *ple_norm; /* [D]: the per-layer input's post-norm (unused when the call has no ple) */
    float out_scale;       /* the layer's output scalar (1 when it has none: x * 1 is x) */
    gs_prod qkv;           /* kv 2: [q | k | v], kv 1: [q | k] (V is K's product), kv 0: [q] */
    gs_prod o, gate_up, down, ple_gate, ple_proj;
    int sliding;           /* which gs_kind it reads: 1 = sliding window, 0 = full */
    int hd, hkv, F;        /* head dim, KV heads, MLP width of this layer */
    int kv;                /* 2 or 1: computes and writes its K/V; 0: reads another layer's (KV sharing) */
} gs_layer4;

/* out [n, f] = gelu_tanh(g) * u for g [n, ldg >= f], u [n, ldu >= f]: gs_gelu_mul's arithmetic with the
 * two factors in separate buffers (Gemma 4's per-layer input gate times the layer's input vector). */
void gs_gelu_mul2(const float *g, long ldg, const float *u, long ldu, int n, int f, float *out) {
    for (int r = 0; r < n; r++) {
        const float *gr = g + (long)r * ldg, *ur = u + (long)r * ldu;
        float *o = out + (long)r * f;
        for (int i = 0; i < f; i++) o[i] = gs_gelu_tanh(gr[i]) * ur[i];
    }
}

static inline void prod4(const gs_prod *p, int K, const float *x, int n, float *y, int nthreads, int act_q8) {
    qmatmul_multi(p->nseg, p->fmts, p->ws, p->ss, p->os, p->Gs, p->Ns, K, x, NULL, n, y, nthreads, act_q8 || p->q8);
}

typedef struct { /* scratch of one call, sized for the widest layer */
    float *h, *qkv, *qk, *att, *a, *gu, *g, *f, *pg, *pgo;
} gs_scratch4;

/* The attention half of layer ly: x [n, D] += post_norm(o(attention(norm(x)))) in place. */
static int attn4(const gs_layer4 *ly, const gs_kind *kd, float *kc, float *vc, float *x, const gs_scratch4 *s,
                 int n, int D, int hq, float eps, int start, int nthreads, int act_q8) {
    const int d = ly->hd, hk = ly->hkv;
    const long wq = (long)(hq + ly->kv * hk) * d, wqk = (long)(hq + (ly->kv ? hk : 0)) * d;
    gs_rms_norm(x, ly->attn_norm, n, D, eps, s->h);
    prod4(&ly->qkv, D, s->h, n, s->qkv, nthreads, act_q8);
    if (ly->kv) {
        gs_norm_rope(s->qkv, wq, n, hq + hk, d, ly->q_norm, hq, ly->k_norm, kd->cos, kd->sin, eps, s->qk);
        const long v0 = ly->kv == 1 ? (long)hq * d : wqk; /* k_eq_v: V is K's product, before k_norm and RoPE */
        for (int i = 0; i < n; i++) {
            const long row = kd->wrap ? (start + i) % kd->wrap : start + i;
            memcpy(kc + row * hk * d, s->qk + i * wqk + (long)hq * d, sizeof(float) * hk * d);
            gs_rms_norm(s->qkv + i * wq + v0, NULL, hk, d, eps, vc + row * hk * d);
        }
    } else {
        gs_norm_rope(s->qkv, wq, n, hq, d, ly->q_norm, hq, ly->q_norm, kd->cos, kd->sin, eps, s->qk);
    }
    if (gs_attention_mt(s->qk, wqk, n, hq, hk, d, kc, vc, kd->L, kd->mask, 1.f, 0.f, s->att, nthreads) != 0) return -1;
    prod4(&ly->o, hq * d, s->att, n, s->a, nthreads, act_q8);
    gs_add_rms_norm(s->a, ly->post_attn_norm, n, D, eps, x, x);
    return 0;
}

/* x [n, D] float32, updated in place through nl Gemma 4 layers. kv[2 * l], kv[2 * l + 1]: the key and
 * value cache [rows, hkv, hd] layer l reads (its own, written here for the new rows, or on a KV-shared
 * layer its source layer's, written earlier in this call). kinds[0]: full layers, kinds[1]: sliding.
 * ple: the per-layer inputs [n, nl, P], or NULL (no per-layer embeddings). Returns 0, or -1 when
 * scratch memory could not be had or attention refused its shape (x is then partly updated; the caller
 * treats -1 as an error). */
int gs_gemma4_layers(int nl, const gs_layer4 *layers, float *const *kv, const gs_kind *kinds, float *x,
                     const float *ple, int P, int n, int D, int hq, float eps, int start, int nthreads,
                     int act_q8) {
    long wq = 0, wqk = 0, watt = 0, F = 0;
    for (int l = 0; l < nl; l++) {
        const gs_layer4 *ly = &layers[l];
        const long d = ly->hd, hk = ly->hkv;
        wq = (hq + ly->kv * hk) * d > wq ? (hq + ly->kv * hk) * d : wq;
        wqk = (hq + hk) * d > wqk ? (hq + hk) * d : wqk;
        watt = hq * d > watt ? hq * d : watt;
        F = ly->F > F ? ly->F : F;
    }
    const long pl = ple ? P : 0;
    /* every scratch buffer starts on a 64-byte line: the products' vector loads of x then never straddle two */
    const long al[10] = {(long)n * D, n * wq, n * wqk, n * watt, (long)n * D, 2 * n * F, n * F, (long)n * D, n * pl,
                         n * pl};
    long total = 0;
    for (int i = 0; i < 10; i++) total += (al[i] + 15) / 16 * 16;
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 64, sizeof(float) * (size_t)total) != 0) return -1;
    gs_scratch4 s;
    float **dst[10] = {&s.h, &s.qkv, &s.qk, &s.att, &s.a, &s.gu, &s.g, &s.f, &s.pg, &s.pgo};
    for (long i = 0, at = 0; i < 10; at += (al[i] + 15) / 16 * 16, i++) *dst[i] = buf + at;
    int rc = 0;
    for (int l = 0; l < nl && rc == 0; l++) {
        const gs_layer4 *ly = &layers[l];
        rc = attn4(ly, &kinds[ly->sliding ? 1 : 0], kv[2 * l], kv[2 * l + 1], x, &s, n, D, hq, eps, start,
                   nthreads, act_q8);
        if (rc) break;
        gs_rms_norm(x, ly->ffn_norm, n, D, eps, s.h);
        prod4(&ly->gate_up, D, s.h, n, s.gu, nthreads, act_q8);
        gs_gelu_mul(s.gu, 2L * ly->F, n, ly->F, s.g);
        prod4(&ly->down, ly->F, s.g, n, s.f, nthreads, act_q8);
        gs_add_rms_norm(s.f, ly->post_ffn_norm, n, D, eps, x, x);
        if (ple) {
            prod4(&ly->ple_gate, D, x, n, s.pg, nthreads, act_q8);
            gs_gelu_mul2(s.pg, P, ple + (long)l * P, (long)nl * P, n, P, s.pgo);
            prod4(&ly->ple_proj, P, s.pgo, n, s.a, nthreads, act_q8);
            gs_add_rms_norm(s.a, ly->ple_norm, n, D, eps, x, x);
        }
        const float sc = ly->out_scale;
        for (long i = 0; i < (long)n * D; i++) x[i] = x[i] * sc;
    }
    free(buf);
    return rc;
}
