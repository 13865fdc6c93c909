/* CPU kernels for the float32 forward: paged decode attention and the row-wise ops around
 * it (RMSNorm with the residual add, rotary + K/V write into the pool, SiLU-and-mul).
 *
 * Built by bucketserve/kernels/cpu_decode.py for the host it runs on (-march=native, into a
 * cache keyed by this source, the compiler and the CPU's feature flags); `bs_isa()` reports
 * what the build was compiled for, and the loader refuses a build the host cannot run.
 *
 * Threads: OpenMP, linked against the same libgomp as PyTorch (the loader checks that only
 * one OpenMP runtime is mapped), so these loops run on PyTorch's own thread team: no second
 * pool of threads competes with PyTorch's for the cores. Row-wise ops stay on the calling
 * thread below a size where waking the team costs more than it saves.
 *
 * Decode attention. One work item is a sequence (all its kv heads), or a (sequence, kv
 * head) pair when there are too few sequences to keep the threads busy. It walks the
 * sequence's blocks in table order and, inside a block, reads K and then V in the pool's
 * memory order ([block][position][kv head][dim]), for all G = Hq / Hkv query heads of each
 * kv head at once, with an online softmax (running max m, running sum l, rescaled
 * accumulator) and a polynomial exp that vectorizes.
 *
 *   q      [nd, q_stride]              query head i of sequence s at q + s*q_stride + i*D
 *   cache  [num_blocks, BS, Hkv, D]    (k and v alike)
 *   tables [nd, table_stride]          int32 block ids
 *   lens   [nd]                        int32 context lengths (>= 1)
 *   out    [nd, Hq, D]                 contiguous
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_GROUP 32
#define MAX_DIM 256
#define MAX_BS 256
#define MAX_HEADS 64

/* 3: AVX-512F, 2: AVX2 + FMA, 1: SSE2 or other */
int bs_isa(void) {
#if defined(__AVX512F__)
    return 3;
#elif defined(__AVX2__) && defined(__FMA__)
    return 2;
#else
    return 1;
#endif
}

int bs_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* e^x for x <= 0 (and small positive x), branch-free so that loops over it vectorize.
 * Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial:
 * relative error about 2e-7 (1-2 ulp). Inputs below -87 give ~1e-38 instead of 0. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = fmaf(n, -0.693145751953125f, x);
    r = fmaf(n, -1.428606765330187e-06f, r);
    float p = 1.3888889e-03f;
    p = fmaf(p, r, 8.3333333e-03f);
    p = fmaf(p, r, 4.1666667e-02f);
    p = fmaf(p, r, 1.6666667e-01f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *tables, *lens;
    float *out;
    int64_t q_stride, table_stride, hq, hkv, d, bs;
    float scale;
} Decode;

/* One block of one kv head for its G query heads: scores, online softmax, values.
 * Inlined with constant G and D where the caller knows them, so that the compiler keeps the
 * G accumulators in registers and unrolls the dot products. */
