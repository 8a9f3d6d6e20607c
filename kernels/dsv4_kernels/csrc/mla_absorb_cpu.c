/* The two per-head projections around absorbed-MLA attention, on the CPU, one thread:

   absorb_q:  qf[t][h][:C] = q[t][h][:N] @ w_uk[h]      (w_uk [H, N, C]: the query into latent space)
              qf[t][h][C:] = q[t][h][N:N+R]            (the rope part, copied beside it)
   apply_uv:  y[t][h][:V]  = o[t][h][:C] @ w_uvt[h]     (w_uvt [H, C, V]: latent -> value per head)

   torch's bmm does each as H small GEMMs of T rows plus a transpose, a cat and a reshape copy
   around them; at decode sizes (T = 1-64) those cost more than the multiply-adds, and the
   weights (2 x 1 MiB a layer at mla512) are read once per step either way. Here both are one
   pass per head in axpy form: a tile of up to 4 tokens x 64 output columns stays in 16 vector
   registers over the head's N (or C) weight rows, each loaded weight vector feeding 4 FMAs.

   fp32 throughout; each output is summed over k in index order (torch's bmm blocks k in
   another order: an fp32 rounding difference, tests/unit/kernels/test_native_mla_absorb.py
   bounds it against fp64). */

#include <stdint.h>

#define W 16
#define TT 4 /* tokens per register tile */
#define CW 4 /* vectors of W columns per register tile */

typedef float v16 __attribute__((vector_size(W * sizeof(float)), aligned(4)));

/* y[t][0:n_cols] (row stride ys) = sum_k x[t][k] * w[k][0:n_cols] for the nt <= TT tokens at
   x + t * xs, over K weight rows. Columns in tiles of CW * W (the tile j's row k at
   w + j * ts + k * ws), then vectors and a scalar tail at w + k * ws + c (a row-major w: ts =
   CW * W; a tile-packed one, [n_cols / (CW * W)][K][CW * W], has ws = CW * W, ts = K * CW * W and
   no tail). */
static inline __attribute__((always_inline)) void tile_axpy(int nt, const float *x, int64_t xs, const float *w,
                                                             int64_t ws, int64_t ts, int64_t K, int64_t n_cols,
                                                             float *y, int64_t ys) {
    int64_t c = 0;
    for (; c + CW * W <= n_cols; c += CW * W) {
        v16 acc[TT][CW];
        for (int t = 0; t < TT; t++)
            for (int j = 0; j < CW; j++) acc[t][j] = (v16){0};
        const float *wt = w + c / (CW * W) * ts;
        for (int64_t k = 0; k < K; k++) {
            const float *wr = wt + k * ws;
            v16 w0 = *(const v16 *)(wr), w1 = *(const v16 *)(wr + W), w2 = *(const v16 *)(wr + 2 * W),
                w3 = *(const v16 *)(wr + 3 * W);
            for (int t = 0; t < nt; t++) {
                float a = x[t * xs + k];
                acc[t][0] += a * w0;
                acc[t][1] += a * w1;
                acc[t][2] += a * w2;
                acc[t][3] += a * w3;
            }
        }
        for (int t = 0; t < nt; t++)
            for (int j = 0; j < CW; j++) *(v16 *)(y + t * ys + c + j * W) = acc[t][j];
    }
    for (; c + W <= n_cols; c += W) {
        v16 acc[TT];
        for (int t = 0; t < TT; t++) acc[t] = (v16){0};
        for (int64_t k = 0; k < K; k++) {
            v16 wv = *(const v16 *)(w + k * ws + c);
            for (int t = 0; t < nt; t++) acc[t] += x[t * xs + k] * wv;
        }
        for (int t = 0; t < nt; t++) *(v16 *)(y + t * ys + c) = acc[t];
    }
    for (; c < n_cols; c++)
        for (int t = 0; t < nt; t++) {
            float a = 0.0f;
            for (int64_t k = 0; k < K; k++) a += x[t * xs + k] * w[k * ws + c];
            y[t * ys + c] = a;
        }
}

/* q: [T, H, N + R] with token stride qs_t and head stride qs_h (channels contiguous);
   w_uk: [H, N, C] contiguous, or with `packed` (C a multiple of CW * W) [H, C / (CW * W), N, CW * W]:
   a tile's rows one after another, so the pass reads the weights in order (row-major, a tile's
   strip of each row sits 2 KB from the next one's: the prefetcher loses it and the strips fight
   over a few L1 sets); qf: [T, H, C + R] contiguous. */
void absorb_q(const float *q, int64_t T, int64_t H, int64_t N, int64_t R, int64_t qs_t, int64_t qs_h,
              const float *w_uk, int64_t C, int packed, float *qf) {
    int64_t D = C + R;
    int64_t ws = packed ? CW * W : C, ts = packed ? N * CW * W : CW * W;
    for (int64_t h = 0; h < H; h++) {
        const float *wh = w_uk + h * N * C;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            int nt = (int)(T - t0 < TT ? T - t0 : TT);
            tile_axpy(nt, q + t0 * qs_t + h * qs_h, qs_t, wh, ws, ts, N, C, qf + (t0 * H + h) * D, H * D);
        }
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *src = q + t * qs_t + h * qs_h + N;
            float *dst = qf + (t * H + h) * D + C;
            for (int64_t r = 0; r < R; r++) dst[r] = src[r];
        }
}

/* o: [T, H, C] with token stride os_t and head stride os_h (channels contiguous);
   w_uvt: [H, C, V] contiguous; y: [T, H, V] contiguous. */
void apply_uv(const float *o, int64_t T, int64_t H, int64_t C, int64_t os_t, int64_t os_h, const float *w_uvt,
              int64_t V, float *y) {
    for (int64_t h = 0; h < H; h++) {
        const float *wh = w_uvt + h * C * V;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            int nt = (int)(T - t0 < TT ? T - t0 : TT);
            tile_axpy(nt, o + t0 * os_t + h * os_h, os_t, wh, V, CW * W, C, V, y + (t0 * H + h) * V, H * V);
        }
    }
}
