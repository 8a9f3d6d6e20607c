/* Absorbed-MLA decode attention over a paged latent cache, on the CPU, one thread.

   For each request b: one query token with H heads of width D (the absorbed no-rope part, then
   the rope part), the request's latent rows [D] read in place from the page pool through its
   page table, scores s[h][t] = (scale * q[h]) . kv[t], a softmax over t per head, and
   out[h] = sum_t p[h][t] * kv[t][:V]. Flash-decoding order: blocks of BLK rows, each block's
   scores first (every row read once for all heads), then the running max / denominator /
   accumulator updated by the block (one rescale per block, not per row, folded into the
   block's value pass). Register blocking: scores take SR rows x eight heads per pass over D,
   values up to eight heads x 32 columns per pass over the block's rows, so a loaded row feeds
   several FMAs and the accumulators stay in registers.

   Measured on this project's EPYC (Zen 4) test box, CPU time of one thread, at 8-64 requests
   of ~160 rows in a 4-layer page-major pool (bench/ab_attention.py --native --base):
   - loads kept out of the FMAs: GCC folded each q (and row) load into every FMA that used it,
     so the score loop issued 18 loads for 16 FMAs and was load-bound; an empty asm pins each
     loaded vector in a register (10 loads for 16 FMAs with two rows, 11 for 24 with three);
   - the (row, head) dot products' partial sums reduced 16 at a time by a transpose/add tree
     (reduce16) instead of 16 sequential scalar adds with a lane extraction each;
   - a vector exp over a head's block of scores instead of libm's expf per (row, head);
   - the next block's prefetch (which may be the next request's first) issued a row at a time
     as the block's work progresses through both passes, instead of one burst of ~2300 lines
     at the block's start, which filled the miss buffers and stalled the loads behind it;
   - three rows per score pass rather than two (a few %: fewer loads per FMA).
   The software prefetch is still needed: a page is several 4 KiB runs the hardware prefetcher
   restarts on, and pages are far apart in the pool (without it, ~1.6x the time at 32 requests).

   fp32 arithmetic throughout; the pool is fp32 or bf16 (bf16 rows widened to fp32 into a small
   tile). The dot products use W partial sums in index order and the value sums run over the
   rows in order: a different summation order from torch's bmm, an fp32 rounding difference,
   not a different result (tests/unit/kernels/test_native_mla_decode.py bounds it). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLK 64
#define W 16  /* floats in one vector register (AVX-512; two AVX2 registers elsewhere) */
#define SR 3  /* rows per score pass: 3 x 8 heads = 24 accumulators, + 3 rows + 1 q in 32 registers */
#define LINE 64

/* GCC/clang vector extension: one v16 is W floats, loaded unaligned from any float pointer. */
typedef float v16 __attribute__((vector_size(W * sizeof(float)), aligned(4)));
typedef uint32_t u16v __attribute__((vector_size(W * sizeof(uint32_t)), aligned(4)));

#define INLINE static inline __attribute__((always_inline))
#define SHUF __builtin_shufflevector

/* v as an operand in a register: keeps the compiler from folding its load into each FMA that
   uses it (one load per use). Only where a v16 is one register (AVX-512). */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

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

/* Lane j of the result = the sum of a[j]'s lanes: four levels of pairing halves (16 -> 8 -> 4 ->
   2 -> 1 vectors), each an add of two shuffles, so 16 sums cost 15 adds and 30 shuffles. */
