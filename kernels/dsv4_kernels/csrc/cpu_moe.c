/* A MoE layer's experts on the CPU for a decode step's few tokens, one call per layer: the
 * routed experts (SwiGLU, weighted sum over each token's top-k) plus, optionally, an always-on
 * expert (a shared expert, or a dense MLP when there are no routed ones).
 *
 * At decode sizes (a few tokens per expert) the torch form is bound by per-expert op overhead and
 * small-M GEMM set-up, not by arithmetic: the step has to read every used expert's weights once,
 * and that read is the floor. Here each used expert's weight rows stream through once for all the
 * tokens routed to it: a block of rows stays in L1 while it is dotted with every routed token.
 *
 * Plain C on float32 with GCC vector extensions (no torch headers, no OpenMP: the engine core
 * runs one compute thread), built at first use and loaded with ctypes by dsv4_kernels.cpu_moe.
 * Sums are fp32 in a fixed order (LANES lanes over the row, then a tree over the lanes), not
 * MKL's: results differ from torch's by rounding only. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vector width and register tile by what the build targets (-march=native): the R x N
 * accumulators, R weight vectors and N token vectors of a tile must fit the vector registers
 * (32 with AVX-512, 16 with AVX2 / SSE), or the tile spills and turns load-bound. */
#if defined(__AVX512F__)
#define LANES 16
#define TOKS 4  /* tokens per tile: 4 x 4 accumulators + 8 loads = 24 of 32 registers */
#define ROWS1 8 /* rows per tile for a lone token */
#elif defined(__AVX__)
#define LANES 8
#define TOKS 2 /* 4 x 2 + 6 = 14 of 16 registers */
#define ROWS1 4
#else
#define LANES 4
#define TOKS 2
#define ROWS1 4
#endif
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef float vfu __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));

static inline vf load(const float *p) { return *(const vfu *)p; }

/* a loaded vector pinned in a register: without this GCC folds the load into every FMA that
 * uses it on x86 (memory operands), R * N loads per step instead of R + N, and the tile becomes
 * load-bound. (Load-store ISAs cannot fold, so they need nothing.) */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__AVX512F__)
#define keep(v) ({ vf _v = (v); __asm__("" : "+v"(_v)); _v; })
#elif defined(__GNUC__) && defined(__x86_64__)
#define keep(v) ({ vf _v = (v); __asm__("" : "+x"(_v)); _v; })
#else
#define keep(v) (v)
#endif

/* the lanes' sum as a tree of vector adds (a scalar chain of 15 adds would cost as much as the
 * dot itself for a 256-long row) */
static inline float hsum(vf v) {
#if LANES == 16
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif LANES == 8
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#else
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
#endif
    return v[0];
}

/* out[j * ldo + r] = dot(W[r * K ...], X[j][...]) for r < R, j < N; R and N are compile-time
 * constants at every call (inlined), so the R * N accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float *W, int64_t K, const float *const *X, int R,
                                                      int N, float *out, int64_t ldo, const float *pf) {
    vf acc[8][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < N; j++) acc[r][j] = (vf){0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vf xv[4], wv[8];
        for (int j = 0; j < N; j++) xv[j] = keep(load(X[j] + k));
        for (int r = 0; r < R; r++) wv[r] = keep(load(W + r * K + k));
        if (pf) /* a later block's rows, a line per row per step, into L2 (not L1: the block, the
                 * tokens and the prefetched rows together would overflow it; NTA measured slower) */
            for (int r = 0; r < R; r++) __builtin_prefetch(pf + r * K + k, 0, 1);
        for (int r = 0; r < R; r++)
            for (int j = 0; j < N; j++) acc[r][j] += wv[r] * xv[j];
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < N; j++) {
            float s = hsum(acc[r][j]);
            for (int64_t kk = k; kk < K; kk++) s += W[r * K + kk] * X[j][kk];
            out[j * ldo + r] = s;
        }
}

/* out[j * ldo + r] = dot(W row r, X[j]) for r < rows, j < n: rows in blocks that stay in L1
 * while every token passes over them (the weights stream from memory once). */
static void dots(const float *W, int64_t rows, int64_t K, const float *const *X, int64_t n, float *out,
                 int64_t ldo) {
    int64_t r = 0;
    /* the first pass over a block prefetches the block after next (no further than the last row) */
#define NEXT(R) (r + 3 * (R) <= rows ? W + (r + 2 * (R)) * K : NULL)
    if (n == 1) { /* one token (a single stream): more rows per pass for independent sums */
        for (; r + ROWS1 <= rows; r += ROWS1) tile(W + r * K, K, X, ROWS1, 1, out + r, ldo, NEXT(ROWS1));
    } else {
        for (; r + 4 <= rows; r += 4) {
            const float *w = W + r * K, *pf = NEXT(4);
            int64_t j = 0;
            for (; j + TOKS <= n; j += TOKS, pf = NULL) tile(w, K, X + j, 4, TOKS, out + j * ldo + r, ldo, pf);
            switch (n - j) { /* fewer than TOKS left */
#if TOKS > 3
            case 3: tile(w, K, X + j, 4, 3, out + j * ldo + r, ldo, pf); break;
            case 2: tile(w, K, X + j, 4, 2, out + j * ldo + r, ldo, pf); break;
#endif
            case 1: tile(w, K, X + j, 4, 1, out + j * ldo + r, ldo, pf); break;
            }
        }
    }
#undef NEXT
    for (; r < rows; r++)
        for (int64_t j = 0; j < n; j++) tile(W + r * K, K, X + j, 1, 1, out + j * ldo + r, ldo, NULL);
}

