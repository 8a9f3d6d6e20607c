/* DeepSeek-V4's compressor pooling on the CPU, one call for every window closing in a layer:
 * gated softmax pooling over the window's rows (and, for the overlapping CSA compressor, the first
 * series of the window before it), the rms norm and the rope at the window's first position. The
 * torch form is ~25 small ops per call, run for each compressor of each layer that closes windows.
 *
 * Plain C on float32 (no torch headers), loaded with ctypes by dsv4_kernels.cpu_v4_compress.
 * The same arithmetic as the torch form in index order; exp, cos, sin and the reductions' order
 * differ from torch's vectorised ones by rounding only. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Window n's rows r < rate: kv at kv + n * s_n + r * s_r, gate likewise (each `width` wide);
 * prev* the window before (overlap only; window 0 has none). ape [rate, width], norm_w [hd],
 * inv_freq [half_rd]: the rope turns the trailing 2 * half_rd channels at position w * rate.
 * out [N, hd]. */
void v4_pool_windows(const float *kv, const float *gate, const float *pkv, const float *pgate, int64_t s_n,
                     int64_t s_r, const int64_t *w_ids, int64_t N, int64_t rate, int64_t hd, int64_t overlap,
                     const float *ape, int64_t width, const float *norm_w, float eps, const float *inv_freq,
                     int64_t half_rd, float *out) {
    float *e = malloc(sizeof(float) * (size_t)(2 * rate));
    const float **v = malloc(sizeof(float *) * (size_t)(2 * rate));
    for (int64_t n = 0; n < N; n++) {
        int64_t w = w_ids[n];
        int has_prev = overlap && w >= 1;
        int64_t off = overlap ? hd : 0;
        float *o = out + n * hd;
        for (int64_t c = 0; c < hd; c++) {
            /* the pool, in the torch form's order: the previous window's rows (channel c; zero
             * weight for window 0), then this window's rows (channel off + c) */
            int64_t K = 0;
            float mx = -INFINITY;
            if (overlap)
                for (int64_t r = 0; r < rate; r++, K++) {
                    e[K] = has_prev ? pgate[n * s_n + r * s_r + c] + ape[r * width + c] : -INFINITY;
                    v[K] = pkv + n * s_n + r * s_r + c;
                    if (e[K] > mx) mx = e[K];
                }
            for (int64_t r = 0; r < rate; r++, K++) {
                e[K] = gate[n * s_n + r * s_r + off + c] + ape[r * width + off + c];
                v[K] = kv + n * s_n + r * s_r + off + c;
                if (e[K] > mx) mx = e[K];
            }
            float den = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                e[k] = expf(e[k] - mx);
                den += e[k];
            }
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += (e[k] == 0.0f ? 0.0f : *v[k]) * (e[k] / den);
            o[c] = acc;
        }
        float ss = 0.0f;
        for (int64_t c = 0; c < hd; c++) ss += o[c] * o[c];
        float inv = 1.0f / sqrtf(ss / (float)hd + eps);
        for (int64_t c = 0; c < hd; c++) o[c] = norm_w[c] * (o[c] * inv);
        float pos = (float)(w * rate);
        float *pr = o + hd - 2 * half_rd;
        for (int64_t i = 0; i < half_rd; i++) {
            float ang = pos * inv_freq[i], cs = cosf(ang), sn = sinf(ang);
            float a = pr[2 * i], b = pr[2 * i + 1];
            pr[2 * i] = a * cs - b * sn;
            pr[2 * i + 1] = a * sn + b * cs;
        }
    }
    free(e);
    free(v);
}
