/* Softmax attention of a few query rows over a KV cache, for the torch backend on a CPU.
 *
 * A one-token step has R query rows per kv head (R = query heads per kv head, GQA), a verify
 * window of S tree nodes R x S. At such sizes attention is bound by reading the cache, yet
 * general matrix libraries compute a product of a few rows nearly row by row. Here each kv head's
 * K cache (D, T) is read once for all M = R x S rows (its positions in panels of 16, each panel's
 * 16 scores of up to 6 rows accumulated in registers), and its V cache (D, T) once per block of
 * 2 rows, the block's 4 channels x 8 positions of V at a time from L1.
 *
 * The keys are one sequence: the cache's T positions, then the window's S tokens (the cache's
 * last T % 16 positions and the window's are copied into extra panels after the cache's whole
 * ones). Every result is computed the same way whatever M, T and S, and however the work is spread
 * over threads:
 *   * a score: a sum over d = 0..D-1 in order, one multiply-add per term;
 *   * a row's softmax: the max over its keys, exp(score - max) (a polynomial; exactly 0 below
 *     -87, so a masked key adds exact zeros below), divided by the sum of the
 *     exps: 8 lane sums over the sequence's blocks of 8 keys in order, added in a fixed tree;
 *   * an output: the same 8-lane sum of probability x value over the sequence.
 * So a row's output depends only on the keys it sees, not on where they sit: a window token's
 * attention in a verify window is, to the bit, what it is in a one-token step after the window's
 * earlier tokens were cached.
 *
 * Written with the compiler's vector extensions (GCC, Clang), as native_gemm.c; OpenMP threads
 * where built with -fopenmp.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* unaligned loads */
typedef int32_t v8i __attribute__((vector_size(32)));

#define TP 16 /* cache positions per score panel: two vectors */
#define QR 6  /* query rows per score block: 12 accumulators */
#define AHEAD 64 /* the score panels prefetch each row of keys this many positions ahead (a hint:
                     never a fault, even past the end) */
#define VR 2  /* query rows per value block */
#define VD 4  /* head channels per value block: VR x VD = 8 accumulators */

static inline v8 splat(float v) {
    v8 b = {v, v, v, v, v, v, v, v};
    return b;
}

/* a * b + c, rounded once where the CPU fuses multiply-adds (twice where it does not), the same
 * way in every kernel below: the compiler, left to itself, fuses some and not others. */
#if defined(__FMA__) && defined(__AVX__)
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#elif defined(__aarch64__)
static inline v8 fma8(v8 a, v8 b, v8 c) {
    float32x4_t a2[2], b2[2], c2[2];
    memcpy(a2, &a, sizeof(v8));
    memcpy(b2, &b, sizeof(v8));
    memcpy(c2, &c, sizeof(v8));
    c2[0] = vfmaq_f32(c2[0], a2[0], b2[0]);
    c2[1] = vfmaq_f32(c2[1], a2[1], b2[1]);
    memcpy(&c, c2, sizeof(v8));
    return c;
}
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; } /* no FMA to fuse with */
#endif

static inline v8 load(const float *p) { return *(const v8u *)p; }

static inline void store(float *p, v8 v) { memcpy(p, &v, sizeof(v8)); }

/* The lanes of v added in a fixed tree. */
static inline float lane_sum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) for x <= 0, and exactly 0 for x < -87: x = n ln2 + r, |r| <= ln2 / 2,
 * exp(r) by a degree-7 polynomial (Cephes' expf coefficients), times 2^n built in the exponent. */
static inline v8 exp_nonpositive(v8 x) {
    v8i keep = x >= splat(-87.0f);
    x = (v8)(((v8i)x & keep) | ((v8i)splat(-87.0f) & ~keep));
    v8 t = x * splat(1.44269504088896341f) + splat(12582912.0f); /* round to nearest: 1.5 * 2^23 */
    v8i n = (v8i)t - (v8i)splat(12582912.0f);
    v8 nf = t - splat(12582912.0f);
    v8 r = x - nf * splat(0.693359375f);
    r = r - nf * splat(-2.12194440e-4f);
    v8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    v8i scale = (n + 127) << 23;
    return (v8)((v8i)(p * (v8)scale) & keep);
}

/* out[r][0..16) = sum over d of rows[r][d] * k[d][0..16) for r < R: one panel of scores. */
#define SCORES(R)                                                                             \
    static void scores_##R(const float *rows, int64_t d, const float *k, int64_t ldk,         \
                           float *out, int64_t ldo) {                                         \
        v8 lo[R], hi[R];                                                                      \
        for (int r = 0; r < R; r++) lo[r] = hi[r] = splat(0.0f);                              \
        for (int64_t i = 0; i < d; i++) {                                                     \
            __builtin_prefetch(k + i * ldk + AHEAD);                                          \
            v8 w0 = load(k + i * ldk), w1 = load(k + i * ldk + 8);                            \
            for (int r = 0; r < R; r++) {                                                     \
                v8 b = splat(rows[r * d + i]);                                                \
                lo[r] = fma8(b, w0, lo[r]);                                                   \
                hi[r] = fma8(b, w1, hi[r]);                                                   \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < R; r++) {                                                         \
            store(out + r * ldo, lo[r]);                                                      \
            store(out + r * ldo + 8, hi[r]);                                                  \
        }                                                                                     \
    }
SCORES(1)
SCORES(2)
SCORES(3)
SCORES(4)
SCORES(5)
SCORES(6)

/* acc[r][j] += p[r][u] * v[j][u] lane by lane, for u < n (a multiple of 8), r < R, j < VD. */
#define VALUES(R)                                                                             \
    static void values_##R(const float *p, int64_t ldp, const float *v, int64_t ldv, int64_t n, \
                           v8 acc[][VD]) {                                                    \
        for (int64_t u = 0; u < n; u += 8) {                                                  \
            v8 w[VD];                                                                         \
            for (int j = 0; j < VD; j++) w[j] = load(v + j * ldv + u);                        \
            for (int r = 0; r < R; r++) {                                                     \
                v8 x = load(p + r * ldp + u);                                                 \
                for (int j = 0; j < VD; j++) acc[r][j] = fma8(x, w[j], acc[r][j]);            \
            }                                                                                 \
        }                                                                                     \
    }