static inline __attribute__((always_inline)) void head_block(
        const float *restrict qh, const float *restrict kb, const float *restrict vb, int64_t n,
        int64_t pos_stride, float scale, float *restrict m, float *restrict l,
        float *restrict acc, const int64_t G, const int64_t D) {
    float sc[MAX_GROUP * MAX_BS] __attribute__((aligned(64)));
    for (int64_t t = 0; t < n; ++t) {
        const float *kt = kb + t * pos_stride;
        for (int64_t gi = 0; gi < G; ++gi) {
            const float *qg = qh + gi * D;
            float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
            for (int64_t i = 0; i < D; ++i) s0 = fmaf(qg[i], kt[i], s0);
            sc[gi * MAX_BS + t] = s0 * scale;
        }
    }
    for (int64_t gi = 0; gi < G; ++gi) {
        float *row = sc + gi * MAX_BS;
        float bmax = row[0];
        for (int64_t t = 1; t < n; ++t) bmax = row[t] > bmax ? row[t] : bmax;
        const float mnew = bmax > m[gi] ? bmax : m[gi];
        const float corr = exp_poly(m[gi] - mnew); /* ~0 on the first block */
        float lsum = 0.0f;
#pragma omp simd reduction(+ : lsum)
        for (int64_t t = 0; t < n; ++t) {
            const float p = exp_poly(row[t] - mnew);
            row[t] = p;
            lsum += p;
        }
        l[gi] = l[gi] * corr + lsum;
        m[gi] = mnew;
        float *a = acc + gi * D;
#pragma omp simd
        for (int64_t k = 0; k < D; ++k) a[k] *= corr;
    }
    for (int64_t t = 0; t < n; ++t) {
        const float *vt = vb + t * pos_stride;
        for (int64_t gi = 0; gi < G; ++gi) {
            const float p = sc[gi * MAX_BS + t];
            float *a = acc + gi * D;
#pragma omp simd
            for (int64_t k = 0; k < D; ++k) a[k] = fmaf(p, vt[k], a[k]);
        }
    }
}

