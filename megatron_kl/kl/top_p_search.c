/* Mass histograms of logit rows for the top-p cut (megatron_kl/kl/top_p_native.py loads this file).

   A row's top-p cut is the logit where the descending cumulative mass of exp((x - max) / tau) reaches
   top_p * total. Each pass here reads a row once, while it sits in cache, and adds every logit's mass to one of
   B buckets of logit value:

     histogram:  bucket f(x) = min(B - 1, floor((max - x) * scale)) over the whole row (f is monotone in x, so
                 each bucket is an interval of logits); mass only. The caller all-reduces it over the
                 tensor-parallel ranks and finds the bucket where the cumulative mass crosses the target.
     refine:     the logits of one level-1 bucket (f(x) == j) that also lie in [lo, hi], split into F finer
                 buckets g(x) = clamp(floor((top - x) * scale2), 0, F - 1) with mass, min and max each; the
                 first `cap` of them are copied out (and counted). The caller takes the cut among the copied
                 logits of the fine bucket holding it once every rank copied all its own, or narrows [lo, hi]
                 to that fine bucket's [min, max].

   Rows with j < 0 are skipped. Masses are float32 exponentials (a polynomial after range reduction, within
   2 ulp of expf) summed in float64. Plain C, no intrinsics: the compiler vectorises the elementwise loops. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 512
#define LANES 16
#define MAX_BUCKETS 512 /* top_p_histogram.MAX_BUCKETS */

static inline float exp_poly(float v) {
    /* exp(v) for v <= 0; below -87 it returns ~exp(-87) (a mass of 1e-38, nothing in a float64 sum) */
    v = v < -87.0f ? -87.0f : v;
    float n = rintf(v * 1.44269504088896341f);
    float r = v - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline int32_t bucket_of(float offset, int32_t buckets) {
    /* floor(offset) clamped to [0, buckets - 1]; NaN and +inf go to the last bucket */
    return offset < (float)(buckets - 1) ? (offset >= 0.0f ? (int32_t)offset : 0) : buckets - 1;
}

void extremes_f32(const float *x, int64_t row_stride, int64_t cols, int64_t row_begin, int64_t row_end,
                  double *high, double *low) {
    /* each row's largest logit and smallest finite one (+inf where none is finite); LANES running values
       each, so that the compiler vectorises the loop (NaN never wins a comparison) */
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *row = x + r * row_stride;
        float hi[LANES], lo[LANES];
        for (int l = 0; l < LANES; ++l) {
            hi[l] = -INFINITY;
            lo[l] = INFINITY;
        }
        int64_t i = 0;
        for (; i + LANES <= cols; i += LANES)
            for (int l = 0; l < LANES; ++l) {
                const float v = row[i + l], finite = v > -INFINITY ? v : INFINITY;
                hi[l] = v > hi[l] ? v : hi[l];
                lo[l] = finite < lo[l] ? finite : lo[l];
            }
        for (; i < cols; ++i) {
            const float v = row[i], finite = v > -INFINITY ? v : INFINITY;
            hi[0] = v > hi[0] ? v : hi[0];
            lo[0] = finite < lo[0] ? finite : lo[0];
        }
        for (int l = 1; l < LANES; ++l) {
            hi[0] = hi[l] > hi[0] ? hi[l] : hi[0];
            lo[0] = lo[l] < lo[0] ? lo[l] : lo[0];
        }
        high[r] = hi[0];
        low[r] = lo[0];
    }
}

void histogram_f32(const float *x, int64_t row_stride, int64_t cols, int64_t row_begin, int64_t row_end,
                   const float *row_max, const float *scale, float inv_tau, int32_t buckets, double *mass) {
    float e[CHUNK];
    int32_t index[CHUNK];
    double part[4][MAX_BUCKETS] = {{0.0}};
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *row = x + r * row_stride;
        const float m = row_max[r], s = scale[r];
        double *h = mass + r * buckets;
        for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
            const int64_t len = cols - c0 < CHUNK ? cols - c0 : CHUNK;
            for (int64_t i = 0; i < len; ++i) {
                const float v = row[c0 + i];
                e[i] = exp_poly((v - m) * inv_tau);
                index[i] = bucket_of((m - v) * s, buckets);
            }
            int64_t i = 0;  /* four partial histograms: consecutive logits in one bucket do not wait on each other */
            for (; i + 4 <= len; i += 4) {
                part[0][index[i]] += e[i];
                part[1][index[i + 1]] += e[i + 1];
                part[2][index[i + 2]] += e[i + 2];
                part[3][index[i + 3]] += e[i + 3];
            }
            for (; i < len; ++i) part[0][index[i]] += e[i];
        }
        for (int32_t k = 0; k < buckets; ++k) {
            h[k] = (part[0][k] + part[1][k]) + (part[2][k] + part[3][k]);
            part[0][k] = part[1][k] = part[2][k] = part[3][k] = 0.0;
        }
    }
}

void refine_f32(const float *x, int64_t row_stride, int64_t cols, int64_t row_begin, int64_t row_end,
                const float *row_max, const float *scale, const int32_t *bucket, const float *lo, const float *hi,
                const float *top, const float *scale2, float inv_tau, int32_t buckets, int32_t fine_buckets,
                double *mass, float *low, float *high, int32_t cap, float *members, int64_t *member_count) {
    uint8_t member[CHUNK];
    for (int64_t r = row_begin; r < row_end; ++r) {
        const int32_t j = bucket[r];
        if (j < 0) continue;
        const float *row = x + r * row_stride;
        const float m = row_max[r], s = scale[r], a = lo[r], b = hi[r], t = top[r], s2 = scale2[r];
        double *h = mass + r * fine_buckets;
        float *lw = low + r * fine_buckets, *hg = high + r * fine_buckets, *out = members + r * (int64_t)cap;
        for (int32_t k = 0; k < fine_buckets; ++k) {
            h[k] = 0.0;
            lw[k] = INFINITY;
            hg[k] = -INFINITY;
        }
        int64_t found = 0;
        for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
            const int64_t len = cols - c0 < CHUNK ? cols - c0 : CHUNK;
            const float *part = row + c0;
            for (int64_t i = 0; i < len; ++i) {
                const float v = part[i];
                member[i] = (uint8_t)((bucket_of((m - v) * s, buckets) == j) & (v >= a) & (v <= b));
            }
            for (int64_t i = len; i < CHUNK; ++i) member[i] = 0;
            for (int64_t w0 = 0; w0 < len; w0 += 8) {  /* eight flags a word: most words hold no member */
                uint64_t word;
                memcpy(&word, member + w0, sizeof word);
                while (word) {
                    const int byte = __builtin_ctzll(word) >> 3;
                    word &= ~(0xFFull << (8 * byte));
                    const float v = part[w0 + byte];
                    const int32_t k = bucket_of((t - v) * s2, fine_buckets);
                    h[k] += exp_poly((v - m) * inv_tau);
                    if (v < lw[k]) lw[k] = v;
                    if (v > hg[k]) hg[k] = v;
                    if (found < cap) out[found] = v;
                    ++found;
                }
            }
        }
        member_count[r] = found;
    }
}
