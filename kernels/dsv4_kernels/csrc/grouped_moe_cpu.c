/* The passes around the GEMMs of a prefill-sized MoE / MLP on the CPU (dsv4_kernels.cpu_grouped_moe):
 *
 *   gather_rows   the (token, k) pairs' input rows in expert order, one memcpy a row (torch's
 *                 index_select ran at a few GB/s here);
 *   swiglu_rows   h = silu(gate) * up from the [n, 2I] gate_up into [n, I] in one pass (torch:
 *                 silu on the strided half into a temporary, then a multiply into another);
 *   combine_rows  out[t] = sum_k w[t,k] * y[pos[t,k]] (+ add[t]) in one pass over the expert
 *                 outputs (torch: zero the dead rows, weight every row, gather back, sum over k,
 *                 then the shared expert's add).
 *
 * combine_rows rounds as the torch form does, bit for bit: each product w * y once, summed in
 * k order from 0, then the add (built with -ffp-contract=off, so no FMA fuses a product into a
 * sum). swiglu_rows' exp is its own (a polynomial, within 2 ulp), so h differs from torch's by
 * rounding only. Plain C with GCC vector extensions, no OpenMP (the engine runs one compute
 * thread). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vfu __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float a) { return a - (vf){}; }

/* dst[i] = src[rows[i]] for n rows of D floats; src's rows are ld floats apart. */
void gather_rows(const float *src, int64_t ld, const int64_t *rows, int64_t n, int64_t D, float *dst) {
    for (int64_t i = 0; i < n; i++) memcpy(dst + i * D, src + rows[i] * ld, (size_t)D * sizeof(float));
}

/* floor for the exponent: truncation rounds toward zero, so step down where it rounded up */
static inline vi vfloor_i(vf v) {
    vi t = __builtin_convertvector(v, vi);
    vf tf = __builtin_convertvector(t, vf);
    return t + (vi)(tf > v); /* a true lane is -1 */
}

/* e^x for x in [-87.3, 88] (the caller clamps): x = m ln2 + r, |r| <= ln2 / 2, e^r by its
 * degree-7 Taylor polynomial (truncation < 5e-9 relative), 2^m by the exponent bits. */
static inline vf vexp_poly(vf x) {
    const vf log2e = splat(1.44269504088896341f), ln2_hi = splat(0.693359375f), ln2_lo = splat(-2.12194440e-4f);
    vi mi = vfloor_i(x * log2e + splat(0.5f));
    vf m = __builtin_convertvector(mi, vf);
    vf r = (x - m * ln2_hi) - m * ln2_lo;
    vf p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vi bits = (mi + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float sexp_poly(float x) {
    float m = floorf(x * 1.44269504088896341f + 0.5f);
    float r = (x - m * 0.693359375f) - m * -2.12194440e-4f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return ldexpf(p, (int)m);
}

/* a where mask, else b (a NaN compares false: it stays) */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* silu(g) = g / (1 + e^-g); -g clamped to [-87.3, 88] keeps e^-g a normal finite float: past
 * either end the quotient is already g (to rounding) or 0. */
static inline vf vsilu(vf g) {
    vf t = -g;
    t = pick(t < splat(-87.3f), splat(-87.3f), t);
    t = pick(t > splat(88.0f), splat(88.0f), t);
    return g / (splat(1.0f) + vexp_poly(t));
}

static inline float ssilu(float g) {
    float t = -g;
    t = t < -87.3f ? -87.3f : (t > 88.0f ? 88.0f : t);
    return g / (1.0f + sexp_poly(t));
}

/* h[i] = silu(gu[i, :I]) * gu[i, I:2I] for n rows; gu's rows are ld floats apart, h is [n, I]. */
void swiglu_rows(const float *gu, int64_t n, int64_t I, int64_t ld, float *h) {
    for (int64_t i = 0; i < n; i++) {
        const float *g = gu + i * ld, *u = g + I;
        float *o = h + i * I;
        int64_t j = 0;
        for (; j + LANES <= I; j += LANES) store(o + j, vsilu(load(g + j)) * load(u + j));
        for (; j < I; j++) o[j] = ssilu(g[j]) * u[j];
    }
}

/* out[t] = (0 + w[t,0] y[pos[t,0]] + ... + w[t,k-1] y[pos[t,k-1]]) (+ add[t]) for T tokens of D
 * channels: y [*, D], pos and w [T, k]; a pair with pos < 0 adds nothing. add may be NULL. */
void combine_rows(const float *y, const int64_t *pos, const float *w, int64_t T, int64_t k, int64_t D,
                  const float *add, float *out) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * D;
        const int64_t *pt = pos + t * k;
        const float *wt = w + t * k;
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) {
            vf acc = splat(0.0f);
            for (int64_t j = 0; j < k; j++)
                if (pt[j] >= 0) acc += splat(wt[j]) * load(y + pt[j] * D + d);
            if (add) acc += load(add + t * D + d);
            store(o + d, acc);
        }
        for (; d < D; d++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++)
                if (pt[j] >= 0) acc += wt[j] * y[pt[j] * D + d];
            if (add) acc += add[t * D + d];
            o[d] = acc;
        }
    }
}

int grouped_moe_lanes(void) { return LANES; }
