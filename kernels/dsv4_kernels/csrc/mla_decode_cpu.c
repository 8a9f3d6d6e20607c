/* Absorbed-MLA decode attention over a paged latent cache, on the CPU, one thread.

   For each request b: one query token with H heads of width D (the absorbed no-rope part, then
   the rope part), the request's latent rows [D] read in place from the page pool through its
   page table, scores s[h][t] = (scale * q[h]) . kv[t], a softmax over t per head, and
   out[h] = sum_t p[h][t] * kv[t][:V]. Flash-decoding order: blocks of BLK rows, each block's
   scores first (every row read once for all heads), then the running max / denominator /
   accumulator updated by the block (one rescale per block, not per row).

   fp32 arithmetic throughout; the pool is fp32 or bf16 (bf16 rows widened to fp32 into a small
   tile). The dot products and the value sums use LANES partial sums in index order: a
   different summation order from torch's bmm, an fp32 rounding difference, not a different
   result (tests/unit/kernels/test_native_mla_decode.py bounds it). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLK 32
#define LANES 16

/* q . k over n values: LANES independent partial sums the compiler keeps in one vector
   register (no reassociation needed, so it vectorises without -ffast-math). */
static inline float dot(const float *restrict q, const float *restrict k, int64_t n) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += q[d + j] * k[d + j];
    float s = 0.0f;
    for (; d < n; d++) s += q[d] * k[d];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Returns 0, or -1 when a live token's page id is outside [0, num_pages) (nothing written for
   that request; the caller raises). kv_dtype: 0 = fp32, 1 = bf16. q is fp32 [B, H, D]
   contiguous, block_table int32 [B, table_stride] (only the columns a request's seq_len
   covers are read), out fp32 [B, H, V] contiguous. */
int mla_decode_paged(const float *q, const void *kv, int kv_dtype, int64_t num_pages, int64_t page_stride,
                     int64_t page_size, const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens,
                     int64_t B, int64_t H, int64_t D, int64_t V, float scale, float *out) {
    int status = 0;
    float *qs = malloc(sizeof(float) * H * D);
    float *s = malloc(sizeof(float) * H * BLK);
    float *m = malloc(sizeof(float) * H);
    float *den = malloc(sizeof(float) * H);
    float *tile = kv_dtype == 1 ? malloc(sizeof(float) * BLK * D) : NULL;
    const float *rows[BLK];
    if (!qs || !s || !m || !den || (kv_dtype == 1 && !tile)) {
        status = -2;
        goto done;
    }
    for (int64_t b = 0; b < B; b++) {
        float *o = out + b * H * V;
        memset(o, 0, sizeof(float) * H * V);
        int64_t len = seq_lens[b];
        if (len <= 0) continue;
        const int32_t *table = block_table + b * table_stride;
        int64_t last_page = (len - 1) / page_size;
        int bad = 0;
        for (int64_t c = 0; c <= last_page; c++)
            if (table[c] < 0 || table[c] >= num_pages) bad = 1;
        if (bad) {
            status = -1;
            continue;
        }
        const float *qb = q + b * H * D;
        for (int64_t i = 0; i < H * D; i++) qs[i] = qb[i] * scale; /* as torch: (q * scale) . k */
        for (int64_t h = 0; h < H; h++) {
            m[h] = -INFINITY;
            den[h] = 0.0f;
        }
        for (int64_t t0 = 0; t0 < len; t0 += BLK) {
            int n = (int)(len - t0 < BLK ? len - t0 : BLK);
            for (int i = 0; i < n; i++) {
                int64_t t = t0 + i;
                int64_t off = (int64_t)table[t / page_size] * page_stride + (t % page_size) * D;
                if (kv_dtype == 0) {
                    rows[i] = (const float *)kv + off;
                } else {
                    const uint16_t *src = (const uint16_t *)kv + off;
                    float *dst = tile + (int64_t)i * D;
                    for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
                    rows[i] = dst;
                }
            }
            for (int64_t h = 0; h < H; h++) {
                const float *qh = qs + h * D;
                float *sh = s + h * BLK;
                float bm = -INFINITY;
                for (int i = 0; i < n; i++) {
                    sh[i] = dot(qh, rows[i], D);
                    if (sh[i] > bm) bm = sh[i];
                }
                float mn = bm > m[h] ? bm : m[h];
                float *oh = o + h * V;
                if (mn > m[h] && m[h] != -INFINITY) { /* a new max: rescale what came before */
                    float alpha = expf(m[h] - mn);
                    den[h] *= alpha;
                    for (int64_t d = 0; d < V; d++) oh[d] *= alpha;
                }
                m[h] = mn;
                float sum = 0.0f;
                for (int i = 0; i < n; i++) {
                    sh[i] = expf(sh[i] - mn);
                    sum += sh[i];
                }
                den[h] += sum;
            }
            /* out[h] += sum_i p[h][i] * kv[i][:V]: each row (in L1) added to every head. */
            for (int i = 0; i < n; i++) {
                const float *r = rows[i];
                for (int64_t h = 0; h < H; h++) {
                    float p = s[h * BLK + i];
                    float *oh = o + h * V;
                    for (int64_t d = 0; d < V; d++) oh[d] += p * r[d];
                }
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float dh = den[h] > 0.0f ? den[h] : 1.0f;
            float *oh = o + h * V;
            for (int64_t d = 0; d < V; d++) oh[d] /= dh;
        }
    }
done:
    free(qs);
    free(s);
    free(m);
    free(den);
    free(tile);
    return status;
}