INLINE v16 reduce16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)
        b[k] = SHUF(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUF(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++)
        c[k] = SHUF(b[2 * k], b[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUF(b[2 * k], b[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++)
        d[k] = SHUF(c[2 * k], c[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUF(c[2 * k], c[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUF(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

INLINE v16 select16(u16v mask, v16 a, v16 b) { /* mask ? a : b, lane by lane */
    u16v ua, ub;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    ua = (ua & mask) | (ub & ~mask);
    memcpy(&a, &ua, sizeof a);
    return a;
}

/* exp(x) for x <= 0 (a score minus the running max), -inf -> 0, NaN stays NaN: x = n ln2 + r
   with |r| <= ln2 / 2 (ln2 in two parts, the first exact times any n here), exp(r) by its
   Taylor series to r^7 (truncation < 6e-9 relative) in Horner form, times 2^n built in the
   exponent bits. Within 1 ulp of the correctly rounded exp over [-87, 0] (checked against
   fp64 exp at every float in [-20, 0] and a sample below). Below -87 (exp < 2^-125, nothing
   next to the max's exp(0) = 1 in the denominator) it gives 0. */
INLINE v16 exp_v16(v16 x) {
    const v16 lo = (v16){0} - 87.0f;
    u16v under = (u16v)(x < lo);
    v16 xc = select16(under, lo, x);  /* NaN compares false: kept */
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer n in the low bits */
    v16 t = xc * 1.44269504088896341f + magic;
    v16 n = t - magic;
    v16 r = xc - n * 0.693359375f; /* exact: ln2's first 9 bits times |n| <= 126 */
    r = r - n * -2.12194440054690583e-4f;
    v16 p = r * (1.0f / 5040) + (1.0f / 720);
    p = p * r + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    u16v e;
    memcpy(&e, &t, sizeof e);
    e = (e << 23) + (127u << 23); /* 2^n: t's bits are magic's + n, and magic's low 9 bits are 0 */
    v16 two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return select16(under, (v16){0}, p * two_n);
}

/* The next block's rows on their way to the cache while this block computes, a row at a time:
   rows [0, upto) asked for, upto following the block's progress through its score pass (the
   first share fs of its work) and its value pass. */
typedef struct {
    const char *const *rows;
    int nrows, row;
    int64_t row_bytes;
    int vsteps, vstep; /* the value pass's steps (one per group of heads and 2 W columns), done */
    float fs;          /* the score pass's share of the block's work */
} prefetcher;

static inline void prefetch_upto(prefetcher *pf, int upto) {
    upto = upto < pf->nrows ? upto : pf->nrows;
    for (; pf->row < upto; pf->row++)
        for (int64_t c = 0; c < pf->row_bytes; c += LINE) __builtin_prefetch(pf->rows[pf->row] + c, 0, 1);
}

/* s[h * BLK + i] = qs[h] . rows[i] for G heads h0.. and R rows i0.. (repeating the last row
   past n: then a row's score is written twice, the same value). The R x G partial sums stay in
   registers over D, then reduce16 gives 16 of their sums at a time in one vector. */
INLINE void scores_group(int R, int G, const float *qs, int64_t h0, const float *const *rows, int i0, int n,
                         int64_t D, float *s) {
    const float *r[SR];
    int idx[SR];
    for (int k = 0; k < R; k++) {
        idx[k] = i0 + k < n ? i0 + k : n - 1;
        r[k] = rows[idx[k]];
    }
    v16 acc[32];
    for (int j = 0; j < 32; j++) acc[j] = (v16){0};
    int64_t d = 0;
    for (; d + W <= D; d += W) {
        v16 k[SR];
        for (int a = 0; a < R; a++) {
            v16 kv = *(const v16 *)(r[a] + d);
            IN_REGISTER(kv);
            k[a] = kv;
        }
        for (int g = 0; g < G; g++) {
            v16 qv = *(const v16 *)(qs + (h0 + g) * D + d);
            IN_REGISTER(qv);
            for (int a = 0; a < R; a++) acc[a * G + g] += qv * k[a];
        }
    }
    float sum[32];
    for (int j = 0; j < R * G; j += 16) *(v16 *)(sum + j) = reduce16(acc + j);
    if (d < D) /* the columns past the last whole vector, one product at a time */
        for (int a = 0; a < R; a++)
            for (int g = 0; g < G; g++) {
                const float *qh = qs + (h0 + g) * D;
                for (int64_t e = d; e < D; e++) sum[a * G + g] += qh[e] * r[a][e];
            }
    for (int a = 0; a < R; a++)
        for (int g = 0; g < G; g++) s[(h0 + g) * BLK + idx[a]] = sum[a * G + g];
}

static void scores_block(const float *qs, int64_t H, const float *const *rows, int n, int64_t D, float *s,
                         prefetcher *pf) {
    for (int i = 0; i < n; i += SR) {
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) scores_group(SR, 8, qs, h, rows, i, n, D, s);
        for (; h + 4 <= H; h += 4) scores_group(SR, 4, qs, h, rows, i, n, D, s);
        for (; h < H; h++) scores_group(SR, 1, qs, h, rows, i, n, D, s);
        prefetch_upto(pf, (int)(pf->nrows * pf->fs * (i + SR < n ? i + SR : n) / n));
    }
}

/* o[h][d, d + k C W) = o * alpha[h] + sum_i p[h][i] * rows[i][same columns] for G heads h0..,
   C vectors of columns at a time (G x C accumulators in registers over the block's rows: the
   old o read and written once per block, the rescale folded into that read); returns where it
   stopped (fewer than C W columns left). */
INLINE int64_t values_cols(int G, int C, float *o, int64_t h0, const float *alpha, const float *p,
                           const float *const *rows, int n, int64_t d, int64_t V, prefetcher *pf) {
    for (; d + C * W <= V; d += C * W) {
        pf->vstep++;
        prefetch_upto(pf, (int)(pf->nrows * (pf->fs + (1 - pf->fs) * pf->vstep / pf->vsteps)));
        v16 acc[16];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) acc[g * C + c] = *(v16 *)(o + (h0 + g) * V + d + c * W) * alpha[h0 + g];
        for (int i = 0; i < n; i++) {
            v16 r[2];
            for (int c = 0; c < C; c++) {
                v16 rv = *(const v16 *)(rows[i] + d + c * W);
                IN_REGISTER(rv);
                r[c] = rv;
            }
            for (int g = 0; g < G; g++) {
                float pg = p[(h0 + g) * BLK + i];
                for (int c = 0; c < C; c++) acc[g * C + c] += pg * r[c];
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) *(v16 *)(o + (h0 + g) * V + d + c * W) = acc[g * C + c];
    }
    return d;
}

INLINE void values_group(int G, float *o, int64_t h0, const float *alpha, const float *p, const float *const *rows,
                         int n, int64_t V, prefetcher *pf) {
    int64_t d = values_cols(G, 2, o, h0, alpha, p, rows, n, 0, V, pf); /* a broadcast p feeds two FMAs */
    d = values_cols(G, 1, o, h0, alpha, p, rows, n, d, V, pf);
    for (; d < V; d++)
        for (int g = 0; g < G; g++) {
            float a = o[(h0 + g) * V + d] * alpha[h0 + g];
            for (int i = 0; i < n; i++) a += p[(h0 + g) * BLK + i] * rows[i][d];
            o[(h0 + g) * V + d] = a;
        }
}

/* head groups values_block makes of H heads: eights, then a four, a two, a one */
static int64_t head_groups(int64_t H) { return H / 8 + H % 8 / 4 + H % 4 / 2 + H % 2; }

static void values_block(float *o, int64_t H, const float *alpha, const float *p, const float *const *rows, int n,
                         int64_t V, prefetcher *pf) {
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) values_group(8, o, h, alpha, p, rows, n, V, pf);
    for (; h + 4 <= H; h += 4) values_group(4, o, h, alpha, p, rows, n, V, pf);
    for (; h + 2 <= H; h += 2) values_group(2, o, h, alpha, p, rows, n, V, pf);
    for (; h < H; h++) values_group(1, o, h, alpha, p, rows, n, V, pf);
    prefetch_upto(pf, pf->nrows); /* what is left, if any */
}

/* The softmax update of one head by the block's scores sh[0, n) (turned into exp(s - new max)
   in place): the new running max, the factor alpha for what came before, the denominator. */
static void softmax_head(float *sh, int n, float *m, float *den, float *alpha) {
    float bm = -INFINITY;
    for (int i = 0; i < n; i++)
        if (sh[i] > bm) bm = sh[i];
    float mn = bm > *m ? bm : *m;
    /* a new max rescales what came before (folded into values_block's read) */
    *alpha = *m == -INFINITY ? 0.0f : (mn > *m ? expf(*m - mn) : 1.0f);
    *den *= *alpha;
    *m = mn;
    v16 sum = (v16){0};
    int i = 0;
    for (; i + W <= n; i += W) {
        v16 e = exp_v16(*(v16 *)(sh + i) - mn);
        *(v16 *)(sh + i) = e;
        sum += e;
    }
    if (i < n) { /* the block's last partial vector: lanes past n are -inf, exp 0 */
        v16 x;
        for (int j = 0; j < W; j++) x[j] = i + j < n ? sh[i + j] - mn : -INFINITY;
        v16 e = exp_v16(x);
        for (int j = 0; i + j < n; j++) sh[i + j] = e[j];
        sum += e;
    }
    *den += hsum(sum);
}

/* The source rows (fp32 or bf16) of a request's tokens [t0, t0 + n) in the pool. */
static void source_rows(const char *kv, int64_t elsize, int64_t page_stride, int64_t page_size, int64_t D,
                        const int32_t *table, int64_t t0, int n, const char **src) {
    for (int i = 0; i < n; i++) {
        int64_t t = t0 + i;
        src[i] = kv + ((int64_t)table[t / page_size] * page_stride + (t % page_size) * D) * elsize;
    }
}

/* Returns 0, or -1 when a live token's page id is outside [0, num_pages) or a seq_len needs more
   than the table's table_width columns (that request's output left zero; the caller raises). kv_dtype: 0 = fp32, 1 = bf16. q is fp32 [B, H, D]
   contiguous, block_table int32 [B, table_stride] (only the columns a request's seq_len
   covers are read), out fp32 [B, H, V] contiguous. */
int mla_decode_paged(const float *q, const void *kv, int kv_dtype, int64_t num_pages, int64_t page_stride,
                     int64_t page_size, const int32_t *block_table, int64_t table_width, int64_t table_stride,
                     const int32_t *seq_lens, int64_t B, int64_t H, int64_t D, int64_t V, float scale, float *out) {
    int status = 0;
    const int64_t elsize = kv_dtype == 0 ? 4 : 2;
    float *qs = malloc(sizeof(float) * H * D);
    float *s = malloc(sizeof(float) * H * BLK);
    float *m = malloc(sizeof(float) * H);
    float *den = malloc(sizeof(float) * H);
    float *alpha = malloc(sizeof(float) * H);
    int64_t *live = malloc(sizeof(int64_t) * (B > 0 ? B : 1)); /* rows to attend: 0 for a bad request */
    float *tile = kv_dtype == 1 ? malloc(sizeof(float) * BLK * D) : NULL;
    const float *rows[BLK];
    const char *src[BLK], *next[BLK];
    if (!qs || !s || !m || !den || !alpha || !live || (kv_dtype == 1 && !tile)) {
        status = -2;
        goto done;
    }
    for (int64_t b = 0; b < B; b++) { /* checked first: the prefetch looks one request ahead */
        int64_t len = seq_lens[b];
        live[b] = len > 0 ? len : 0;
        if (len <= 0) continue;
        const int32_t *table = block_table + b * table_stride;
        int64_t last_page = (len - 1) / page_size;
        int bad = last_page >= table_width;
        for (int64_t c = 0; c <= last_page && !bad; c++)
            if (table[c] < 0 || table[c] >= num_pages) bad = 1;
        if (bad) {
            status = -1;
            live[b] = 0;
        }
    }
    for (int64_t b = 0; b < B; b++) {
        float *o = out + b * H * V;
        memset(o, 0, sizeof(float) * H * V);
        int64_t len = live[b];
        if (len == 0) continue;
        const int32_t *table = block_table + b * table_stride;
        const float *qb = q + b * H * D;
        for (int64_t i = 0; i < H * D; i++) qs[i] = qb[i] * scale; /* as torch: (q * scale) . k */
        for (int64_t h = 0; h < H; h++) {
            m[h] = -INFINITY;
            den[h] = 0.0f;
        }
        for (int64_t t0 = 0; t0 < len; t0 += BLK) {
            int n = (int)(len - t0 < BLK ? len - t0 : BLK);
            source_rows(kv, elsize, page_stride, page_size, D, table, t0, n, src);
            for (int i = 0; i < n; i++) {
                if (kv_dtype == 0) {
                    rows[i] = (const float *)src[i];
                } else {
                    const uint16_t *from = (const uint16_t *)src[i];
                    float *dst = tile + (int64_t)i * D;
                    for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(from[d]);
                    rows[i] = dst;
                }
            }
            /* the next block: this request's next, else the next live request's first */
            prefetcher pf = {next, 0, 0, D * elsize, (int)(head_groups(H) * (V / (2 * W))), 0, (float)D / (D + V)};
            int64_t nb = b, nt = t0 + BLK;
            while (nb < B && nt >= live[nb]) {
                nb++;
                nt = 0;
            }
            if (nb < B) {
                pf.nrows = (int)(live[nb] - nt < BLK ? live[nb] - nt : BLK);
                source_rows(kv, elsize, page_stride, page_size, D, block_table + nb * table_stride, nt, pf.nrows,
                            next);
            }
            if (pf.vsteps < 1) pf.vsteps = 1;
            scores_block(qs, H, rows, n, D, s, &pf);
            for (int64_t h = 0; h < H; h++) softmax_head(s + h * BLK, n, m + h, den + h, alpha + h);
            values_block(o, H, alpha, s, rows, n, V, &pf);
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
    free(live);
    free(tile);
    return status;
}
