/* Absorbed-MLA decode attention over a paged latent cache, on the CPU, one thread.

   For each request b: one query token with H heads of width D (the absorbed no-rope part, then
   the rope part), the request's latent rows [D] read in place from the page pool through its
   page table, scores s[h][t] = (scale * q[h]) . kv[t], a softmax over t per head, and
   out[h] = sum_t p[h][t] * kv[t][:V]. Flash-decoding order: blocks of BLK rows, each block's
   scores first (every row read once for all heads), then the running max / denominator /
   accumulator updated by the block (one rescale per block, not per row, folded into the
   block's value pass). Register blocking: scores take two rows x up to four heads per pass
   over D, values up to eight heads x 32 columns per pass over the block's rows, so a loaded
   row feeds several FMAs and the accumulators stay in registers (measured 1.2-1.4x CPU time
   over one dot and one axpy per row and head on this project's EPYC test box; four rows per
   score pass measured the same as two). Blocks of 64 rows and a software prefetch of the next
   block each measured ~8% at 32 requests whose pages (56 MB over 4 layers) stream from memory.

   fp32 arithmetic throughout; the pool is fp32 or bf16 (bf16 rows widened to fp32 into a small
   tile). The dot products use W partial sums in index order and the value sums run over the
   rows in order: a different summation order from torch's bmm, an fp32 rounding difference,
   not a different result (tests/unit/kernels/test_native_mla_decode.py bounds it). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLK 64
#define W 16 /* floats in one vector register (AVX-512; two AVX2 registers elsewhere) */

/* GCC/clang vector extension: one v16 is W floats, loaded unaligned from any float pointer. */
typedef float v16 __attribute__((vector_size(W * sizeof(float)), aligned(4)));

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int j = 0; j < W; j++) s += v[j];
    return s;
}

/* s[h * BLK + i] = qs[h] . rows[i] for G heads h0.. and the rows i0, i0 + 1 (i1 may equal i0:
   then both pairs compute the same row). The 2 x G partial sums stay in registers over D. */
static inline __attribute__((always_inline)) void scores_group(int G, const float *qs, int64_t h0, const float *r0,
                                                                const float *r1, int i0, int i1, int64_t D,
                                                                float *s) {
    v16 a0[8], a1[8];
    for (int g = 0; g < G; g++) a0[g] = a1[g] = (v16){0};
    int64_t d = 0;
    for (; d + W <= D; d += W) {
        v16 k0 = *(const v16 *)(r0 + d), k1 = *(const v16 *)(r1 + d);
        for (int g = 0; g < G; g++) {
            v16 qv = *(const v16 *)(qs + (h0 + g) * D + d);
            a0[g] += qv * k0;
            a1[g] += qv * k1;
        }
    }
    for (int g = 0; g < G; g++) {
        const float *qh = qs + (h0 + g) * D;
        float t0 = 0.0f, t1 = 0.0f;
        for (int64_t e = d; e < D; e++) {
            t0 += qh[e] * r0[e];
            t1 += qh[e] * r1[e];
        }
        s[(h0 + g) * BLK + i0] = hsum(a0[g]) + t0;
        s[(h0 + g) * BLK + i1] = hsum(a1[g]) + t1;
    }
}

static void scores_block(const float *qs, int64_t H, const float *const *rows, int n, int64_t D, float *s) {
    for (int i = 0; i < n; i += 2) {
        int j = i + 1 < n ? i + 1 : i;
        int64_t h = 0;
        for (; h + 4 <= H; h += 4) scores_group(4, qs, h, rows[i], rows[j], i, j, D, s);
        for (; h + 2 <= H; h += 2) scores_group(2, qs, h, rows[i], rows[j], i, j, D, s);
        for (; h < H; h++) scores_group(1, qs, h, rows[i], rows[j], i, j, D, s);
    }
}

/* o[h][:V] = o[h][:V] * alpha[h] + sum_i p[h][i] * rows[i][:V] for G heads h0..: per chunk of W
   values the G accumulators stay in registers over the block's rows (the old o read and
   written once per block, the rescale folded into that read). */
