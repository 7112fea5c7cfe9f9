/* Mass histograms of logit rows for the top-p cut (megatron_kl/kl/kernels/top_p_histogram.py calls these through
   megatron_kl/kl/kernels/native.py).

   A row's top-p cut is the last logit, in descending order, whose preceding mass of exp((x - max) / tau) is
   below top_p * total. Each pass here reads a row once and adds every logit's mass to one of B buckets of
   logit value:

     histogram:  bucket f(x) = min(B - 1, floor((max - x) * scale)) over the whole row (f is monotone in x, so
                 each bucket is an interval of logits); mass only. The caller all-reduces it over the
                 tensor-parallel ranks and finds the bucket where the cumulative mass crosses the target.
     refine:     the logits of one level-1 bucket (f(x) == j) that also lie in [lo, hi], split into F finer
                 buckets g(x) = clamp(floor((top - x) * scale2), 0, F - 1) with mass, min and max each; the
                 first `cap` of them are copied out (and counted). The caller takes the cut among the copied
                 logits of the fine bucket holding it once every rank copied all its own, or narrows [lo, hi]
                 to that fine bucket's [min, max].
     top_p_rows: one rank's whole vocabulary: the same steps per row while the row sits in cache, the cut
                 taken here (no collective is needed in between).

   Masses are float32 exponentials (a polynomial after range reduction, within 2 ulp of expf) summed in float64;
   the final walk uses float64 exp. Plain C, no intrinsics: the compiler vectorises the elementwise loops. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 512
#define LANES 16
#define MAX_BUCKETS 512 /* top_p_histogram.MAX_BUCKETS */
#define MAX_FINE 64     /* top_p_histogram.FINE_BUCKETS */
#define MAX_CAP 512     /* top_p_histogram.CAP */

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

static void row_extremes(const float *row, int64_t cols, float *high, float *low) {
    /* the largest logit and the smallest finite one (+inf where none is finite); LANES running values each, so
       that the compiler vectorises the loop (NaN never wins a comparison) */
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
    *high = hi[0];
    *low = lo[0];
}

static void row_histogram(const float *row, int64_t cols, float m, float s, float inv_tau, int32_t buckets,
                          double *h) {
    float e[CHUNK];
    int32_t index[CHUNK];
    double part[4][MAX_BUCKETS];  /* four partial histograms: consecutive logits in one bucket do not wait */
    memset(part, 0, sizeof part);
    for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
        const int64_t len = cols - c0 < CHUNK ? cols - c0 : CHUNK;
        for (int64_t i = 0; i < len; ++i) {
            const float v = row[c0 + i];
            e[i] = exp_poly((v - m) * inv_tau);
            index[i] = bucket_of((m - v) * s, buckets);
        }
        int64_t i = 0;
        for (; i + 4 <= len; i += 4) {
            part[0][index[i]] += e[i];
            part[1][index[i + 1]] += e[i + 1];
            part[2][index[i + 2]] += e[i + 2];
            part[3][index[i + 3]] += e[i + 3];
        }
        for (; i < len; ++i) part[0][index[i]] += e[i];
    }
    for (int32_t k = 0; k < buckets; ++k) h[k] = (part[0][k] + part[1][k]) + (part[2][k] + part[3][k]);
}

static int64_t row_refine(const float *row, int64_t cols, float m, float s, int32_t j, float a, float b, float t,
                          float s2, float inv_tau, int32_t buckets, int32_t fine_buckets, double *h, float *lw,
                          float *hg, int32_t cap, float *out) {
    /* bucket j's logits within [a, b] into fine buckets; the first `cap` copied to out; returns their count */
    uint8_t member[CHUNK];
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
    return found;
}

static int32_t crossing(const double *mass, int32_t buckets, double above, double target, double *before) {
    /* the first bucket where above + the cumulative mass reaches target (never past the last occupied one) and
       the mass above it */
    int32_t chosen = -1, occupied = 0;
    double cumulative = above, chosen_before = above;
    for (int32_t k = 0; k < buckets; ++k) {
        if (mass[k] > 0.0) occupied = k;
        if (chosen < 0 && cumulative + mass[k] >= target) {
            chosen = k;
            chosen_before = cumulative;
        }
        cumulative += mass[k];
    }
    if (chosen < 0 || chosen > occupied) {  /* rounding left the target above the sum: the last occupied */
        chosen = occupied;
        chosen_before = above;
        for (int32_t k = 0; k < occupied; ++k) chosen_before += mass[k];
    }
    *before = chosen_before;
    return chosen;
}

void extremes_f32(const float *x, int64_t row_stride, int64_t cols, int64_t row_begin, int64_t row_end,
                  double *high, double *low) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        float hi, lo;
        row_extremes(x + r * row_stride, cols, &hi, &lo);
        high[r] = hi;
        low[r] = lo;
    }
}

void histogram_f32(const float *x, int64_t row_stride, int64_t cols, int64_t row_begin, int64_t row_end,
                   const float *row_max, const float *scale, float inv_tau, int32_t buckets, double *mass) {
    for (int64_t r = row_begin; r < row_end; ++r)
        row_histogram(x + r * row_stride, cols, row_max[r], scale[r], inv_tau, buckets, mass + r * buckets);
}

