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
 * GEMMs block them (dot products in 16 lanes, then the lanes), so results differ from the torch
 * form by rounding only. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* 16 partial sums (one vector register's lanes), then the lanes in order */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[d + l] * b[d + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
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
        for (int64_t h = 0; h < H; h++) {
            const float *qh = q + (b * H + h) * hd;
            float top = sink[h];
            for (int64_t k = 0; k < K; k++) {
                const float *kk = keys[k];
                logit[k] = dot(qh, kk, hd) * scale;
                if (logit[k] > top) top = logit[k];
            }
            float den = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                logit[k] = expf(logit[k] - top);
                den += logit[k];
            }
            den += expf(sink[h] - top);
            float *o = out + (b * H + h) * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                float p = logit[k] / den;
                const float *kk = keys[k];
                for (int64_t d = 0; d < hd; d++) o[d] += p * kk[d];
            }
        }
    }
    free(keys);
    free(logit);
}
