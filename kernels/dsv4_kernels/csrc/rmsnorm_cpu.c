/* RMSNorm with an optional fused residual add, fp32, one thread: the torch form
   (reference.rmsnorm) is ~10 ops a call, and a V3 decode step makes 17 calls over a few rows.

   For each of the T rows: h = x (+ residual), r = 1 / sqrt(mean(h^2) + eps), out = w * (h * r);
   h is written to res_out when residual is given (the next layer's residual). x's rows may be
   strided (a column slice of a wider projection), channels contiguous; res, res_out and out are
   contiguous [T, D] (res_out may be res itself). The sum of squares runs in W partial sums in
   index order, then over the lanes: a different order from torch's mean, an fp32 rounding
   difference (tests/unit/kernels/test_native_rmsnorm.py bounds it). */

#include <math.h>
#include <stdint.h>

#define W 16

typedef float v16 __attribute__((vector_size(W * sizeof(float)), aligned(4)));

void rmsnorm_rows(const float *x, int64_t T, int64_t D, int64_t sx, const float *res, float *res_out,
                  const float *w, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * sx;
        const float *h = xr;
        if (res) {
            const float *rr = res + t * D;
            float *hr = res_out + t * D;
            for (int64_t d = 0; d < D; d++) hr[d] = xr[d] + rr[d];
            h = hr;
        }
        v16 acc = (v16){0};
        int64_t d = 0;
        for (; d + W <= D; d += W) {
            v16 v = *(const v16 *)(h + d);
            acc += v * v;
        }
        float ss = 0.0f;
        for (int j = 0; j < W; j++) ss += acc[j];
        for (; d < D; d++) ss += h[d] * h[d];
        float r = 1.0f / sqrtf(ss / (float)D + eps);
        float *o = out + t * D;
        for (d = 0; d < D; d++) o[d] = w[d] * (h[d] * r);
    }
}