static inline __attribute__((always_inline)) void values_group(int G, float *o, int64_t h0, const float *alpha,
                                                                const float *p, const float *const *rows, int n,
                                                                int64_t V) {
    int64_t d = 0;
    for (; d + 2 * W <= V; d += 2 * W) { /* two chunks: each broadcast p feeds two FMAs */
        v16 a0[8], a1[8];
        for (int g = 0; g < G; g++) {
            a0[g] = *(v16 *)(o + (h0 + g) * V + d) * alpha[h0 + g];
            a1[g] = *(v16 *)(o + (h0 + g) * V + d + W) * alpha[h0 + g];
        }
        for (int i = 0; i < n; i++) {
            v16 r0 = *(const v16 *)(rows[i] + d), r1 = *(const v16 *)(rows[i] + d + W);
            for (int g = 0; g < G; g++) {
                float pg = p[(h0 + g) * BLK + i];
                a0[g] += pg * r0;
                a1[g] += pg * r1;
            }
        }
        for (int g = 0; g < G; g++) {
            *(v16 *)(o + (h0 + g) * V + d) = a0[g];
            *(v16 *)(o + (h0 + g) * V + d + W) = a1[g];
        }
    }
    for (; d + W <= V; d += W) {
        v16 acc[8];
        for (int g = 0; g < G; g++) acc[g] = *(v16 *)(o + (h0 + g) * V + d) * alpha[h0 + g];
        for (int i = 0; i < n; i++) {
            v16 r = *(const v16 *)(rows[i] + d);
            for (int g = 0; g < G; g++) acc[g] += p[(h0 + g) * BLK + i] * r;
        }
        for (int g = 0; g < G; g++) *(v16 *)(o + (h0 + g) * V + d) = acc[g];
    }
    for (; d < V; d++)
        for (int g = 0; g < G; g++) {
            float a = o[(h0 + g) * V + d] * alpha[h0 + g];
            for (int i = 0; i < n; i++) a += p[(h0 + g) * BLK + i] * rows[i][d];
            o[(h0 + g) * V + d] = a;
        }
}

static void values_block(float *o, int64_t H, const float *alpha, const float *p, const float *const *rows, int n,
                         int64_t V) {
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) values_group(8, o, h, alpha, p, rows, n, V);
    for (; h + 4 <= H; h += 4) values_group(4, o, h, alpha, p, rows, n, V);
    for (; h + 2 <= H; h += 2) values_group(2, o, h, alpha, p, rows, n, V);
    for (; h < H; h++) values_group(1, o, h, alpha, p, rows, n, V);
}

/* Returns 0, or -1 when a live token's page id is outside [0, num_pages) or a seq_len needs more
   than the table's table_width columns (that request's output left zero; the caller raises). kv_dtype: 0 = fp32, 1 = bf16. q is fp32 [B, H, D]
   contiguous, block_table int32 [B, table_stride] (only the columns a request's seq_len
   covers are read), out fp32 [B, H, V] contiguous. */
int mla_decode_paged(const float *q, const void *kv, int kv_dtype, int64_t num_pages, int64_t page_stride,
                     int64_t page_size, const int32_t *block_table, int64_t table_width, int64_t table_stride,
                     const int32_t *seq_lens, int64_t B, int64_t H, int64_t D, int64_t V, float scale, float *out) {
    int status = 0;
    float *qs = malloc(sizeof(float) * H * D);
    float *s = malloc(sizeof(float) * H * BLK);
    float *m = malloc(sizeof(float) * H);
    float *den = malloc(sizeof(float) * H);
    float *alpha = malloc(sizeof(float) * H);
    float *tile = kv_dtype == 1 ? malloc(sizeof(float) * BLK * D) : NULL;
    const float *rows[BLK];
    if (!qs || !s || !m || !den || !alpha || (kv_dtype == 1 && !tile)) {
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
        int bad = last_page >= table_width;
        for (int64_t c = 0; c <= last_page && !bad; c++)
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
            /* the next block's rows towards the cache while this one computes: pages are far
               apart in the pool and a page is several 4 KiB runs the hardware prefetcher restarts on */
            int64_t t1 = t0 + BLK, t2 = t0 + 2 * BLK < len ? t0 + 2 * BLK : len;
            for (int64_t t = t1; t < t2; t++) {
                const char *row = (const char *)kv + ((int64_t)table[t / page_size] * page_stride +
                                                      (t % page_size) * D) * (kv_dtype == 0 ? 4 : 2);
                for (int64_t c = 0; c < D * (kv_dtype == 0 ? 4 : 2); c += 64) __builtin_prefetch(row + c, 0, 3);
            }
            scores_block(qs, H, rows, n, D, s);
            for (int64_t h = 0; h < H; h++) {
                float *sh = s + h * BLK;
                float bm = -INFINITY;
                for (int i = 0; i < n; i++)
                    if (sh[i] > bm) bm = sh[i];
                float mn = bm > m[h] ? bm : m[h];
                /* a new max rescales what came before (folded into values_block's read) */
                alpha[h] = m[h] == -INFINITY ? 0.0f : (mn > m[h] ? expf(m[h] - mn) : 1.0f);
                den[h] *= alpha[h];
                m[h] = mn;
                float sum = 0.0f;
                for (int i = 0; i < n; i++) {
                    sh[i] = expf(sh[i] - mn);
                    sum += sh[i];
                }
                den[h] += sum;
            }
            values_block(o, H, alpha, s, rows, n, V);
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
    free(alpha);
    free(tile);
    return status;
}