VALUES(1)
VALUES(2)

int64_t llama_ane_attention_channels(void) { return VD; }

/* p[g][m][at .. at + 16) for the panels at = first * 16 .. (first + count) * 16: those below
 * `whole` read from the keys k in place (rows skd apart), the others from the extra panels ek
 * (rows ecols apart, starting at position `whole`). Every block of rows re-reads a panel from L1;
 * blocks have balanced sizes (7 = 3 + 4). */
static void score_panels(const float *rows, const float *k, int64_t skg, int64_t skd, const float *ek,
                         int64_t ecols, int64_t whole, float *p, int64_t ldp, int64_t g, int64_t m,
                         int64_t d, int64_t first, int64_t count, int threads) {
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t job = 0; job < g * count; job++) {
        int64_t gi = job / count, at = (first + job % count) * TP;
        const float *kp = at < whole ? k + gi * skg + at : ek + gi * d * ecols + (at - whole);
        int64_t ldk = at < whole ? skd : ecols;
        int64_t blocks = (m + QR - 1) / QR;
        for (int64_t b = 0, m0 = 0; b < blocks; b++) {
            int64_t n = (m - m0) / (blocks - b);
            const float *x = rows + (gi * m + m0) * d;
            float *o = p + (gi * m + m0) * ldp + at;
            switch (n) {
                case 1: scores_1(x, d, kp, ldk, o, ldp); break;
                case 2: scores_2(x, d, kp, ldk, o, ldp); break;
                case 3: scores_3(x, d, kp, ldk, o, ldp); break;
                case 4: scores_4(x, d, kp, ldk, o, ldp); break;
                case 5: scores_5(x, d, kp, ldk, o, ldp); break;
                default: scores_6(x, d, kp, ldk, o, ldp); break;
            }
            m0 += n;
        }
    }
}

/* out (G, R, D, S), contiguous = softmax(q k^T + mask) v for G kv heads of R query heads each:
 *   q[g][r][d][s] at q + g * sqg + r * sqr + d * sqd + s * sqs (already scaled by 1/sqrt(D));
 *   the caches k, v (G, D, T): k[g][d][t] at k + g * skg + d * skd + t (positions contiguous);
 *   the window's own kw, vw (G, D, S), contiguous;
 *   mask (S, T + S), contiguous, additive, the cache's T columns first.
 * D must be a multiple of VD (llama_ane_attention_channels). Returns 0, or -1 when out of memory. */
