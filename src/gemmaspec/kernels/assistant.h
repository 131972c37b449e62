/*
 * One draft step of a Gemma 4 assistant (MTP drafter) in one call (included at the end of qmatmul.c,
 * after layers.h, whose gs_prod it uses). The step reads the target's cached keys and values and keeps
 * no cache of its own; every operation is the C function the per-op path of
 * gemmaspec.models.gemma4_assistant calls, in the same order, so the bits are the same: the pre-
 * projection, then per layer RMSNorm, query product, per-head norm + RoPE, attention over the
 * target's K/V, output product, post-norm + residual, MLP norm, gate and up products, gelu * up, down
 * product, post-norm + residual and the layer's output scale; then the final norm and the post-
 * projection. Only the ~40 Python and PyTorch dispatches per layer are gone. The gate and up products
 * run as one call over both matrices side by side (a StackedWeight's segments, as the target's layers
 * do): each output column is computed by the same tile code as the matrix alone computes it, so the bits
 * are those of the two products, with one parallel region and one activation quantization fewer.
 */

typedef struct {
    const float *attn_norm, *q_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm; /* float32 [D] or [hd] */
    float out_scale;             /* the layer's output scalar (1 when it has none: x * 1 is x) */
    gs_prod q, o, gate_up, down; /* gate_up: [gate; up] (2F rows), one call */
    int hd;                      /* head dim of this layer's queries and of the keys it reads */
    const float *k, *v;          /* the target's cache of the layer it reads: [rows, hkv, hd] */
    int L;                       /* keys read: rows 0 .. L-1 */
    const uint8_t *mask;         /* [L] (nonzero = may attend) or NULL */
    const float *cos, *sin;      /* [hd]: RoPE at the draft position */
} gs_alayer;

static inline void prod1(const gs_prod *p, int K, const float *x, float *y, int nthreads, int act_q8) {
    qmatmul_multi(p->nseg, p->fmts, p->ws, p->ss, p->os, p->Gs, p->Ns, K, x, NULL, 1, y, nthreads, act_q8 || p->q8);
}

/* The greedy pick of a reduced head for one row of scores: *best = the lowest target id among the rows
 * of the highest score (what argmax over the target-vocabulary logits gives); *p_best (when not NULL)
 * its probability under the softmax over the n_head rows, 1 / sum exp(score - best score): the exps
 * by gs_expf (about 1 ulp), summed in double in 16 lanes (lane i % 16, i ascending; AT_BLOCK is a
 * multiple of 16) and a fixed tree, so the value is the same on every instruction set and the loops
 * vectorize. */
static void head_pick(const float *scores, int n_head, const int64_t *token_map, int64_t *best, float *p_best) {
    float ml[AT_LANES]; /* the highest score: a max in 16 lanes (vectorizes), then the rows holding it */
    for (int u = 0; u < AT_LANES; u++) ml[u] = scores[0];
    int i0 = 0;
    for (; i0 + AT_LANES <= n_head; i0 += AT_LANES)
        for (int u = 0; u < AT_LANES; u++) ml[u] = scores[i0 + u] > ml[u] ? scores[i0 + u] : ml[u];
    for (int u = 0; i0 + u < n_head; u++) ml[u] = scores[i0 + u] > ml[u] ? scores[i0 + u] : ml[u];
    float mx = ml[0];
    for (int u = 1; u < AT_LANES; u++) mx = ml[u] > mx ? ml[u] : mx;
    int64_t tok = -1;
    for (int i = 0; i < n_head; i++)
        if (scores[i] == mx && (tok < 0 || token_map[i] < tok)) tok = token_map[i];
    *best = tok;
    if (p_best) {
        double z[AT_LANES] = {0};
        float e[AT_BLOCK]; /* exps of a chunk first (a loop that vectorizes), then into the double lanes */
        for (int c0 = 0; c0 < n_head; c0 += AT_BLOCK) {
            const int n = n_head - c0 < AT_BLOCK ? n_head - c0 : AT_BLOCK;
            for (int l = 0; l < n; l++) e[l] = gs_expf(scores[c0 + l] - mx);
            int l = 0;
            for (; l + AT_LANES <= n; l += AT_LANES)
                for (int u = 0; u < AT_LANES; u++) z[u] += (double)e[l + u];
            for (int u = 0; l + u < n; u++) z[u] += (double)e[l + u];
        }
        double y[8];
        for (int u = 0; u < 8; u++) y[u] = z[u] + z[u + 8];
        const double sum = ((y[0] + y[4]) + (y[2] + y[6])) + ((y[1] + y[5]) + (y[3] + y[7]));
        *p_best = (float)(1.0 / sum);
    }
}