/* One expert over n tokens: y_j = W2 (silu(g_j) * u_j), [g_j; u_j] = W13 x_j, added to out
 * rows as out[dst_j] += scale_j * y_j. Clamped as DeepSeek-V4 when limit > 0 (gate <= limit,
 * |up| <= limit). gu [n, 2I], h [n, I] and y [n, D] are scratch. */
static void expert(const float *w13, const float *w2, int64_t D, int64_t I, const float *const *xs, int64_t n,
                   float *const *dst, const float *scale, float limit, float *gu, float *h, const float **hp,
                   float *y) {
    dots(w13, 2 * I, D, xs, n, gu, 2 * I);
    for (int64_t j = 0; j < n; j++) {
        const float *g = gu + j * 2 * I, *u = g + I;
        float *hj = h + j * I;
        for (int64_t i = 0; i < I; i++) {
            float a = g[i], b = u[i];
            if (limit > 0.0f) {
                a = a > limit ? limit : a;
                b = b > limit ? limit : (b < -limit ? -limit : b);
            }
            hj[i] = a / (1.0f + expf(-a)) * b;
        }
        hp[j] = hj;
    }
    dots(w2, D, I, hp, n, y, D);
    for (int64_t j = 0; j < n; j++) {
        float *o = dst[j];
        const float *yj = y + j * D;
        float s = scale ? scale[j] : 1.0f;
        for (int64_t d = 0; d < D; d++) o[d] += s * yj[d];
    }
}

/* x [T, D]; ids, wts [T, k] (int32, fp32; an id outside [0, E) adds nothing: another rank's
 * expert); w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I]; optional always-on expert
 * s_w13 [2Is, D], s_w2 [D, Is] (NULL when absent, weight 1). All float32 contiguous.
 * out [T, D] = sum_k wts * expert_ids(x) (+ shared(x)). Returns 0, or -1 if scratch could not
 * be allocated (out is then unspecified). */
/* scratch kept across calls (one per thread): a fresh allocation per call of a few hundred KB
 * would be an mmap and its page faults every layer */
static __thread void *buf;
static __thread size_t buf_cap;

static void *scratch(size_t bytes) {
    if (bytes > buf_cap) {
        free(buf);
        buf = malloc(bytes);
        buf_cap = buf ? bytes : 0;
    }
    return buf;
}

int cpu_moe(const float *x, int64_t T, int64_t D, const int32_t *ids, const float *wts, int64_t k, const float *w13,
            const float *w2, int64_t E, int64_t I, const float *s_w13, const float *s_w2, int64_t Is, float limit,
            float *out) {
    int64_t P = T * k, Imax = I > Is ? I : Is;
    int64_t C = T; /* tokens per pass of one expert (an expert sees each token once in top-k) */
    size_t floats = (size_t)C * (3 * Imax + D), ptrs = (size_t)C * 3, ints = (size_t)(E + 1) * 2 + P;
    char *mem = scratch(floats * sizeof(float) + C * sizeof(float) + ptrs * sizeof(void *) + ints * sizeof(int64_t));
    if (!mem) return -1;
    const float **xs = (const float **)mem, **hp = xs + C; /* pointers, then int64s, then floats: each aligned */
    float **dst = (float **)(hp + C);
    int64_t *count = (int64_t *)(dst + C), *fill = count + E + 1, *order = fill + E + 1;
    float *gu = (float *)(order + P), *h = gu + C * 2 * Imax, *y = h + C * Imax, *sc = y + C * D;
    memset(out, 0, (size_t)(T * D) * sizeof(float));

    /* pairs bucketed by expert (a counting sort, in (token, k) order within one expert) */
    memset(count, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < E) count[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    memcpy(fill, count, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < E) order[fill[ids[p]]++] = p;

    for (int64_t e = 0; e < E; e++) {
        for (int64_t j0 = count[e]; j0 < count[e + 1]; j0 += C) {
            int64_t n = count[e + 1] - j0 < C ? count[e + 1] - j0 : C;
            for (int64_t j = 0; j < n; j++) {
                int64_t p = order[j0 + j], t = p / k;
                xs[j] = x + t * D;
                dst[j] = out + t * D;
                sc[j] = wts[p];
            }
            expert(w13 + e * 2 * I * D, w2 + e * D * I, D, I, xs, n, dst, sc, limit, gu, h, hp, y);
        }
    }
    if (s_w13) { /* the always-on expert over all T tokens, weight 1 */
        for (int64_t j = 0; j < T; j++) {
            xs[j] = x + j * D;
            dst[j] = out + j * D;
        }
        expert(s_w13, s_w2, D, Is, xs, T, dst, NULL, limit, gu, h, hp, y);
    }
    return 0;
}

/* The vector width this build got: with 4 lanes (no AVX) the loop measured slower than torch's
 * GEMMs from 8 tokens an expert, so the caller keeps torch there. */
int cpu_moe_lanes(void) { return LANES; }