int llama_ane_attend(const float *q, int64_t sqg, int64_t sqr, int64_t sqd, int64_t sqs,
                     const float *k, int64_t skg, int64_t skd, const float *v, int64_t svg, int64_t svd,
                     const float *kw, const float *vw, const float *mask, float *out,
                     int64_t g, int64_t r, int64_t d, int64_t s, int64_t t, int threads) {
    int64_t m = r * s, cols = t + s;
    int64_t whole = t / TP * TP;                         /* keys read from the cache in place */
    int64_t ecols = (cols - whole + TP - 1) / TP * TP;   /* the others, copied and padded */
    int64_t ldp = whole + ecols;
    float *rows = malloc((size_t)(g * m * d) * sizeof(float));   /* [g][m][d], m = r * S + s */
    float *p = malloc((size_t)(g * m * ldp) * sizeof(float));    /* [g][m][ldp] */
    float *ek = malloc((size_t)(g * d * ecols) * sizeof(float)); /* [g][d][ecols] */
    float *ev = malloc((size_t)(g * d * ecols) * sizeof(float));
    if (!rows || !p || !ek || !ev) {
        free(rows), free(p), free(ek), free(ev);
        return -1;
    }
    (void)threads;
    if (whole < t) /* the cache's last positions, fetched while the whole panels' scores run */
        for (int64_t gi = 0; gi < g; gi++)
            for (int64_t i = 0; i < d; i++) {
                const float *kt = k + gi * skg + i * skd + whole, *vt = v + gi * svg + i * svd + whole;
                __builtin_prefetch(kt), __builtin_prefetch(kt + (t - whole - 1));
                __builtin_prefetch(vt), __builtin_prefetch(vt + (t - whole - 1));
            }
    for (int64_t gi = 0; gi < g; gi++)
        for (int64_t ri = 0; ri < r; ri++)
            for (int64_t si = 0; si < s; si++)
                for (int64_t i = 0; i < d; i++)
                    rows[(gi * m + ri * s + si) * d + i] = q[gi * sqg + ri * sqr + i * sqd + si * sqs];

    /* scores: the cache's whole panels, then the extra ones, copied once the others have run */
    score_panels(rows, k, skg, skd, ek, ecols, whole, p, ldp, g, m, d, 0, whole / TP, threads);
    for (int64_t gi = 0; gi < g; gi++)
        for (int64_t i = 0; i < d; i++)
            for (int64_t u = 0; u < ecols; u++) {
                int64_t at = whole + u; /* position in the sequence of keys */
                float *ke = ek + (gi * d + i) * ecols + u, *ve = ev + (gi * d + i) * ecols + u;
                if (at < t) {
                    *ke = k[gi * skg + i * skd + at];
                    *ve = v[gi * svg + i * svd + at];
                } else if (at < cols) {
                    *ke = kw[(gi * d + i) * s + at - t];
                    *ve = vw[(gi * d + i) * s + at - t];
                } else {
                    *ke = *ve = 0.0f;
                }
            }
    score_panels(rows, k, skg, skd, ek, ecols, whole, p, ldp, g, m, d, whole / TP, ecols / TP, threads);

    /* each row's mask and softmax (past the sequence's end: probability 0) */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t job = 0; job < g * m; job++) {
        const float *mrow = mask + ((job % m) % s) * cols;
        float *row = p + job * ldp;
        v8 top8 = splat(-3.0e38f);
        int64_t u = 0;
        for (; u + 8 <= cols; u += 8) {
            v8 x = load(row + u) + load(mrow + u);
            v8i above = x > top8;
            store(row + u, x);
            top8 = (v8)(((v8i)x & above) | ((v8i)top8 & ~above));
        }
        float top = top8[0];
        for (int i = 1; i < 8; i++) top = top8[i] > top ? top8[i] : top;
        for (; u < cols; u++) {
            row[u] += mrow[u];
            top = row[u] > top ? row[u] : top;
        }
        for (u = cols; u < ldp; u++) row[u] = -3.0e38f;
        v8 lanes = splat(0.0f);
        for (u = 0; u < ldp; u += 8) {
            v8 e = exp_nonpositive(load(row + u) - splat(top));
            store(row + u, e);
            lanes += e;
        }
        v8 total = splat(lane_sum(lanes));
        for (u = 0; u < ldp; u += 8) store(row + u, load(row + u) / total);
    }

    /* values, per block of VD channels and VR rows: the cache's whole panels, then the others */
    int64_t chans = d / VD;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t job = 0; job < g * chans; job++) {
        int64_t gi = job / chans, d0 = (job % chans) * VD;
        const float *vp = v + gi * svg + d0 * svd, *ep = ev + (gi * d + d0) * ecols;
        for (int64_t m0 = 0; m0 < m; m0 += VR) {
            int64_t n = m - m0 < VR ? m - m0 : VR;
            const float *pr = p + (gi * m + m0) * ldp;
            v8 acc[VR][VD];
            for (int a = 0; a < VR; a++)
                for (int j = 0; j < VD; j++) acc[a][j] = splat(0.0f);
            if (n == 2) {
                values_2(pr, ldp, vp, svd, whole, acc);
                values_2(pr + whole, ldp, ep, ecols, ecols, acc);
            } else {
                values_1(pr, ldp, vp, svd, whole, acc);
                values_1(pr + whole, ldp, ep, ecols, ecols, acc);
            }
            for (int64_t a = 0; a < n; a++) {
                int64_t mi = m0 + a, ri = mi / s, si = mi % s;
                for (int64_t j = 0; j < VD; j++) out[((gi * r + ri) * d + d0 + j) * s + si] = lane_sum(acc[a][j]);
            }
        }
    }
    free(rows), free(p), free(ek), free(ev);
    return 0;
}
