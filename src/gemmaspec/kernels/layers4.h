/*
 * Gemma 4's per-layer helpers (included at the end of qmatmul.c, after stepops.h).
 */

/* out [n, f] = gelu_tanh(g) * u for g [n, ldg >= f], u [n, ldu >= f]: gs_gelu_mul's arithmetic with the
 * two factors in separate buffers (Gemma 4's per-layer input gate times the layer's input vector). */
void gs_gelu_mul2(const float *g, long ldg, const float *u, long ldu, int n, int f, float *out) {
    for (int r = 0; r < n; r++) {
        const float *gr = g + (long)r * ldg, *ur = u + (long)r * ldu;
        float *o = out + (long)r * f;
        for (int i = 0; i < f; i++) {
            const float a = gr[i];
            const float z = 0.7978845608028654f * (a + 0.044715f * (a * a * a));
            const float th = 1.f - 2.f / (1.f + gs_expf(2.f * z));
            o[i] = (0.5f * a * (1.f + th)) * ur[i];
        }
    }
}

