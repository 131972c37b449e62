/* A command-line driver of qmatmul.c for testing a kernel path this machine cannot load (ARM NEON built
 * with a cross compiler and run under qemu-user): reads one product from a file, writes y.
 *
 * Input (little-endian): int32 fmt, N, K, G, M, nthreads, has_s, has_o, xsum_g; int64 w_bytes; then
 * w_bytes bytes of weights, [N, K/G] fp32 scales if has_s, [N, K/G] fp32 offsets if has_o,
 * [M, K] fp32 x. xsum_g > 0: the harness computes block sums of x over xsum_g values (gs_block_sums).
 * Output: [M, N] fp32 y, then the path name (gs_isa). A third argument "q8": the int8-activation product
 * (gs_qmatmul_multi_q8). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *gs_isa(void);
void gs_block_sums(const float *x, int M, int K, int G, float *xsum);
void gs_qmatmul_multi(int nseg, const int *fmts, const void *const *ws, const float *const *ss,
                      const float *const *os, const int *Gs, const int *Ns, int K, const float *x,
                      const float *xsum, int M, float *y, int nthreads);
void gs_qmatmul_multi_q8(int nseg, const int *fmts, const void *const *ws, const float *const *ss,
                         const float *const *os, const int *Gs, const int *Ns, int K, const float *x,
                         const float *xsum, int M, float *y, int nthreads);

static void *take(FILE *f, size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p || fread(p, 1, n, f) != n) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) return 2;
    const int q8 = argc == 4 && strcmp(argv[3], "q8") == 0; /* int8 activations (qdot8.h) */
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 2;
    int32_t *h = take(f, 9 * 4);
    const int fmt = h[0], N = h[1], K = h[2], G = h[3], M = h[4], nt = h[5], xg = h[8];
    int64_t wb;
    memcpy(&wb, take(f, 8), 8);
    const void *w = take(f, (size_t)wb);
    const float *s = h[6] ? take(f, (size_t)N * (K / G) * 4) : NULL;
    const float *o = h[7] ? take(f, (size_t)N * (K / G) * 4) : NULL;
    const float *x = take(f, (size_t)M * K * 4);
    fclose(f);
    float *xsum = NULL;
    if (xg > 0) {
        xsum = malloc((size_t)M * (K / xg) * 4);
        gs_block_sums(x, M, K, xg, xsum);
    }
    float *y = malloc((size_t)M * N * 4);
    (q8 ? gs_qmatmul_multi_q8 : gs_qmatmul_multi)(1, &fmt, &w, &s, &o, &G, &N, K, x, xsum, M, y, nt);
    FILE *out = fopen(argv[2], "wb");
    fwrite(y, 4, (size_t)M * N, out);
    fputs(gs_isa(), out);
    fclose(out);
    return 0;
}
