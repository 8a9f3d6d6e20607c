/* DeepSeek-V3 noaux_tc expert choice for a decode step's few tokens, one C call instead of ~12
   torch ops (reference.moe_route's bias add, group top-2 sums, group top-k, mask, expert top-k).

   scores [T, E] are the router's sigmoid outputs (computed by torch, so the bits are torch's),
   bias [E]; per token: choice = scores + bias; a group's score is the sum of its two largest
   choices; the topk_group best groups are kept; the k best choices among their experts, in
   descending order, go to ids [T, k]. torch.topk leaves the order of equal values to its
   sort: so wherever a tie (or a NaN) could decide the result (the group boundary, the
   expert boundary, or the order among the chosen) this returns 1 and the caller runs the torch
   form for the whole call; 0 when every token's choice is strict, hence the same as torch's. */

#include <math.h>
#include <stdint.h>

#define MAX_E 1024
#define MAX_G 64

int moe_route_select(const float *scores, const float *bias, int64_t T, int64_t E, int64_t n_group,
                     int64_t topk_group, int64_t k, int64_t *ids) {
    if (E > MAX_E || n_group > MAX_G || n_group <= 0 || E % n_group || E / n_group < 2 || topk_group > n_group ||
        k <= 0 || k > E)
        return 1;
    int64_t per = E / n_group;
    float choice[MAX_E], gs[MAX_G];
    int keep[MAX_G];
    for (int64_t t = 0; t < T; t++) {
        const float *s = scores + t * E;
        for (int64_t e = 0; e < E; e++) {
            choice[e] = s[e] + bias[e];
            if (isnan(choice[e])) return 1;
        }
        for (int64_t g = 0; g < n_group; g++) {
            float a = -INFINITY, b = -INFINITY; /* the two largest (values only: ties do not matter) */
            for (int64_t j = 0; j < per; j++) {
                float v = choice[g * per + j];
                if (v > a) {
                    b = a;
                    a = v;
                } else if (v > b) {
                    b = v;
                }
            }
            gs[g] = a + b;
            if (isnan(gs[g])) return 1; /* torch ranks NaN first */
            keep[g] = 0;
        }
        /* the topk_group best groups: strictly larger than the best group left out */
        for (int64_t r = 0; r < topk_group; r++) {
            int64_t best = -1;
            for (int64_t g = 0; g < n_group; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        if (topk_group < n_group) {
            float lo = INFINITY, hi = -INFINITY;
            for (int64_t g = 0; g < n_group; g++) {
                if (keep[g] && gs[g] < lo) lo = gs[g];
                if (!keep[g] && gs[g] > hi) hi = gs[g];
            }
            if (!(lo > hi)) return 1;
        }
        /* the k best experts of the kept groups, descending; two equal values met while
           looking for the next best (the order among the chosen, or the boundary) could be
           ordered either way by torch */
        int64_t *out = ids + t * k;
        float prev = INFINITY;
        for (int64_t r = 0; r < k; r++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                if (!keep[e / per]) continue;
                float v = choice[e];
                if (!(v < prev)) continue; /* chosen already (strictly descending so far) */
                if (best < 0 || v > choice[best])
                    best = e;
                else if (v == choice[best])
                    return 1;
            }
            if (best < 0 || isinf(choice[best])) return 1; /* fewer than k finite candidates */
            out[r] = best;
            prev = choice[best];
        }
    }
    return 0;
}