/* The same for full-width blocks of 16 positions and D a multiple of 16, written with GCC's
 * portable vector types (one AVX-512 register, or two AVX2 ones): the 16 scores of a query
 * head come out of one transpose-and-add tree instead of 16 separate horizontal sums.
 * Positions n..15 of a partial block are read (the block's memory exists, and holds finite
 * values: the pool starts zeroed and only ever receives K/V) and then given weight 0. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 ld16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16 sum16(v16 *r) { /* lane t = sum of the lanes of r[t]; r is clobbered */
    for (int i = 0; i < 8; ++i)
        r[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23)
             + __builtin_shufflevector(r[2 * i], r[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        r[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        r[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(r[0], r[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30)
         + __builtin_shufflevector(r[0], r[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}

static inline __attribute__((always_inline)) void head_block16(
        const float *restrict qh, const float *restrict kb, const float *restrict vb, int64_t n,
        int64_t pos_stride, float scale, float *restrict m, float *restrict l,
        float *restrict acc, const int64_t G, const int64_t D) {
    float sc[MAX_GROUP * 16] __attribute__((aligned(64)));
    /* scores: each K slice is loaded once and used by the G query heads */
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        const int64_t cw = D - c0 < 64 ? D - c0 : 64; /* up to 4 slices per pass */
        v16 part[MAX_GROUP][16];
        for (int t = 0; t < 16; ++t) {
            const float *kt = kb + t * pos_stride + c0;
            for (int64_t gi = 0; gi < G; ++gi) part[gi][t] = ld16(qh + gi * D + c0) * ld16(kt);
            for (int64_t c = 16; c < cw; c += 16) {
                const v16 kv = ld16(kt + c);
                for (int64_t gi = 0; gi < G; ++gi) part[gi][t] += ld16(qh + gi * D + c0 + c) * kv;
            }
        }
        for (int64_t gi = 0; gi < G; ++gi) {
            v16 s = sum16(part[gi]) * scale;
            if (c0) {
                s += ld16(sc + gi * 16);
            }
            memcpy(sc + gi * 16, &s, sizeof s);
        }
    }
    float corr[MAX_GROUP];
    for (int64_t gi = 0; gi < G; ++gi) {
        float *row = sc + gi * 16;
        float bmax = row[0];
        for (int64_t t = 1; t < n; ++t) bmax = row[t] > bmax ? row[t] : bmax;
        const float mnew = bmax > m[gi] ? bmax : m[gi];
        corr[gi] = exp_poly(m[gi] - mnew);
        float lsum = 0.0f;
#pragma omp simd reduction(+ : lsum)
        for (int t = 0; t < 16; ++t) {
            const float p = t < n ? exp_poly(row[t] - mnew) : 0.0f;
            row[t] = p;
            lsum += p;
        }
        l[gi] = l[gi] * corr[gi] + lsum;
        m[gi] = mnew;
    }
    /* values: each V slice is loaded once and used by the G accumulators (in registers) */
    for (int64_t c = 0; c < D; c += 16) {
        v16 a[MAX_GROUP];
        for (int64_t gi = 0; gi < G; ++gi) a[gi] = ld16(acc + gi * D + c) * corr[gi];
        for (int64_t t = 0; t < n; ++t) {
            const v16 vv = ld16(vb + t * pos_stride + c);
            for (int64_t gi = 0; gi < G; ++gi) a[gi] += sc[gi * 16 + t] * vv;
        }
        for (int64_t gi = 0; gi < G; ++gi) memcpy(acc + gi * D + c, &a[gi], sizeof(v16));
    }
}

/* Heads h0..h1-1 of sequence s. */
static void decode_item(const Decode *j, int64_t s, int64_t h0, int64_t h1) {
    const int64_t g = j->hq / j->hkv, d = j->d, bs = j->bs, hkv = j->hkv;
    const int64_t pos_stride = hkv * d;
    const int64_t nh = (h1 - h0) * g; /* query heads handled here */
    float m[MAX_HEADS], l[MAX_HEADS];
    float acc[MAX_HEADS * MAX_DIM] __attribute__((aligned(64)));
    const int64_t len = j->lens[s];
    const int32_t *table = j->tables + s * j->table_stride;
    const float *qs = j->q + s * j->q_stride + h0 * g * d;
    for (int64_t i = 0; i < nh; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * nh * d);
    for (int64_t start = 0; start < len; start += bs) {
        const int64_t blk = table[start / bs];
        const int64_t n = len - start < bs ? len - start : bs;
        const float *kb = j->k_cache + blk * bs * pos_stride + h0 * d;
        const float *vb = j->v_cache + blk * bs * pos_stride + h0 * d;
        if (start + bs < len) {
            /* the next block sits at a random address, where the hardware prefetcher cannot
             * follow: ask for its rows of these heads now (one request per 64-byte line) */
            const int64_t nxt = table[start / bs + 1];
            const int64_t m1 = len - start - bs < bs ? len - start - bs : bs;
            const float *kn = j->k_cache + nxt * bs * pos_stride + h0 * d;
            const float *vn = j->v_cache + nxt * bs * pos_stride + h0 * d;
            const int64_t span = (h1 - h0) * d;
            for (int64_t t = 0; t < m1; ++t)
                for (int64_t c = 0; c < span; c += 16) {
                    __builtin_prefetch(kn + t * pos_stride + c);
                    __builtin_prefetch(vn + t * pos_stride + c);
                }
        }
        /* the block's kv heads in memory order; each for the G query heads it serves */
        for (int64_t h = 0; h < h1 - h0; ++h) {
            const float *qh = qs + h * g * d;
            float *mh = m + h * g, *lh = l + h * g, *ah = acc + h * g * d;
            const float *kh = kb + h * d, *vh = vb + h * d;
            if (bs == 16 && d == 64 && g == 3)
                head_block16(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 3, 64);
            else if (bs == 16 && d == 64 && g == 4)
                head_block16(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 4, 64);
            else if (bs == 16 && d == 128 && g == 4)
                head_block16(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 4, 128);
            else if (bs == 16 && d % 16 == 0 && g <= MAX_GROUP)
                head_block16(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, g, d);
            else if (d == 64 && g == 3)
                head_block(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 3, 64);
            else if (d == 64 && g == 4)
                head_block(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 4, 64);
            else if (d == 64 && g == 1)
                head_block(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 1, 64);
            else if (d == 128 && g == 4)
                head_block(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 4, 128);
            else if (d == 128 && g == 8)
                head_block(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, 8, 128);
            else
                head_block(qh, kh, vh, n, pos_stride, j->scale, mh, lh, ah, g, d);
        }
    }
    float *o = j->out + (s * j->hq + h0 * g) * d;
    for (int64_t i = 0; i < nh; ++i) {
        const float inv = 1.0f / l[i];
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) o[i * d + k] = acc[i * d + k] * inv;
    }
}

int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int32_t *tables, int64_t table_stride, const int32_t *lens, float *out,
                     int64_t nd, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale,
                     int nthreads) {
    if (hq % hkv || hq / hkv > MAX_GROUP || hq > MAX_HEADS || d > MAX_DIM || bs > MAX_BS) return -1;
    const Decode j = {q, k_cache, v_cache, tables, lens, out, q_stride, table_stride, hq, hkv, d,
                      bs, scale};
    int64_t positions = 0;
    for (int64_t s = 0; s < nd; ++s) positions += lens[s];
    /* about 1.5 KB of K/V per position and kv head group: below ~64 positions a second
     * thread costs more to wake than it saves */
    int nt = nthreads < 1 ? 1 : nthreads;
    if (positions < 64) nt = 1;
    /* per-head items when sequences are too few to balance the threads */
    const int64_t split = (nt > 1 && nd < 4 * nt) ? hkv : 1;
    const int64_t items = nd * split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t w = 0; w < items; ++w) {
        const int64_t s = w / split;
        if (split == 1) {
            decode_item(&j, s, 0, hkv);
        } else {
            const int64_t h = w % split;
            decode_item(&j, s, h, h + 1);
        }
    }
    return 0;
}

/* ---- row-wise ops ------------------------------------------------------------------- */

/* Rows per thread below which the op stays on the calling thread. */
#define ROWS_PER_THREAD 64

static int team(int64_t rows, int nthreads) {
    if (nthreads < 2 || rows < 2 * ROWS_PER_THREAD) return 1;
    return nthreads;
}

/* res += delta (when delta is not NULL), then out = res * rsqrt(mean(res^2) + eps) * w.
 * The same operation order as the float32 torch/HF RMSNorm: the normalised row is
 * rounded before the weight multiplies it. */
void rms_norm_f32(float *res, const float *delta, const float *w, float *out, int64_t rows,
                  int64_t hidden, float eps, int nthreads) {
    const int nt = team(rows, nthreads);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < rows; ++r) {
        float *x = res + r * hidden;
        if (delta) {
            const float *dl = delta + r * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) x[i] += dl[i];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hidden; ++i) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        float *o = out + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = (x[i] * inv) * w[i];
    }
}

