/* Products of a few columns with a prepacked weight, for the torch backend on a CPU.
 *
 * y (M, N) = x (M, K) @ W^T, W (N, K), for M = 1..16 or so: one-token decoding (M = 1) and the
 * verify window of a token tree (M = its nodes). At such M a product is bound by reading W, and
 * general GEMM libraries compute it column by column, as if W were read M times. Here W is packed
 * once into panels of NR output rows, [N / NR][K][NR], so one sequential pass over the panels
 * serves every column: each panel's 16 outputs of up to MR columns are accumulated in registers
 * (MR x 2 vectors of 8 floats): 12 columns where the CPU has 32 vector registers (AVX-512VL), else
 * 6 (AVX2's 16; NEON's 32 of half the width). Further blocks of columns re-read the panel in
 * slices of KC k, each still in L1 from the first block, and cost more than one block of their
 * sum would: on an AVX-512 core of this project's machine, 8 columns took 1.58x the time of 6 as
 * two blocks of 4 and 1.16x as one block of 8 (benchmarks/verify_columns.py, all of SmolLM2's
 * projections: 43.7 and 32.8 ms against 27.6 and 28.3). Blocks have balanced sizes (13 = 6 + 7,
 * not 12 + 1): a block of one or two columns would be bound by the latency of its few
 * accumulator chains.
 *
 * Each output is a sum over k = 0..K-1 in order, one multiply-add per term (fused where the CPU
 * has FMA), whatever M and however the panels are spread over threads: a column's result does not
 * depend on the others.
 *
 * Written with the compiler's vector extensions (GCC, Clang): AVX2/FMA or AVX-512 with
 * -march=native on x86-64, NEON on arm64. Threads: OpenMP when built with -fopenmp.
 */
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  /* unaligned loads */

#define NR 16 /* output rows per panel: two vectors */
#if defined(__AVX512VL__)
#define MR 12 /* columns per register block: 24 accumulators of the 32 registers */
#else
#define MR 6  /* columns per register block: 12 accumulators of 16 registers */
#endif
#define KC 256  /* k per pass: a panel's 16 KB slice stays in L1 for every block of columns */
#define GROUP 64 /* columns accumulated at once (more re-read the panel) */
#define PREFETCH 32 /* blocks of 2+ columns prefetch the panel this many k ahead (2 KB) */

int64_t llama_ane_panel_rows(void) { return NR; }

/* Pack w (N, K), row-major, into panels [ceil(N / NR)][K][NR]; rows past N are zeros. */
void llama_ane_pack(const float *w, float *out, int64_t n, int64_t k) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t row = p * NR + j;
                out[(p * k + kk) * NR + j] = row < n ? w[row * k + kk] : 0.0f;
            }
}

/* acc (R, NR) += x (R, K) @ panel^T for R = 1..MR columns; x[r][k] at x + r * sr + k * sk. With
 * two columns or more the loads alone do not keep enough of the panel in flight: prefetch it.
 * (A prefetch past the panel's end is a hint, never a fault.) */
#define BLOCK(R)                                                                         \
    static void block_##R(const float *x, int64_t sr, int64_t sk, const float *panel,   \
                          int64_t k, int64_t ahead, float *acc) {                        \
        v8 lo[R], hi[R];                                                                 \
        for (int r = 0; r < R; r++) {                                                    \
            memcpy(&lo[r], acc + r * NR, sizeof(v8));                                    \
            memcpy(&hi[r], acc + r * NR + 8, sizeof(v8));                                \
        }                                                                                \
        for (int64_t kk = 0; kk < k; kk++) {                                             \
            if (R >= 2) __builtin_prefetch(panel + (kk + ahead) * NR);                   \
            if (R >= 2) __builtin_prefetch(panel + (kk + ahead) * NR + 8);               \
            v8 w0 = *(const v8u *)(panel + kk * NR);                                     \
            v8 w1 = *(const v8u *)(panel + kk * NR + 8);                                 \
            for (int r = 0; r < R; r++) {                                                \
                float v = x[r * sr + kk * sk];                                           \
                v8 b = {v, v, v, v, v, v, v, v}; /* not 0 + v: that adds (-0.0) */       \
                lo[r] += b * w0;                                                         \
                hi[r] += b * w1;                                                         \
            }                                                                            \
        }                                                                                \
        for (int r = 0; r < R; r++) {                                                    \
            memcpy(acc + r * NR, &lo[r], sizeof(v8));                                    \
            memcpy(acc + r * NR + 8, &hi[r], sizeof(v8));                                \
        }                                                                                \
    }
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)
BLOCK(5)
BLOCK(6)
#if MR > 6
BLOCK(7)
BLOCK(8)
BLOCK(9)
BLOCK(10)
BLOCK(11)
BLOCK(12)
#endif

/* y = x @ W^T for x (M, K) at x + m * sxm + k * sxk, W packed by llama_ane_pack, and y (M, N)
 * written at y + m * sym + n * syn; on `threads` OpenMP threads (panels split among them). */
void llama_ane_gemm(const float *x, int64_t sxm, int64_t sxk, const float *packed, float *y,
                    int64_t sym, int64_t syn, int64_t m, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + NR - 1) / NR;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        float acc[GROUP * NR];
        const float *panel = packed + p * k * NR;
        int64_t rows = n - p * NR < NR ? n - p * NR : NR;
        for (int64_t g0 = 0; g0 < m; g0 += GROUP) {
            int64_t gm = m - g0 < GROUP ? m - g0 : GROUP;
            int64_t blocks = (gm + MR - 1) / MR;
            memset(acc, 0, (size_t)gm * NR * sizeof(float));
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                int64_t kc = k - k0 < KC ? k - k0 : KC;
                for (int64_t b = 0, m0 = 0; b < blocks; b++) {
                    int64_t r = (gm - m0) / (blocks - b); /* balanced: 7 = 3 + 4, not 6 + 1 */
                    const float *xm = x + (g0 + m0) * sxm + k0 * sxk;
                    const float *part = panel + k0 * NR;
                    float *a = acc + m0 * NR;
                    int64_t ahead = b == 0 ? PREFETCH : KC; /* later blocks fetch the next slice */
                    switch (r) {
                        case 1: block_1(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 2: block_2(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 3: block_3(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 4: block_4(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 5: block_5(xm, sxm, sxk, part, kc, ahead, a); break;
#if MR > 6
                        case 6: block_6(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 7: block_7(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 8: block_8(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 9: block_9(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 10: block_10(xm, sxm, sxk, part, kc, ahead, a); break;
                        case 11: block_11(xm, sxm, sxk, part, kc, ahead, a); break;
                        default: block_12(xm, sxm, sxk, part, kc, ahead, a); break;
#else
                        default: block_6(xm, sxm, sxk, part, kc, ahead, a); break;
#endif
                    }
                    m0 += r;
                }
            }
            for (int64_t c = 0; c < gm; c++) {
                float *out = y + (g0 + c) * sym + p * NR * syn;
                if (syn == 1) {
                    memcpy(out, acc + c * NR, (size_t)rows * sizeof(float));
                } else {
                    for (int64_t j = 0; j < rows; j++) out[j * syn] = acc[c * NR + j];
                }
            }
        }
    }
}
