/* The interleaved rope in place, fp32, one thread: x [T, n, R] (rows at x + t * st + i * sn,
   channels contiguous), pairs (x[2k], x[2k+1]) turned by angle k of the token's position:
   a' = a * cos - b * sin, b' = a * sin + b * cos, each product rounded and then the sum, as the
   torch form (reference.rope_interleaved_) does: built with -ffp-contract=off (no fused
   multiply-add), the result is bit for bit the torch form's. Returns -1, x untouched, when a
   position is outside [0, num_pos). */

#include <stdint.h>

int rope_interleaved_rows(float *x, int64_t T, int64_t n, int64_t st, int64_t sn, int64_t half, const int64_t *pos,
                          const float *cos_t, const float *sin_t, int64_t table_stride, int64_t num_pos) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= num_pos) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * table_stride, *s = sin_t + pos[t] * table_stride;
        for (int64_t i = 0; i < n; i++) {
            float *p = x + t * st + i * sn;
            for (int64_t k = 0; k < half; k++) {
                float a = p[2 * k], b = p[2 * k + 1];
                p[2 * k] = a * c[k] - b * s[k];
                p[2 * k + 1] = a * s[k] + b * c[k];
            }
        }
    }
    return 0;
}
