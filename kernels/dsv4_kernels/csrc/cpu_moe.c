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
#define TOKS 4 /* tokens per tile: 4 x 4 accumulators + 8 loads = 24 of 32 registers */
#elif defined(__AVX__)
#define LANES 8
#define TOKS 2 /* 4 x 2 + 6 = 14 of 16 registers */
#else
#define LANES 4
#define TOKS 2
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

typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

/* the four lanes' sums of a, b, c, d as one 4-vector: the four reductions share their shuffles
 * (a transpose as it goes), 14 vector ops instead of hsum's 32 */
static inline v4 sum4(vf a, vf b, vf c, vf d) {
#if LANES == 16
    vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* quarter q of s: four partial sums of a, b, c, d for q = 0, 1, 2, 3 */
    vf s = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return __builtin_shufflevector(s, s, 0, 4, 8, 12);
#elif LANES == 8
    vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    /* pairs of partial sums of a, b, c, d */
    vf s = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(s, s, 0, 2, 4, 6) + __builtin_shufflevector(s, s, 1, 3, 5, 7);
#else
    vf ab = __builtin_shufflevector(a, b, 0, 4, 1, 5) + __builtin_shufflevector(a, b, 2, 6, 3, 7);
    vf cd = __builtin_shufflevector(c, d, 0, 4, 1, 5) + __builtin_shufflevector(c, d, 2, 6, 3, 7);
    return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
#endif
}

/* How far ahead of the rows being read the prefetches run (bytes): a few blocks, long enough to
 * cover the memory's latency at its bandwidth, short enough to stay in L2 until read */
#define AHEAD (32 << 10) /* (16 and 64 KB measured the same) */
#if LANES == 16
#define SEQ 4 /* tokens up to which an expert's rows are read one after another (see dots): 4 x 4 sums */
#else
#define SEQ 3 /* 4 x 3 sums + 2 of 16 registers */
#endif

/* The weights read after the current matrix (p NULL: none), for prefetches past its end. */
typedef struct {
    const char *p;
    int64_t bytes;
} later;

/* the address `at` bytes into W (`bytes` long), or past its end into nx; NULL past both */
static inline const char *ahead(const float *W, int64_t bytes, int64_t at, later nx) {
    if (at < bytes) return (const char *)W + at;
    return nx.p && at - bytes < nx.bytes ? nx.p + (at - bytes) : NULL;
}

/* out[j * ldo + r] = dot(W[r * K ...], X[j][...]) for r < R, j < N, the steps over k outside
 * (R weight and N token vectors loaded per step, R * N FMAs); R and N are compile-time constants
 * at every call (inlined), so the R * N accumulators live in registers. Each step also
 * prefetches npf vectors' worth of later weights from pf on (none when pf is NULL). */
static inline __attribute__((always_inline)) void tile(const float *W, int64_t K, const float *const *X, int R,
                                                      int N, float *out, int64_t ldo, const char *pf, int npf) {
    vf acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < N; j++) acc[r][j] = (vf){0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vf xv[4], wv[4];
        for (int j = 0; j < N; j++) xv[j] = keep(load(X[j] + k));
        for (int r = 0; r < R; r++) wv[r] = keep(load(W + r * K + k));
        /* into L2 (not L1: the block, the tokens and the prefetched rows together would
         * overflow it; NTA measured slower) */
        if (pf)
            for (int q = 0; q < npf; q++) __builtin_prefetch(pf + (k * npf + q * LANES) * sizeof(float), 0, 1);
        for (int r = 0; r < R; r++)
            for (int j = 0; j < N; j++) acc[r][j] += wv[r] * xv[j];
    }
    if (R == 4) { /* the four rows' sums at once, stored together */
        for (int j = 0; j < N; j++) {
            v4 s = sum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
            for (int q = 0; q < 4; q++)
                for (int64_t kk = k; kk < K; kk++) s[q] += W[q * K + kk] * X[j][kk];
            memcpy(out + j * ldo, &s, sizeof s);
        }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < N; j++) {
            float s = hsum(acc[r][j]);
            for (int64_t kk = k; kk < K; kk++) s += W[r * K + kk] * X[j][kk];
            out[j * ldo + r] = s;
        }
}

/* As tile for 4 rows and N <= SEQ tokens, but row after row, the weights read in address order
 * (which helps the hardware prefetcher where the memory is the bound: few tokens). With one or
 * two tokens each row keeps two sums a token (even and odd steps), so that the FMA latency does
 * not bound it. pf[r] (or NULL): the later weights to prefetch as row r is read. */
