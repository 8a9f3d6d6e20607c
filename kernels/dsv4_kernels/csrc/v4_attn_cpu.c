/* DeepSeek-V4's decode attention on the CPU, one call per layer for the whole batch: each
 * request's query heads over its sliding-window ring (read in place through its slot row), this
 * step's own key and its visible compressed entries (read in place from the paged store through
 * the block table), with the per-head sink as one more logit whose value is dropped. The torch
 * form gathers the ring and the entries into a concatenated key tile, builds the masks and runs
 * ~25 ops a layer; at serving widths on the CPU their dispatch costs more than their arithmetic.
 *
 * Plain C on float32 (no torch headers), loaded with ctypes by dsv4_kernels.cpu_v4_attention.
 * Keys in the torch form's order (ring slots 0..W-1, this step's key, entries 0..C-1): the same
 * logits, max, exponentials and weights; the dot products and sums run in their own order where the
 * GEMMs block them (dot products in 64 lanes, folded), so results differ from the torch
 * form by rounding only. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 64 partial sums (four 16-lane vectors), added pairwise and folded in halves, then the tail:
 * a fixed order, all in vector registers (GCC / Clang vector extensions) */
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t d = 0;
    for (; d + 64 <= n; d += 64) {
        a0 += load16(a + d) * load16(b + d);
        a1 += load16(a + d + 16) * load16(b + d + 16);
        a2 += load16(a + d + 32) * load16(b + d + 32);
        a3 += load16(a + d + 48) * load16(b + d + 48);
    }
    for (; d + 16 <= n; d += 16) a0 += load16(a + d) * load16(b + d);
    v16 v = (a0 + a1) + (a2 + a3);
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    float s = v[0];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* softmax with the sink over K keys of one head, then the weighted sum of the keys into o [hd] */
static void attend(const float *qh, const float **keys, int64_t K, float sink, float scale, int64_t hd,
                   float *logit, float *o) {
    float top = sink;
    for (int64_t k = 0; k < K; k++) {
        logit[k] = dot(qh, keys[k], hd) * scale;
        if (logit[k] > top) top = logit[k];
    }
    float den = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        logit[k] = expf(logit[k] - top);
        den += logit[k];
    }
    den += expf(sink - top);
    for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        float p = logit[k] / den;
        const float *kk = keys[k];
        for (int64_t d = 0; d < hd; d++) o[d] += p * kk[d];
    }
}

/* q [B, H, hd]; kv [B, hd] (this step's key == value); ring: slot row r of this layer at
 * ring + r * ring_rs, [W, hd] contiguous; slots [B], pos [B] (int64).
 * Entries (C > 0): store + page * store_ps + (w % epp) * hd for page = bt[b * bt_rs + w * rate /
 * page_size]; visible [B, C] (uint8). sink [H]. out [B, H, hd]. */
void v4_attn_decode(const float *q, const float *kv, const float *ring, int64_t ring_rs, const int64_t *slots,
                    const int64_t *pos, int64_t W, const float *store, int64_t store_ps, int64_t epp,
                    const int32_t *bt, int64_t bt_rs, const uint8_t *visible, int64_t C, int64_t rate,
                    int64_t page_size, const float *sink, float scale, int64_t B, int64_t H, int64_t hd,
                    float *out) {
    int64_t kmax = W + 1 + C;
    const float **keys = malloc(sizeof(float *) * (size_t)kmax);
    float *logit = malloc(sizeof(float) * (size_t)kmax);
    for (int64_t b = 0; b < B; b++) {
        int64_t t = pos[b], K = 0;
        const float *row = ring + slots[b] * ring_rs;
        for (int64_t s = 0; s < W; s++) {
            /* the position ring slot s holds: the latest p <= t - 1 with p % W == s */
            int64_t r = (t - 1 - s) % W;
            if (r < 0) r += W;
            int64_t p = t - 1 - r;
            if (p > t - W && p >= 0) keys[K++] = row + s * hd;
        }
        keys[K++] = kv + b * hd;
        for (int64_t w = 0; w < C; w++) {
            if (!visible[b * C + w]) continue;
            int64_t page = bt[b * bt_rs + (w * rate) / page_size];
            keys[K++] = store + page * store_ps + (w % epp) * hd;
        }
        for (int64_t h = 0; h < H; h++)
            attend(q + (b * H + h) * hd, keys, K, sink[h], scale, hd, logit, out + (b * H + h) * hd);
    }
    free(keys);
    free(logit);
}

