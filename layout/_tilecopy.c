/* Tile copies between a pool and a dense staging buffer, in the pool's address order.
 *
 * A tile is A x C rows of R bytes in a pool: row (a, c) at tile + a*sA + c*sC (bytes).
 * Its dense image is the rows back to back, a-major: row (a, c) at dense + (a*C + c)*R.
 * Tile i of a call is at tiles[i]; its dense image at dense + i*A*C*R.
 *
 * gather: pool tiles -> dense; scatter: dense -> pool tiles. Both walk each tile in the
 * pool's address order (the smaller of sA, sC inner), so the pool side is read or written
 * as one stream, and the dense side as A (or C) streams. With `stream`, stores go around
 * the cache (x86-64 non-temporal stores, 16-byte aligned rows of a multiple of 16 bytes):
 * a staging buffer that goes to the wire next, or a pool the engine reads much later,
 * does not need to be read into the cache before it is written. The GIL is released.
 *
 * Python: tile_copy(tiles_ptr, count, dense_ptr, A, C, R, sA, sC, scatter, stream).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f"))) static inline void row_nt512(char *d, const char *s, int64_t R) {
    int64_t k = 0;
    for (; k + 64 <= R; k += 64)
        _mm512_stream_si512((__m512i *)(d + k), _mm512_loadu_si512((const void *)(s + k)));
    for (; k < R; k += 16)
        _mm_stream_si128((__m128i *)(d + k), _mm_loadu_si128((const __m128i *)(s + k)));
}

static inline void row_nt128(char *d, const char *s, int64_t R) {
    for (int64_t k = 0; k < R; k += 16)
        _mm_stream_si128((__m128i *)(d + k), _mm_loadu_si128((const __m128i *)(s + k)));
}

/* The tile walk of copy_tiles (below) with a streamed row copy inlined: no call per row,
   which costs a tenth of the copy's time for 256-byte rows. A gather also prefetches the pool
   PF bytes ahead of the row it reads (hint LOC), and the next tile's first 2 KiB: a pool the
   engine did not madvise is in 4 KiB pages (THP madvise-only), and the hardware prefetcher
   stops at each page's end. Which prefetch pays differs by vendor, measured one thread, 512 MiB
   in 16 MiB parts, interleaved in one process:
   - AMD EPYC (L3 32 MiB): non-temporal 2 KiB ahead, repack_ratio 0.77-0.82 without
     it, 0.81-0.87 with it (six runs each); 4 KiB ahead was slower, 1 KiB no better;
   - Intel Xeon with AVX-512: that prefetch made the gather slower (7.9 against 8.7
     GB/s without); into L2 (prefetcht2) 4 KiB ahead 10.1 GB/s, 2 KiB 9.8, 8 KiB 9.2. */
#define NEXT_TILE_BYTES 2048
#define STREAMED_WALK(NAME, ATTR, ROW, PF, LOC)                                                        \
    ATTR static void NAME(const int64_t *tiles, int64_t count, char *dense, int64_t A, int64_t C,      \
                          int64_t R, int64_t sA, int64_t sC, int scatter) {                            \
        const int c_inner = sC <= sA;                                                                  \
        const int64_t outer = c_inner ? A : C, inner = c_inner ? C : A;                                \
        const int64_t pool_o = c_inner ? sA : sC, pool_i = c_inner ? sC : sA; /* pool strides */       \
        const int64_t dense_o = c_inner ? C * R : R, dense_i = c_inner ? R : C * R;                    \
        for (int64_t i = 0; i < count; i++) {                                                          \
            char *t = (char *)(intptr_t)tiles[i], *b = dense + i * A * C * R;                          \
            for (int64_t o = 0; o < outer; o++) {                                                      \
                char *p = t + o * pool_o, *q = b + o * dense_o;                                        \
                for (int64_t n = 0; n < inner; n++, p += pool_i, q += dense_i) {                       \
                    if (!scatter) __builtin_prefetch(p + (PF), 0, LOC);                                \
                    if (scatter) ROW(p, q, R); else ROW(q, p, R);                                      \
                }                                                                                      \
            }                                                                                          \
            if (!scatter && i + 1 < count) /* the next tile's first rows, wherever its page is */      \
                for (int64_t k = 0; k < NEXT_TILE_BYTES; k += 64)                                      \
                    __builtin_prefetch((const char *)(intptr_t)tiles[i + 1] + k, 0, 0);                \
        }                                                                                              \
    }
