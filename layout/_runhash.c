/* XXH3-64 of a digest grid's units where their rows lie, for kvbridge.layout.digest.
 *
 * A grid is L layers x KV (K/V) x H heads x R runs. Run r of (l, kv, h) is lens[r] bytes at
 * bases[l * KV + kv] + heads[h] + offs[r]: rows back to back in memory (a block's tokens of one
 * head in a head-major pool, one token's row in a token-major one). Run r belongs to unit
 * unit[r] of its (l, kv, h), and each unit's runs are in token order (r ascending). Unit u of
 * (l, kv, h) is the concatenation of its runs, and out[((l * KV + kv) * H + h) * U + u] is its
 * XXH3-64 with seed seeds[(l * KV + kv) * H + h].
 *
 * The four axes are walked in `order` (outermost first: 0 layers, 1 K/V, 2 heads, 3 runs), the
 * pool's address order as the caller finds it, so memory is read as a stream whatever the
 * canonical order; r stays ascending within each (l, kv, h), so every unit is hashed in token
 * order. A unit of one run is hashed in one call; a longer one through xxHash's streaming API
 * (the same value), one state per unit under way. The hash is xxHash's own: the caller passes
 * the addresses of its functions, resolved from the xxhash package's library, so the values are
 * the ones that package computes. The GIL is released for the whole walk.
 *
 * Python: hash_grid(fns, bases_ptr, L, KV, heads_ptr, H, offs_ptr, lens_ptr, unit_ptr, R,
 * counts_ptr, U, order, seeds_ptr, out_ptr); fns: the addresses of XXH3_64bits_withSeed,
 * XXH3_createState, XXH3_freeState, XXH3_64bits_reset_withSeed, XXH3_64bits_update,
 * XXH3_64bits_digest; counts[u]: runs of unit u (the same in every (l, kv, h)); order: a tuple
 * of the four axes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef uint64_t (*with_seed_fn)(const void *, size_t, uint64_t);
typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *, uint64_t);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

static PyObject *hash_grid(PyObject *self, PyObject *args) {
    (void)self;
    long long f[6], bases, L, KV, heads, H, offs, lens, unit, R, counts, U, seeds, out;
    int ord[4];
    if (!PyArg_ParseTuple(args, "(LLLLLL)LLLLLLLLLLL(iiii)LL", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &bases, &L,
                          &KV, &heads, &H, &offs, &lens, &unit, &R, &counts, &U, &ord[0], &ord[1], &ord[2], &ord[3],
                          &seeds, &out))
        return NULL;
    for (int i = 0; i < 6; i++)
        if (!f[i]) {
            PyErr_Format(PyExc_ValueError, "hash_grid: function %d of 6 is NULL", i);
            return NULL;
        }
    int seen = 0;
    for (int i = 0; i < 4; i++)
        if (ord[i] >= 0 && ord[i] < 4) seen |= 1 << ord[i];
    if (L < 1 || KV < 1 || H < 1 || R < 1 || U < 1 || U > R || seen != 15) {
        PyErr_Format(PyExc_ValueError, "hash_grid: bad grid (L %lld, KV %lld, H %lld, R %lld, U %lld, order %d %d %d %d)",
                     L, KV, H, R, U, ord[0], ord[1], ord[2], ord[3]);
        return NULL;
    }
    const with_seed_fn with_seed = (with_seed_fn)(intptr_t)f[0];
    const create_fn create = (create_fn)(intptr_t)f[1];
    const free_fn release = (free_fn)(intptr_t)f[2];
    const reset_fn reset = (reset_fn)(intptr_t)f[3];
    const update_fn update = (update_fn)(intptr_t)f[4];
    const digest_fn digest = (digest_fn)(intptr_t)f[5];
    const int64_t *base = (const int64_t *)(intptr_t)bases, *head = (const int64_t *)(intptr_t)heads;
    const int64_t *off = (const int64_t *)(intptr_t)offs, *len = (const int64_t *)(intptr_t)lens;
    const int64_t *un = (const int64_t *)(intptr_t)unit, *cnt = (const int64_t *)(intptr_t)counts;
    const uint64_t *seed = (const uint64_t *)(intptr_t)seeds;
    uint64_t *o = (uint64_t *)(intptr_t)out;
    const int64_t rows = L * KV * H, n[4] = {L, KV, H, R};
    /* per unit under way: its state and the runs it still waits for */
    void **state = calloc((size_t)(rows * U), sizeof(void *));
    int64_t *left = malloc((size_t)(rows * U) * sizeof(int64_t));
    if (!state || !left) {
        free(state);
        free(left);
        return PyErr_NoMemory();
    }
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < rows * U; i++) left[i] = cnt[i % U];
    int64_t ix[4];
    for (ix[ord[0]] = 0; ix[ord[0]] < n[ord[0]] && !bad; ix[ord[0]]++)
        for (ix[ord[1]] = 0; ix[ord[1]] < n[ord[1]] && !bad; ix[ord[1]]++)
            for (ix[ord[2]] = 0; ix[ord[2]] < n[ord[2]] && !bad; ix[ord[2]]++)
                for (ix[ord[3]] = 0; ix[ord[3]] < n[ord[3]] && !bad; ix[ord[3]]++) {
                    const int64_t row = (ix[0] * KV + ix[1]) * H + ix[2], r = ix[3], k = row * U + un[r];
                    const char *p = (const char *)(intptr_t)(base[ix[0] * KV + ix[1]] + head[ix[2]] + off[r]);
                    if (cnt[un[r]] == 1) {
                        o[k] = with_seed(p, (size_t)len[r], seed[row]);
                        continue;
                    }
                    if (!state[k]) {
                        if (!(state[k] = create()) || reset(state[k], seed[row]) != 0) {
                            bad = 1;
                            break;
                        }
                    }
                    if (update(state[k], p, (size_t)len[r]) != 0) {
                        bad = 1;
                        break;
                    }
                    if (--left[k] == 0) {
                        o[k] = digest(state[k]);
                        release(state[k]);
                        state[k] = NULL;
                    }
                }
    for (int64_t i = 0; i < rows * U; i++)
        if (state[i]) {
            bad = 1; /* a unit that did not get all its runs (counts disagree with unit), or an error above */
            release(state[i]);
        }
    Py_END_ALLOW_THREADS
    free(state);
    free(left);
    if (bad) {
        PyErr_SetString(PyExc_RuntimeError, "hash_grid: xxHash's streaming API failed, or a unit's runs do not "
                                            "add up to its count");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"hash_grid", hash_grid, METH_VARARGS,
     "hash_grid(fns, bases_ptr, L, KV, heads_ptr, H, offs_ptr, lens_ptr, unit_ptr, R, counts_ptr, U, order, "
     "seeds_ptr, out_ptr): XXH3-64 of each unit of a digest grid, read where its runs lie, axes walked in order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_runhash", "XXH3-64 of a digest grid's units, for "
                                    "kvbridge.layout.digest.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__runhash(void) { return PyModule_Create(&module); }
