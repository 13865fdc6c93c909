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

/* ---- prefill attention ------------------------------------------------------------------ */

/* Causal attention of prompt chunks over the paged pool (their K/V already written), with no
 * gather of the context. One work item is (sequence, kv head, tile of up to 16 query
 * positions); its rows are the tile's positions times the G query heads of the kv head, and
 * they are processed 16 at a time with one row per vector lane: Q is transposed once per
 * item, so that both products run as broadcast-FMAs on plain loads,
 *
 *   S^T[t][rows] = sum_c Q^T[c][rows] * K[t][c]        (16 key positions t of a block)
 *   O^T[c][rows] = O^T[c][rows] * corr + sum_t P^T[t][rows] * V[t][c]
 *
 * and the online softmax (running max and sum per row) is lane-wise, with no horizontal
 * reductions. Keys past a row's position get weight exactly 0. Block size 16, D a multiple of
 * 16 up to 256 (the caller checks). */

#define PF_TILE 16   /* query positions per item (fewer when G is large) */
#define PF_ROWS 128  /* rows (positions x G) per item */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* Rows per vector: one register's lanes. 16 with AVX-512; 8 with AVX2, whose 16 registers
 * hold 16 key positions' scores of 8 rows but not of 16 (a 16-lane vector there is two
 * registers and every product spills: the AVX2 build of the 16-lane kernel ran at 1 GFLOP/s,
 * 45x slower than this one). */
#if defined(__AVX512F__)
#define VL 16
#define KB 16 /* key positions scored at once (a pool block, or half of one) */
#else
#define VL 8
#define KB 8
#endif
typedef float vf __attribute__((vector_size(4 * VL), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * VL), aligned(4)));

static inline vf ldv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf fmav(vf a, vf b, vf c) { /* a * b + c, fused */
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int i = 0; i < VL; ++i) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

static inline vf bcastv(float x) { return (vf){0} + x; }