void refine_f32(const float *x, int64_t row_stride, int64_t cols, int64_t row_begin, int64_t row_end,
                const float *row_max, const float *scale, const int32_t *bucket, const float *lo, const float *hi,
                const float *top, const float *scale2, float inv_tau, int32_t buckets, int32_t fine_buckets,
                double *mass, float *low, float *high, int32_t cap, float *members, int64_t *member_count) {
    /* rows with bucket < 0 are skipped */
    for (int64_t r = row_begin; r < row_end; ++r) {
        if (bucket[r] < 0) continue;
        member_count[r] = row_refine(x + r * row_stride, cols, row_max[r], scale[r], bucket[r], lo[r], hi[r], top[r],
                                     scale2[r], inv_tau, buckets, fine_buckets, mass + r * fine_buckets,
                                     low + r * fine_buckets, high + r * fine_buckets, cap, members + r * (int64_t)cap);
    }
}

static float walk(float *values, int64_t count, float low, float high, double m, double tau, double total,
                  double above, double top_p) {
    /* the rule's cut among the values in [low, high] (descending float64 masses after the mass above) */
    int64_t n = 0;
    for (int64_t i = 0; i < count; ++i)
        if (values[i] >= low && values[i] <= high) values[n++] = values[i];
    if (n == 0) return high;  /* (not reached: the bucket holds the cut, and every copy was made) */
    for (int64_t i = 1; i < n; ++i) {  /* insertion sort, descending: a handful of values */
        const float v = values[i];
        int64_t k = i;
        for (; k > 0 && values[k - 1] < v; --k) values[k] = values[k - 1];
        values[k] = v;
    }
    double before = above / total;
    float cut = values[0];  /* always kept: the mass above the bucket is below the target */
    for (int64_t i = 0; i < n && before < top_p; ++i) {
        cut = values[i];
        before += exp(((double)values[i] - m) / tau) / total;
    }
    return cut;
}

void top_p_rows_f32(const float *x, int64_t row_stride, int64_t cols, int64_t row_begin, int64_t row_end,
                    double top_p, double tau, int32_t buckets, int32_t fine_buckets, int32_t cap, int32_t max_levels,
                    double *cut, double *row_max, double *total, uint8_t *resolved) {
    /* one rank's whole vocabulary per row: max and finite min, the histogram, then narrowing passes while the
       row is in cache; resolved[r] = 0 where max_levels narrowings left the cut open */
    double mass[MAX_BUCKETS], fine[MAX_FINE];
    float fine_low[MAX_FINE], fine_high[MAX_FINE], members[MAX_CAP];
    const float inv_tau = (float)(1.0 / tau);
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *row = x + r * row_stride;
        float m, low;
        row_extremes(row, cols, &m, &low);
        row_max[r] = m;
        cut[r] = m;
        resolved[r] = 1;
        total[r] = 0.0;
        const double spread = (double)m - (double)low;
        if (!(spread > 0.0)) continue;  /* one value (or none finite): the whole row is the support */
        const float s = (float)(buckets / spread);
        if (!isfinite(s) || !(s > 0.0f)) {  /* a spread float32 cannot bucket: the caller bisects */
            double sum = 0.0;
            for (int64_t i = 0; i < cols; ++i) sum += exp_poly((row[i] - m) * inv_tau);
            total[r] = sum;
            resolved[r] = 0;
            continue;
        }
        row_histogram(row, cols, m, s, inv_tau, buckets, mass);
        double sum = 0.0;
        for (int32_t k = 0; k < buckets; ++k) sum += mass[k];
        total[r] = sum;
        const double target = top_p * sum;
        double above;
        const int32_t j = crossing(mass, buckets, 0.0, target, &above);
        float a = -INFINITY, b = INFINITY, t = (float)((double)m - j / (double)s);
        float s2 = (float)((double)s * fine_buckets);
        resolved[r] = 0;
        for (int32_t level = 0; level < max_levels && isfinite(s2); ++level) {
            const int64_t found = row_refine(row, cols, m, s, j, a, b, t, s2, inv_tau, buckets, fine_buckets, fine,
                                             fine_low, fine_high, cap, members);
            double above_fine;
            const int32_t k = crossing(fine, fine_buckets, above, target, &above_fine);
            if (fine_low[k] == fine_high[k]) {  /* one logit value (repeated): the cut */
                cut[r] = fine_high[k];
                resolved[r] = 1;
                break;
            }
            if (found <= cap) {
                cut[r] = walk(members, found, fine_low[k], fine_high[k], m, tau, sum, above_fine, top_p);
                resolved[r] = 1;
                break;
            }
            above = above_fine;  /* narrow to the fine bucket: [min, max] of its logits */
            a = fine_low[k];
            b = t = fine_high[k];
            s2 = (float)(fine_buckets / ((double)b - (double)a));
        }
    }
}