static inline __attribute__((always_inline)) void rows4(const float *W, int64_t K, const float *const *X, int N,
                                                       float *out, int64_t ldo, const char *const *pf) {
    const int U = N <= 2 ? 2 : 1;
    vf acc[4][SEQ];
    int64_t k = 0;
    for (int r = 0; r < 4; r++) {
        const float *w = W + r * K;
        vf a[2][SEQ];
        for (int u = 0; u < U; u++)
            for (int j = 0; j < N; j++) a[u][j] = (vf){0};
        for (k = 0; k + U * LANES <= K; k += U * LANES) {
            /* a line a step: with U = 2 every other line, which measured as fast as every line */
            if (pf[r]) __builtin_prefetch(pf[r] + k * sizeof(float), 0, 1);
            for (int u = 0; u < U; u++) {
                vf wv = keep(load(w + k + u * LANES));
                for (int j = 0; j < N; j++) a[u][j] += wv * load(X[j] + k + u * LANES);
            }
        }
        if (U == 2 && k + LANES <= K) {
            vf wv = keep(load(w + k));
            for (int j = 0; j < N; j++) a[0][j] += wv * load(X[j] + k);
            k += LANES;
        }
        for (int j = 0; j < N; j++) acc[r][j] = U == 2 ? a[0][j] + a[1][j] : a[0][j];
    }
    for (int j = 0; j < N; j++) {
        v4 s = sum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
        for (int q = 0; q < 4; q++)
            for (int64_t kk = k; kk < K; kk++) s[q] += W[q * K + kk] * X[j][kk];
        memcpy(out + j * ldo, &s, sizeof s);
    }
}

/* out[j * ldo + r] = dot(W row r, X[j]) for r < rows, j < n: rows in blocks of 4 that stay in
 * L1 while every token passes over them (the weights stream from memory once): in 4 x TOKS
 * register tiles, or with up to SEQ tokens in one pass row after row (rows4).
 *
 * The weights AHEAD bytes on (this matrix's, then nx's: the hardware prefetcher neither follows
 * four interleaved rows well nor jumps to the next matrix) are prefetched while a block is read,
 * as many as a block has, spread evenly over its token tiles: a steady stream of requests that
 * keeps the memory busy while the block computes (one burst a block filled the miss queues and
 * stalled the loads). */
static void dots(const float *W, int64_t rows, int64_t K, const float *const *X, int64_t n, float *out,
                 int64_t ldo, later nx) {
    const int64_t bytes = rows * K * (int64_t)sizeof(float), row = K * (int64_t)sizeof(float);
    int64_t r = 0;
    if (n <= SEQ) {
        for (; r + 4 <= rows; r += 4) {
            const char *pf[4];
            for (int q = 0; q < 4; q++) pf[q] = ahead(W, bytes, (r + q) * row + AHEAD, nx);
            switch (n) {
            case 1: rows4(W + r * K, K, X, 1, out + r, ldo, pf); break;
            case 2: rows4(W + r * K, K, X, 2, out + r, ldo, pf); break;
            case 3: rows4(W + r * K, K, X, 3, out + r, ldo, pf); break;
#if SEQ > 3
            case 4: rows4(W + r * K, K, X, 4, out + r, ldo, pf); break;
#endif
            }
        }
    } else {
        const int64_t tiles = (n + TOKS - 1) / TOKS, steps = K / LANES;
        const int npf = (int)((4 + tiles - 1) / tiles); /* vectors to prefetch per step, per tile */
        for (; r + 4 <= rows; r += 4) {
            const float *w = W + r * K;
            const int64_t at = r * row + AHEAD;
            for (int64_t j = 0, t = 0; j < n; j += TOKS, t++) {
                /* tile t prefetches its share of the block AHEAD bytes on */
                int64_t from = at + t * npf * steps * LANES * (int64_t)sizeof(float);
                const char *pf = from < at + 4 * row ? ahead(W, bytes, from, nx) : NULL;
                float *o = out + j * ldo + r;
                switch (n - j < TOKS ? n - j : TOKS) {
#if TOKS > 3
                case 4: tile(w, K, X + j, 4, 4, o, ldo, pf, npf); break;
                case 3: tile(w, K, X + j, 4, 3, o, ldo, pf, npf); break;
#endif
                case 2: tile(w, K, X + j, 4, 2, o, ldo, pf, npf); break;
                case 1: tile(w, K, X + j, 4, 1, o, ldo, pf, npf); break;
                }
            }
        }
    }
    for (; r < rows; r++)
        for (int64_t j = 0; j < n; j++) tile(W + r * K, K, X + j, 1, 1, out + j * ldo + r, ldo, NULL, 0);
}

/* e^x, LANES at a time once the caller's loop vectorizes (libm's expf is a call per value):
 * 2^m e^f with m = round(x / ln 2), f = x - m ln 2 (|f| <= ln 2 / 2; ln 2 in two parts, so f is
 * exact to a few ulps) and e^f by its Taylor series to degree 7 (remainder < 6e-9 relative):
 * a few ulps, like expf. x is clamped to [-87, 88] (2^m stays a normal float; e^88 < FLT_MAX),
 * which only silu's e^-a for |a| > 87 sees, where a / (1 + e^-a) is a or ~0 either way. */