static inline vf maxv(vf a, vf b) {
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* exp_poly lane-wise */
static inline vf expv(vf x) {
    x = maxv(x, bcastv(-87.0f));
    x = -maxv(-x, bcastv(-88.0f));
    const vf t = x * 1.44269504088896341f;
    const vf n = (t + 12582912.0f) - 12582912.0f;
    vf r = fmav(n, bcastv(-0.693145751953125f), x);
    r = fmav(n, bcastv(-1.428606765330187e-06f), r);
    vf p = bcastv(1.3888889e-03f);
    p = fmav(p, r, bcastv(8.3333333e-03f));
    p = fmav(p, r, bcastv(4.1666667e-02f));
    p = fmav(p, r, bcastv(1.6666667e-01f));
    p = fmav(p, r, bcastv(0.5f));
    p = fmav(p, r, bcastv(1.0f));
    p = fmav(p, r, bcastv(1.0f));
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *tables;
    const int64_t *qstart, *qlen, *klen; /* per prefill sequence */
    float *out;
    int64_t q_stride, out_stride, table_stride, hq, hkv, d, bs;
    float scale;
} Prefill;

static inline __attribute__((always_inline)) void prefill_item(
        const Prefill *j, int64_t s, int64_t h, int64_t i0, int64_t nq, const int64_t G,
        const int64_t D) {
    const int64_t pos_stride = j->hkv * D;
    const int64_t nrows = nq * G, ngroups = (nrows + VL - 1) / VL;
    const int64_t qlen = j->qlen[s], klen = j->klen[s];
    const int64_t first = klen - qlen + i0; /* position of the tile's first query */
    const int64_t last = first + nq - 1;
    const int32_t *table = j->tables + s * j->table_stride;
    const int64_t W = ngroups * VL; /* row stride of qt / ot */
    float qt[D * W] __attribute__((aligned(64))); /* Q^T [D][W] */
    float ot[D * W] __attribute__((aligned(64))); /* O^T [D][W] */
    float m[PF_ROWS] __attribute__((aligned(64))), l[PF_ROWS] __attribute__((aligned(64)));
    float rowpos[PF_ROWS] __attribute__((aligned(64)));
    for (int64_t r = 0; r < W; ++r) {
        /* row r = (query position r / G, head r % G); padding rows copy the last real row */
        const int64_t rr = r < nrows ? r : nrows - 1;
        const int64_t qi = rr / G, g = rr % G;
        const float *src = j->q + (j->qstart[s] + i0 + qi) * j->q_stride + (h * G + g) * D;
        for (int64_t c = 0; c < D; ++c) qt[c * W + r] = src[c];
        rowpos[r] = (float)(first + qi);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(ot, 0, sizeof(float) * D * W);
    const int64_t nblocks = last / 16 + 1;
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t blk = table[b];
        const float *kb = j->k_cache + blk * 16 * pos_stride + h * D;
        const float *vb = j->v_cache + blk * 16 * pos_stride + h * D;
        for (int64_t sub = 0; sub < 16; sub += KB) {
        const float *ks = kb + sub * pos_stride, *vs = vb + sub * pos_stride;
        const int64_t k0 = b * 16 + sub;
        if (k0 > last)
            break; /* no row of the tile sees these keys */
        const int masked = k0 + KB - 1 > first; /* some row sees only part of these keys */
        for (int64_t grp = 0; grp < ngroups; ++grp) {
            const int64_t r0 = grp * VL;
            if (masked && (float)k0 > rowpos[r0 + VL - 1] && (float)k0 > rowpos[r0])
                continue; /* no row of this group sees any of these keys */
            vf st[KB]; /* the scores of KB key positions, a vector of rows each */
            for (int t = 0; t < KB; ++t) st[t] = (vf){0};
            for (int64_t c = 0; c < D; ++c) {
                const vf qc = ldv(qt + c * W + r0);
                for (int t = 0; t < KB; ++t) st[t] = fmav(qc, bcastv(ks[t * pos_stride + c]), st[t]);
            }
            const vf pos = ldv(rowpos + r0);
            vf mx = ldv(m + r0);
            const vf mold = mx;
            vi keep[KB];
            for (int t = 0; t < KB; ++t) {
                st[t] *= j->scale;
                keep[t] = bcastv((float)(k0 + t)) <= pos; /* causal: key position <= row's */
                const vf sm = (vf)(((vi)st[t] & keep[t]) | ((vi)bcastv(-INFINITY) & ~keep[t]));
                mx = maxv(mx, sm);
            }
            const vf corr = expv(mold - mx); /* rows with m = -inf: exp(-inf) -> ~0, acc is 0 */
            vf lsum = (vf){0};
            for (int t = 0; t < KB; ++t) {
                st[t] = (vf)((vi)expv(st[t] - mx) & keep[t]);
                lsum += st[t];
            }
            memcpy(m + r0, &mx, sizeof mx);
            const vf lnew = ldv(l + r0) * corr + lsum;
            memcpy(l + r0, &lnew, sizeof lnew);
            for (int64_t c0 = 0; c0 < D; c0 += 8) {
                vf acc[8];
                for (int c = 0; c < 8; ++c) acc[c] = ldv(ot + (c0 + c) * W + r0) * corr;
                for (int t = 0; t < KB; ++t) {
                    const float *vt = vs + t * pos_stride + c0;
                    for (int c = 0; c < 8; ++c) acc[c] = fmav(st[t], bcastv(vt[c]), acc[c]);
                }
                for (int c = 0; c < 8; ++c) memcpy(ot + (c0 + c) * W + r0, &acc[c], sizeof(vf));
            }
        }
        }
    }
    for (int64_t r = 0; r < nrows; ++r) {
        const int64_t qi = r / G, g = r % G;
        float *dst = j->out + (j->qstart[s] + i0 + qi) * j->out_stride + (h * G + g) * D;
        const float inv = 1.0f / l[r];
        for (int64_t c = 0; c < D; ++c) dst[c] = ot[c * W + r] * inv;
    }
}

/* q [T, q_stride] rows (query head i of row t at q + t*q_stride + i*D), out [T, out_stride]
 * likewise; sequence s has its qlen[s] query rows from row qstart[s], at positions
 * klen[s] - qlen[s] .. klen[s] - 1 of a context of klen[s] positions in the pool. */
int paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache,
                      const float *v_cache, const int32_t *tables, int64_t table_stride,
                      const int64_t *qstart, const int64_t *qlen, const int64_t *klen,
                      float *out, int64_t out_stride, int64_t ns, int64_t hq, int64_t hkv,
                      int64_t d, int64_t bs, float scale, int nthreads) {
    if (hq % hkv || bs != 16 || d % 16 || d > MAX_DIM || hq / hkv > PF_ROWS - 15) return -1;
    const int64_t G = hq / hkv;
    int64_t tile = PF_ROWS / G;
    tile = tile > PF_TILE ? PF_TILE : tile;
    const Prefill j = {q, k_cache, v_cache, tables, qstart, qlen, klen, out, q_stride,
                       out_stride, table_stride, hq, hkv, d, bs, scale};
    int64_t items = 0, work = 0;
    for (int64_t s = 0; s < ns; ++s) {
        items += (qlen[s] + tile - 1) / tile * hkv;
        work += qlen[s] * klen[s];
    }
    int nt = nthreads < 1 ? 1 : nthreads;
    if (work < 4096) nt = 1;
    /* items in order of decreasing cost: the last tiles of the longest contexts first */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t w = 0; w < items; ++w) {
        int64_t rem = w, s = 0, n = 0;
        for (s = 0; s < ns; ++s) {
            n = (qlen[s] + tile - 1) / tile * hkv;
            if (rem < n) break;
            rem -= n;
        }
        const int64_t ntiles = n / hkv;
        const int64_t ti = ntiles - 1 - rem / hkv, h = rem % hkv; /* last tile first */
        const int64_t i0 = ti * tile;
        const int64_t nq = qlen[s] - i0 < tile ? qlen[s] - i0 : tile;
        if (G == 3 && d == 64)
            prefill_item(&j, s, h, i0, nq, 3, 64);
        else if (G == 4 && d == 64)
            prefill_item(&j, s, h, i0, nq, 4, 64);
        else if (G == 4 && d == 128)
            prefill_item(&j, s, h, i0, nq, 4, 128);
        else
            prefill_item(&j, s, h, i0, nq, G, d);
    }
    return 0;
}