/* in [2 * Hb]: the target's scaled embedding of the token, then the hidden state the step reads.
 * D: the assistant's width, hq / hkv: its query heads / the target's KV heads, F: MLP width. Writes
 * hidden [D] (the final-norm state the head scores) and next_h [Hb] (the post-projection the next
 * step reads). head (or NULL): a reduced head of n_head rows whose target ids are token_map [n_head];
 * then *best = the greedy draft: the lowest target id among the rows of the highest score (what
 * argmax over the target-vocabulary logits gives), and *p_best (when not NULL) its probability under
 * the softmax over the n_head rows (1 / sum exp(score - best score)). Returns 0, or -1 when scratch memory could not be
 * had or attention refused its shape (the caller runs the per-op path). */
int gs_assistant_step(int nl, const gs_alayer *layers, const gs_prod *pre, const gs_prod *post, const float *out_norm,
                      const float *in, int Hb, int D, int hq, int hkv, int F, float eps, float *hidden, float *next_h,
                      const gs_prod *head, int n_head, const int64_t *token_map, int64_t *best, float *p_best,
                      int nthreads, int act_q8) {
    int maxhd = 0;
    for (int l = 0; l < nl; l++) maxhd = layers[l].hd > maxhd ? layers[l].hd : maxhd;
    const size_t qn = (size_t)hq * maxhd;
    float *buf = (float *)malloc(sizeof(float) * (4 * (size_t)D + 3 * qn + 4 * (size_t)F));
    if (!buf) return -1;
    float *x = buf, *h = x + D, *a = h + D, *f = a + D, *qv = f + D, *qr = qv + qn, *att = qr + qn;
    float *gu = att + qn, *g = gu + 2L * F;
    prod1(pre, 2 * Hb, in, x, nthreads, act_q8);
    for (int l = 0; l < nl; l++) {
        const gs_alayer *ly = &layers[l];
        const int d = ly->hd;
        gs_rms_norm(x, ly->attn_norm, 1, D, eps, h);
        prod1(&ly->q, D, h, qv, nthreads, act_q8);
        gs_norm_rope(qv, (long)hq * d, 1, hq, d, ly->q_norm, hq, ly->q_norm, ly->cos, ly->sin, eps, qr);
        if (gs_attention_mt(qr, (long)hq * d, 1, hq, hkv, d, ly->k, ly->v, ly->L, ly->mask, 1.f, 0.f, att, nthreads) != 0) {
            free(buf);
            return -1;
        }
        prod1(&ly->o, hq * d, att, a, nthreads, act_q8);
        gs_add_rms_norm(a, ly->post_attn_norm, 1, D, eps, x, x);
        gs_rms_norm(x, ly->ffn_norm, 1, D, eps, h);
        prod1(&ly->gate_up, D, h, gu, nthreads, act_q8);
        gs_gelu_mul(gu, 2L * F, 1, F, g);
        prod1(&ly->down, F, g, f, nthreads, act_q8);
        gs_add_rms_norm(f, ly->post_ffn_norm, 1, D, eps, x, x);
        for (int i = 0; i < D; i++) x[i] = x[i] * ly->out_scale;
    }
    gs_rms_norm(x, out_norm, 1, D, eps, hidden);
    prod1(post, D, hidden, next_h, nthreads, act_q8);
    free(buf);
    if (head) {
        float *scores = (float *)malloc(sizeof(float) * (size_t)n_head);
        if (!scores) return -1;
        prod1(head, D, hidden, scores, nthreads, act_q8);
        head_pick(scores, n_head, token_map, best, p_best);
        free(scores);
    }
    return 0;
}

static inline void prodm(const gs_prod *p, int K, const float *x, int M, float *y, int nthreads, int act_q8) {
    qmatmul_multi(p->nseg, p->fmts, p->ws, p->ss, p->os, p->Gs, p->Ns, K, x, NULL, M, y, nthreads, act_q8 || p->q8);
}

/* One row's query norm + RoPE and attention over its own target K/V (a task of gs_assistant_steps: the
 * rows run on the pool's threads, each row's attention on one thread; gs_attention_mt's bits do not
 * depend on the thread count, so each row gets the solo step's bits). */
typedef struct {
    const gs_alayer *layers, *ly;
    int nl, l, hq, hkv, d;
    long ld;
    float eps;
    const float *qv;
    float *qr, *att;
    volatile int failed;
} as_att_job;

static void as_att_task(void *ctx, int r) {
    as_att_job *j = (as_att_job *)ctx;
    const gs_alayer *lr = &j->layers[(size_t)r * j->nl + j->l];
    const long ld = j->ld;
    gs_norm_rope(j->qv + r * ld, ld, 1, j->hq, j->d, j->ly->q_norm, j->hq, j->ly->q_norm, lr->cos, lr->sin, j->eps,
                 j->qr + r * ld);
    if (gs_attention(j->qr + r * ld, ld, 1, j->hq, j->hkv, j->d, lr->k, lr->v, lr->L, lr->mask, 1.f, 0.f,
                     j->att + r * ld) != 0)
        j->failed = 1;
}