static inline float exp_(float x) {
    x = x > 88.0f ? 88.0f : (x < -87.0f ? -87.0f : x);
    float m = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    float f = (x - m * 0.693145752f) - m * 1.42860677e-6f;
    float p = 1.0f / 5040;
    p = p * f + 1.0f / 720;
    p = p * f + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)m + 127) << 23;
    float two_m;
    memcpy(&two_m, &bits, sizeof two_m);
    return p * two_m;
}

/* h[i] = silu(g[i]) * u[i], clamped as DeepSeek-V4 when limit > 0 (gate <= limit, |up| <= limit) */
static void swiglu(const float *g, const float *u, int64_t I, float limit, float *h) {
    if (limit > 0.0f) {
        for (int64_t i = 0; i < I; i++) {
            float a = g[i] > limit ? limit : g[i], b = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
            h[i] = a / (1.0f + exp_(-a)) * b;
        }
    } else {
        for (int64_t i = 0; i < I; i++) h[i] = g[i] / (1.0f + exp_(-g[i])) * u[i];
    }
}

/* One expert over n tokens: y_j = W2 (silu(g_j) * u_j), [g_j; u_j] = W13 x_j, added to out
 * rows as out[dst_j] += scale_j * y_j. gu [n, 2I], h [n, I] and y [n, D] are scratch; nx: the
 * weights read after this expert's. */
static void expert(const float *w13, const float *w2, int64_t D, int64_t I, const float *const *xs, int64_t n,
                   float *const *dst, const float *scale, float limit, float *gu, float *h, const float **hp,
                   float *y, later nx) {
    dots(w13, 2 * I, D, xs, n, gu, 2 * I, (later){(const char *)w2, D * I * (int64_t)sizeof(float)});
    for (int64_t j = 0; j < n; j++) {
        swiglu(gu + j * 2 * I, gu + j * 2 * I + I, I, limit, h + j * I);
        hp[j] = h + j * I;
    }
    dots(w2, D, I, hp, n, y, D, nx);
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

    int64_t b13 = 2 * I * D * (int64_t)sizeof(float);
    for (int64_t e = 0; e < E; e++) {
        if (count[e] == count[e + 1]) continue;
        /* what is read after this expert, for the prefetches: the next used one's w13, or the shared one's */
        later nx = {(const char *)s_w13, s_w13 ? 2 * Is * D * (int64_t)sizeof(float) : 0};
        for (int64_t f = e + 1; f < E; f++)
            if (count[f] < count[f + 1]) {
                nx = (later){(const char *)(w13 + f * 2 * I * D), b13};
                break;
            }
        for (int64_t j0 = count[e]; j0 < count[e + 1]; j0 += C) {
            int64_t n = count[e + 1] - j0 < C ? count[e + 1] - j0 : C;
            for (int64_t j = 0; j < n; j++) {
                int64_t p = order[j0 + j], t = p / k;
                xs[j] = x + t * D;
                dst[j] = out + t * D;
                sc[j] = wts[p];
            }
            later again = {(const char *)(w13 + e * 2 * I * D), b13}; /* another chunk of this expert's tokens */
            expert(w13 + e * 2 * I * D, w2 + e * D * I, D, I, xs, n, dst, sc, limit, gu, h, hp, y,
                   j0 + n < count[e + 1] ? again : nx);
        }
    }
    if (s_w13) { /* the always-on expert over all T tokens, weight 1 */
        for (int64_t j = 0; j < T; j++) {
            xs[j] = x + j * D;
            dst[j] = out + j * D;
        }
        expert(s_w13, s_w2, D, Is, xs, T, dst, NULL, limit, gu, h, hp, y, (later){NULL, 0});
    }
    return 0;
}

/* y [T, N] = x [T, K] @ W [N, K]^T, a dense projection at decode sizes through the experts' loop
 * (dots): W streams from memory once, a block of 4 rows in L1 while every token passes over it,
 * with its rows prefetched ahead, where a small-M GEMM re-reads or under-prefetches the weights
 * (measured: bench/results/decode_breakdown/14-native-linear.json). x rows x_stride floats apart
 * (channels contiguous), W and y contiguous. Tokens go in chunks of LIN_CHUNK (the pointer
 * array on the stack); callers keep T small, where each chunk's weights are one read anyway. */
#define LIN_CHUNK 64
int cpu_linear(const float *x, int64_t T, int64_t K, int64_t x_stride, const float *W, int64_t N, float *y) {
    const float *xs[LIN_CHUNK];
    for (int64_t j0 = 0; j0 < T; j0 += LIN_CHUNK) {
        int64_t n = T - j0 < LIN_CHUNK ? T - j0 : LIN_CHUNK;
        for (int64_t j = 0; j < n; j++) xs[j] = x + (j0 + j) * x_stride;
        dots(W, N, K, xs, n, y + j0 * N, N, (later){NULL, 0});
    }
    return 0;
}

/* The vector width this build got: with 4 lanes (no AVX) the loop measured slower than torch's
 * GEMMs from 8 tokens an expert, so the caller keeps torch there. */
int cpu_moe_lanes(void) { return LANES; }
