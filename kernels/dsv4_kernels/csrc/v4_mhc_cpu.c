/* DeepSeek-V4's mHC on the CPU after its mixing linear, one call per layer half for the whole
 * batch: the torch form is ~15 torch ops plus ~80 numpy ops (20 Sinkhorn rounds) on [T, 4, 4],
 * each costing far more in dispatch than its arithmetic at these sizes.
 *
 * Plain C on float32 (no torch headers: it builds in well under a second), loaded with ctypes by
 * dsv4_kernels.cpu_mhc. Built with -ffp-contract=off so every product is rounded before its sum,
 * as torch's and numpy's elementwise ops round; sums run in index order, as numpy's do over 4. */
#include <math.h>
#include <stdint.h>

#define HC_MAX 16

/* Sinkhorn on the comb matrices of tokens t0 .. t0 + nb - 1 (nb <= LANES): columns, then
 * (rows, columns) iters - 1 times. Tokens sit in the lanes of each step, so the divisions run
 * as vector ops; every token gets the same operations in the same order as one at a time. */
#define LANES 16
static void sinkhorn_block(float *comb, int64_t t0, int64_t nb, int64_t hc, float hc_eps, int64_t iters) {
    float c[HC_MAX * HC_MAX][LANES], s[LANES], cs[HC_MAX][LANES];
    int64_t hh = hc * hc;
    for (int64_t e = 0; e < hh; e++)
        for (int64_t l = 0; l < LANES; l++) c[e][l] = l < nb ? comb[(t0 + l) * hh + e] : 1.0f;
    for (int64_t it = 0; it < iters; it++) {
        if (it > 0) {
            for (int64_t j = 0; j < hc; j++) {
                for (int l = 0; l < LANES; l++) s[l] = 0.0f;
                for (int64_t k = 0; k < hc; k++)
                    for (int l = 0; l < LANES; l++) s[l] += c[j * hc + k][l];
                for (int l = 0; l < LANES; l++) s[l] += hc_eps;
                for (int64_t k = 0; k < hc; k++)
                    for (int l = 0; l < LANES; l++) c[j * hc + k][l] /= s[l];
            }
        }
        for (int64_t k = 0; k < hc; k++)
            for (int l = 0; l < LANES; l++) cs[k][l] = 0.0f;
        for (int64_t j = 0; j < hc; j++)
            for (int64_t k = 0; k < hc; k++)
                for (int l = 0; l < LANES; l++) cs[k][l] += c[j * hc + k][l];
        for (int64_t k = 0; k < hc; k++)
            for (int l = 0; l < LANES; l++) cs[k][l] += hc_eps;
        for (int64_t j = 0; j < hc; j++)
            for (int64_t k = 0; k < hc; k++)
                for (int l = 0; l < LANES; l++) c[j * hc + k][l] /= cs[k][l];
    }
    for (int64_t e = 0; e < hh; e++)
        for (int64_t l = 0; l < nb; l++) comb[(t0 + l) * hh + e] = c[e][l];
}

/* mixes [T, (2 + hc) * hc] (pre | post | comb logits, rows ldm apart), base [(2 + hc) * hc],
 * scale [3]; x [T, hc, D] float32 contiguous.
 * out: post [T, hc], comb [T, hc, hc], collapsed [T, D] = sum_j pre[j] * x[j]. */
void v4_hc_pre_tail(const float *mixes, int64_t ldm, const float *base, const float *scale, const float *x,
                    int64_t T, int64_t hc, int64_t D, float hc_eps, int64_t iters, float *post, float *comb,
                    float *collapsed) {
    for (int64_t t = 0; t < T; t++) {
        const float *m = mixes + t * ldm;
        float pre[HC_MAX];
        for (int64_t j = 0; j < hc; j++) {
            float a = m[j] * scale[0] + base[j];
            pre[j] = 1.0f / (1.0f + expf(-a)) + hc_eps;
            float b = m[hc + j] * scale[1] + base[hc + j];
            post[t * hc + j] = 2.0f * (1.0f / (1.0f + expf(-b)));
        }
        float *c = comb + t * hc * hc;
        for (int64_t j = 0; j < hc; j++) {
            float mx = -INFINITY;
            for (int64_t k = 0; k < hc; k++) {
                float z = m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
                c[j * hc + k] = z;
                if (z > mx) mx = z;
            }
            float s = 0.0f;
            for (int64_t k = 0; k < hc; k++) {
                float e = expf(c[j * hc + k] - mx);
                c[j * hc + k] = e;
                s += e;
            }
            for (int64_t k = 0; k < hc; k++) c[j * hc + k] = c[j * hc + k] / s + hc_eps;
        }
        const float *xt = x + t * hc * D;
        float *o = collapsed + t * D;
        for (int64_t d = 0; d < D; d++) o[d] = pre[0] * xt[d];
        for (int64_t j = 1; j < hc; j++) {
            const float *xj = xt + j * D;
            float p = pre[j];
            for (int64_t d = 0; d < D; d++) o[d] += p * xj[d];
        }
    }
    for (int64_t t0 = 0; t0 < T; t0 += LANES)
        sinkhorn_block(comb, t0, T - t0 < LANES ? T - t0 : LANES, hc, hc_eps, iters);
}

/* mHC post step: the layer's output a [T, D] joins the streams x [T, hc, D] as
 * y[t, k] = post[t, k] * a[t] + sum_j comb[t, j, k] * x[t, j] (comb applied transposed), for the
 * whole batch in one call where torch runs a batched 4x4 GEMM plus ~5 ops. The product
 * post * a is rounded first, then the stream terms are added in j order. */
void v4_hc_post(const float *x, const float *a, const float *post, const float *comb, int64_t T, int64_t hc,
                int64_t D, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * hc * D, *at = a + t * D, *c = comb + t * hc * hc;
        for (int64_t k = 0; k < hc; k++) {
            float *o = y + (t * hc + k) * D;
            float p = post[t * hc + k];
            for (int64_t d = 0; d < D; d++) o[d] = p * at[d];
            for (int64_t j = 0; j < hc; j++) {
                const float *xj = xt + j * D;
                float w = c[j * hc + k];
                for (int64_t d = 0; d < D; d++) o[d] += w * xj[d];
            }
        }
    }
}