/* A prefill / mixed group: request b's n[b] new tokens sit at rows row[b] .. of q [T, H, hd] and
 * out [T, H, hd], at positions start[b] ..; ext [B, W + Lmax, hd] holds its positions
 * start[b] - W .. in order (the ring's, then the chunk's). A query at p sees positions
 * (p - W, p] that are >= 0, then entries [B, C, hd] (gathered) where visible [B, Lmax, C]. */
void v4_attn_extend(const float *q, const float *ext, int64_t ext_len, const int64_t *row, const int64_t *n,
                    const int64_t *start, int64_t W, const float *entries, const uint8_t *visible, int64_t C,
                    int64_t Lmax, const float *sink, float scale, int64_t B, int64_t H, int64_t hd, float *out) {
    const float **keys = malloc(sizeof(float *) * (size_t)(W + C));
    float *logit = malloc(sizeof(float) * (size_t)(W + C));
    for (int64_t b = 0; b < B; b++) {
        const float *e = ext + b * ext_len * hd;
        for (int64_t m = 0; m < n[b]; m++) {
            int64_t p = start[b] + m, K = 0;
            for (int64_t k = 0; k < W; k++)  /* position p - W + 1 + k is ext row m + 1 + k */
                if (p - W + 1 + k >= 0) keys[K++] = e + (m + 1 + k) * hd;
            for (int64_t w = 0; w < C; w++)
                if (visible[(b * Lmax + m) * C + w]) keys[K++] = entries + (b * C + w) * hd;
            int64_t r = row[b] + m;
            for (int64_t h = 0; h < H; h++)
                attend(q + (r * H + h) * hd, keys, K, sink[h], scale, hd, logit, out + (r * H + h) * hd);
        }
    }
    free(keys);
    free(logit);
}

/* The attention's per-row norms and rope in one pass: x [T, n, D] (rows at x + t * sx_t + i *
 * sx_n, channels contiguous) -> y [T, n, D] contiguous (may be x itself when x is contiguous).
 * do_rms: y = x / sqrt(mean(x^2) + eps), times w [D] when given; then the interleaved rope on the
 * trailing 2 * half channels with cis [T, half, 2] (cos, sin) of the row's position, turned by
 * -angle when conj. */
void v4_rms_rope(const float *x, int64_t T, int64_t n, int64_t D, int64_t sx_t, int64_t sx_n, int64_t do_rms,
                 const float *w, float eps, const float *cis, int64_t half, int64_t conj, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *c = cis + t * half * 2;
        for (int64_t i = 0; i < n; i++) {
            const float *xr = x + t * sx_t + i * sx_n;
            float *yr = y + (t * n + i) * D;
            if (do_rms) {
                float r = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);
                if (w)
                    for (int64_t d = 0; d < D; d++) yr[d] = w[d] * (xr[d] * r);
                else
                    for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * r;
            } else if (yr != xr) {
                for (int64_t d = 0; d < D; d++) yr[d] = xr[d];
            }
            float *p = yr + D - 2 * half;
            for (int64_t k = 0; k < half; k++) {
                float cs = c[2 * k], sn = conj ? -c[2 * k + 1] : c[2 * k + 1];
                float a = p[2 * k], b = p[2 * k + 1];
                p[2 * k] = a * cs - b * sn;
                p[2 * k + 1] = a * sn + b * cs;
            }
        }
    }
}