/* The head pick of one row of a batched step (a task of gs_assistant_steps). */
typedef struct {
    const float *scores;
    int n_head;
    const int64_t *token_map;
    int64_t *best;
    float *p_best;
} as_pick_job;

static void as_pick_task(void *ctx, int r) {
    const as_pick_job *j = (const as_pick_job *)ctx;
    head_pick(j->scores + (size_t)r * j->n_head, j->n_head, j->token_map, j->best + r,
              j->p_best ? j->p_best + r : NULL);
}

/* One draft step for B sequences at once (several slots' rounds): row b reads its own target K/V, mask
 * and RoPE (layers[b * nl + l]: row b's layer l; the weights are read from row 0's), and every product
 * runs over the B rows together, so the weights are read once per step instead of once per slot. Every
 * operation is gs_assistant_step's on each row (the products are batch-invariant, the norms, RoPE and
 * attention work row by row), so row b's bits are those of gs_assistant_step on it alone. in [B, 2 Hb];
 * writes hidden [B, D], next_h [B, Hb] and, with a head, best [B] and p_best [B]. B <= 16 (the kernel's
 * batch-invariant row count). Returns 0, or -1 as gs_assistant_step. */
int gs_assistant_steps(int B, int nl, const gs_alayer *layers, const gs_prod *pre, const gs_prod *post,
                       const float *out_norm, const float *in, int Hb, int D, int hq, int hkv, int F, float eps,
                       float *hidden, float *next_h, const gs_prod *head, int n_head, const int64_t *token_map,
                       int64_t *best, float *p_best, int nthreads, int act_q8) {
    if (B < 1 || B > 16) return -1;
    int maxhd = 0;
    for (int l = 0; l < nl; l++) maxhd = layers[l].hd > maxhd ? layers[l].hd : maxhd;
    const size_t qn = (size_t)hq * maxhd, b = (size_t)B;
    float *buf = (float *)malloc(sizeof(float) * b * (4 * (size_t)D + 3 * qn + 3 * (size_t)F));
    if (!buf) return -1;
    float *x = buf, *h = x + b * D, *a = h + b * D, *f = a + b * D, *qv = f + b * D, *qr = qv + b * qn;
    float *att = qr + b * qn, *gu = att + b * qn, *g = gu + b * 2 * F;
    prodm(pre, 2 * Hb, in, B, x, nthreads, act_q8);
    for (int l = 0; l < nl; l++) {
        const gs_alayer *ly = &layers[l];
        const int d = ly->hd;
        const long ld = (long)hq * d;
        gs_rms_norm(x, ly->attn_norm, B, D, eps, h);
        prodm(&ly->q, D, h, B, qv, nthreads, act_q8);
        as_att_job aj = {layers, ly, nl, l, hq, hkv, d, ld, eps, qv, qr, att, 0};
        if (B == 1) { /* one row: its blocks of keys across the threads, as gs_assistant_step */
            const gs_alayer *lr = &layers[l];
            gs_norm_rope(qv, ld, 1, hq, d, ly->q_norm, hq, ly->q_norm, lr->cos, lr->sin, eps, qr);
            aj.failed = gs_attention_mt(qr, ld, 1, hq, hkv, d, lr->k, lr->v, lr->L, lr->mask, 1.f, 0.f, att, nthreads) != 0;
        } else {
            gs_parallel(B, nthreads, as_att_task, &aj);
        }
        if (aj.failed) {
            free(buf);
            return -1;
        }
        prodm(&ly->o, hq * d, att, B, a, nthreads, act_q8);
        gs_add_rms_norm(a, ly->post_attn_norm, B, D, eps, x, x);
        gs_rms_norm(x, ly->ffn_norm, B, D, eps, h);
        prodm(&ly->gate_up, D, h, B, gu, nthreads, act_q8); /* [gate | up] per row */
        gs_gelu_mul(gu, 2L * F, B, F, g);
        prodm(&ly->down, F, g, B, f, nthreads, act_q8);
        gs_add_rms_norm(f, ly->post_ffn_norm, B, D, eps, x, x);
        for (size_t i = 0; i < b * D; i++) x[i] = x[i] * ly->out_scale;
    }
    gs_rms_norm(x, out_norm, B, D, eps, hidden);
    prodm(post, D, hidden, B, next_h, nthreads, act_q8);
    free(buf);
    if (head) {
        float *scores = (float *)malloc(sizeof(float) * b * (size_t)n_head);
        if (!scores) return -1;
        prodm(head, D, hidden, B, scores, nthreads, act_q8);
        as_pick_job pj = {scores, n_head, token_map, best, p_best};
        gs_parallel(B, nthreads, as_pick_task, &pj); /* each row's pick on one thread: its bits alone */
        free(scores);
    }
    return 0;
}