/* qkv [T, qkv_stride] holds q (hq heads), k (hkv heads), v (hkv heads) of D each. Rotates q
 * and k in place (rotate-half form, cos/sin from table [max_pos, D]: cos in the first D/2
 * columns, sin in the last D/2) and writes the rotated k and v to the pool slots. */
void rope_write_kv_f32(float *qkv, int64_t t_rows, int64_t qkv_stride, const int64_t *positions,
                       const float *table, int64_t hq, int64_t hkv, int64_t d, float *k_cache,
                       float *v_cache, const int64_t *slots, int nthreads) {
    const int64_t half = d / 2, nrot = hq + hkv;
    const int nt = team(t_rows, nthreads);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < t_rows; ++r) {
        float *row = qkv + r * qkv_stride;
        const float *cs = table + positions[r] * d;
        const float *c = cs, *sn = cs + half;
        for (int64_t h = 0; h < nrot; ++h) {
            float *x1 = row + h * d, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * sn[i];
                x2[i] = b * c[i] + a * sn[i];
            }
        }
        const int64_t slot = slots[r];
        memcpy(k_cache + slot * hkv * d, row + hq * d, sizeof(float) * hkv * d);
        memcpy(v_cache + slot * hkv * d, row + (hq + hkv) * d, sizeof(float) * hkv * d);
    }
}

/* out [T, I] = silu(gu[:, :I]) * gu[:, I:], silu(x) = x / (1 + e^-x). */
void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter, int nthreads) {
    const int nt = team(rows, nthreads);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
            const float x = g[i];
            const float e = exp_poly(-x);
            o[i] = (x / (1.0f + e)) * u[i];
        }
    }
}