STREAMED_WALK(walk_nt512, __attribute__((target("avx512f"))), row_nt512, 2048, 0)
STREAMED_WALK(walk_nt128, , row_nt128, 2048, 0)
STREAMED_WALK(walk_nt512_l2, __attribute__((target("avx512f"))), row_nt512, 4096, 1)
STREAMED_WALK(walk_nt128_l2, , row_nt128, 4096, 1)

__attribute__((target("avx512f"))) static void rows_nt512(char *d, const char *s, int64_t R) { row_nt512(d, s, R); }
static void rows_nt128(char *d, const char *s, int64_t R) { row_nt128(d, s, R); }
#endif

typedef void (*row_fn)(char *, const char *, int64_t);

static void rows_plain(char *d, const char *s, int64_t R) { memcpy(d, s, (size_t)R); }

static void copy_tiles(const int64_t *tiles, int64_t count, char *dense, int64_t A, int64_t C, int64_t R,
                       int64_t sA, int64_t sC, int scatter, row_fn row) {
    const int64_t box = A * C * R;
    const int c_inner = sC <= sA;
    for (int64_t i = 0; i < count; i++) {
        char *t = (char *)(intptr_t)tiles[i];
        char *b = dense + i * box;
        if (sC == R && sA == C * R) { /* the tile is contiguous: one copy */
            if (scatter) row(t, b, box); else row(b, t, box);
            continue;
        }
        const int64_t outer = c_inner ? A : C, inner = c_inner ? C : A;
        for (int64_t o = 0; o < outer; o++) {
            for (int64_t n = 0; n < inner; n++) {
                const int64_t a = c_inner ? o : n, c = c_inner ? n : o;
                char *p = t + a * sA + c * sC, *q = b + (a * C + c) * R;
                if (scatter) row(p, q, R); else row(q, p, R);
            }
        }
    }
}

static PyObject *tile_copy(PyObject *self, PyObject *args) {
    long long tiles, count, dense, A, C, R, sA, sC;
    int scatter, stream;
    if (!PyArg_ParseTuple(args, "LLLLLLLLpp", &tiles, &count, &dense, &A, &C, &R, &sA, &sC, &scatter, &stream))
        return NULL;
    if (count < 0 || A < 1 || C < 1 || R < 1 || sA < 0 || sC < 0) {
        PyErr_Format(PyExc_ValueError, "tile_copy: bad shape (count %lld, A %lld, C %lld, R %lld, sA %lld, sC %lld)",
                     count, A, C, R, sA, sC);
        return NULL;
    }
    row_fn row = rows_plain;
#if defined(__x86_64__)
    if (stream && R % 16 == 0 && dense % 16 == 0) {
        /* every row start is 16-byte aligned on the side written: rows of R bytes from an aligned base,
           tile addresses and strides checked here when the pool side is written */
        int aligned = 1;
        if (scatter) {
            const int64_t *tq = (const int64_t *)(intptr_t)tiles;
            aligned = (sA % 16 == 0) && (sC % 16 == 0);
            for (int64_t i = 0; aligned && i < count; i++) aligned = tq[i] % 16 == 0;
        }
        if (aligned) {
            __builtin_cpu_init();
            row = __builtin_cpu_supports("avx512f") ? rows_nt512 : rows_nt128;
        }
    }
#else
    (void)stream;
#endif
    const int64_t *tp = (const int64_t *)(intptr_t)tiles;
    char *dp = (char *)(intptr_t)dense;
    const int contiguous = sC == R && sA == C * R; /* a tile is one run: one copy per tile */
    Py_BEGIN_ALLOW_THREADS
#if defined(__x86_64__)
    const int l2 = row != rows_plain && __builtin_cpu_is("intel"); /* the prefetch each vendor ran faster with */
    if (row == rows_nt512 && !contiguous)
        (l2 ? walk_nt512_l2 : walk_nt512)(tp, count, dp, A, C, R, sA, sC, scatter);
    else if (row == rows_nt128 && !contiguous)
        (l2 ? walk_nt128_l2 : walk_nt128)(tp, count, dp, A, C, R, sA, sC, scatter);
    else
#endif
        copy_tiles(tp, count, dp, A, C, R, sA, sC, scatter, row);
#if defined(__x86_64__)
    if (row != rows_plain) _mm_sfence(); /* streamed stores visible before the caller hands the buffer on */
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"tile_copy", tile_copy, METH_VARARGS,
     "tile_copy(tiles_ptr, count, dense_ptr, A, C, R, sA, sC, scatter, stream): copy `count` tiles of A x C rows "
     "of R bytes (pool strides sA, sC) to (scatter: from) a dense buffer, in the pool's address order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tilecopy", "Tile copies for kvbridge.layout.repack.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__tilecopy(void) { return PyModule_Create(&module); }
