/* picklehooks._speedups, part one (depends on no other part): the statistics of
 * picklehooks._stats.STAT_NAMES in one pass over a CPU tensor's memory.
 *
 *   stats(ptr, dtype_code, sizes, strides) -> Stats(mean, std, min, max,
 *                                               absmax, norm, nan, inf,
 *                                               zero_frac), or None
 *
 * Stats is a read-only sequence of the nine floats (one object, where a tuple
 * would be ten; it pickles and copies as a tuple).
 *
 * ptr is the address of the element at index 0 (torch's data_ptr()), strides
 * are in elements and may be 0 or negative; dtype codes are those of
 * DTYPE_CODES. Nothing here knows torch: the caller (picklehooks/_native.py, or
 * rows.c's lane, which makes the same checks first) vouches that the memory is readable, and this module reads every element
 * the sizes and strides address. None means "not handled here, use the exact
 * PyTorch path": an empty tensor, a pointer that can't be a live allocation,
 * too many dimensions, and float64 data outside [2**-400, 2**450] in
 * magnitude, where the squares below could underflow or overflow.
 *
 * Semantics are those of picklehooks._stats.tensor_stats: std is the
 * population standard deviation; any NaN makes mean, std, min, max, absmax
 * and norm NaN; an Inf makes std NaN and mean +-Inf (NaN with both signs).
 *
 * How: elements are read in chunks of CHUNK. Per chunk, every lane of a
 * block of LANES elements keeps its own sums (in double) of d = x - K and
 * d*d, where K is the chunk's first element, and its own min, max and zero
 * count; independent lanes are what lets the compiler vectorise the loop
 * (a single running sum is a dependency chain it may not reorder). Chunks
 * are merged with Chan's formula, so the shifted sums never cancel by more
 * than a chunk's worth of elements; norm is sqrt(M2 + n*mean**2), a sum of
 * two non-negative terms. NaN and Inf are not counted in the fast loop:
 * they make the sums non-finite (finite float32/16 data can't: squares of
 * float32 values are far inside double's range), and only then a second,
 * scalar pass counts them.
 */
#include "_speedups.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, NCODES = 4 };
static const int ITEMSIZE[NCODES] = {4, 8, 2, 2};

/* Elements per chunk: int32 lane counts can't overflow, and the shifted sums
 * of one chunk lose at most ~CHUNK ulps to cancellation. */
#ifndef CHUNK
#define CHUNK 4096
#endif
/* Independent accumulators per statistic: two 512-bit vectors of doubles.
 * (With 8, GCC 12 doesn't vectorise the loop at all: 5x slower.) */
#ifndef LANES
#define LANES 16
#endif
/* Contiguous runs at least this long are read in place; shorter or strided
 * runs are first copied into a chunk buffer (a call per short run costs more
 * than the copy). */
#define DIRECT_MIN 512
/* Release the GIL from this many elements on (~10 us of work); below, taking
 * it back can cost more than the pass. */
#define NOGIL_MIN (1 << 16)
#define MAXDIM 64

/* GCC function multiversioning: one build runs the AVX-512 (or AVX2+FMA) loop
 * where the CPU has it and stays correct on any x86-64. Needs GCC >= 11
 * (arch=x86-64-v4; clang's target_clones differs) and ifunc, i.e. glibc (musl
 * has none). -DPICKLEHOOKS_NO_CLONES builds the one portable loop. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__) && \
    defined(__GLIBC__) && !defined(PICKLEHOOKS_NO_CLONES)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define HAVE_CLONES 1
#else
#define CLONES
#define HAVE_CLONES 0
#endif
#if defined(_MSC_VER) && !defined(restrict)
#define restrict __restrict
#endif

typedef struct {
    double s1, s2; /* sums of d and d*d, d = x - k */
    double k;
    double mn, mx;
    int64_t zeros;
} part_t;

typedef struct {
    double n, mean, m2, mn, mx;
    int64_t zeros;
} acc_t;

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float load_f32(const void *p, Py_ssize_t i) { return ((const float *)p)[i]; }
static inline double load_f64(const void *p, Py_ssize_t i) { return ((const double *)p)[i]; }
static inline float load_bf16(const void *p, Py_ssize_t i) {
    return bits_to_float((uint32_t)((const uint16_t *)p)[i] << 16);
}
/* IEEE binary16 -> binary32, exact, and independent of the FPU's
 * denormals-are-zero mode. Written without branches or selects, which would
 * stop GCC from vectorising the loop: normals get their exponent rebiased in
 * the bit pattern (Inf/NaN once more, to reach 255, keeping the payload);
 * subnormals are m * 2**-24, computed from the integer mantissa. */
static inline float load_f16(const void *p, Py_ssize_t i) {
    uint32_t h = ((const uint16_t *)p)[i];
    uint32_t em = h & 0x7fffu;
    uint32_t sign = (h & 0x8000u) << 16;
    uint32_t normal = (em << 13) + (112u << 23) + (uint32_t)(em >= 0x7c00u) * (112u << 23);
    float sub = (float)(int32_t)em * 0x1p-24f;
    uint32_t subbits;
    memcpy(&subbits, &sub, sizeof subbits);
    uint32_t is_sub = 0u - (uint32_t)(em < 0x400u);
    return bits_to_float(((normal & ~is_sub) | (subbits & is_sub)) | sign);
}

/* The tail and the end of a chunk's pass: the elements from i on go to lane 0, then the lanes are
 * folded pairwise (rounding ~log2(LANES)) and the chunk's part written. Shared by the lane loops. */
#define CHUNK_FINISH(VT, LOAD)                                                       \
    for (; i < n; i++) {                                                             \
        VT v = LOAD(p, i);                                                           \
        double d = (double)v - k;                                                    \
        s1[0] += d;                                                                  \
        s2[0] += d * d;                                                              \
        mn[0] = v < mn[0] ? v : mn[0];                                               \
        mx[0] = v > mx[0] ? v : mx[0];                                               \
        z[0] += v == 0;                                                              \
    }                                                                                \
    for (int w = LANES / 2; w >= 1; w /= 2) {                                        \
        for (int j = 0; j < w; j++) {                                                \
            s1[j] += s1[j + w];                                                      \
            s2[j] += s2[j + w];                                                      \
            mn[j] = mn[j + w] < mn[j] ? mn[j + w] : mn[j];                           \
            mx[j] = mx[j + w] > mx[j] ? mx[j + w] : mx[j];                           \
            z[j] += z[j + w];                                                        \
        }                                                                            \
    }                                                                                \
    out->s1 = s1[0];                                                                 \
    out->s2 = s2[0];                                                                 \
    out->k = k;                                                                      \
    out->mn = mn[0];                                                                 \
    out->mx = mx[0];                                                                 \
    out->zeros = z[0];

/* The sums, min, max and zero count of n >= 1 elements at p (contiguous).
 * The lane loop is what GCC vectorises (SLP across the LANES arrays). */
#define DEFINE_CHUNK(NAME, VT, LOAD)                                                 \
    static CLONES void NAME(const void *restrict p, Py_ssize_t n, part_t *out) {   \
        double s1[LANES] = {0}, s2[LANES] = {0};                                     \
        VT mn[LANES], mx[LANES];                                                     \
        int32_t z[LANES] = {0};                                                      \
        VT first = LOAD(p, 0);                                                       \
        double k = isfinite((double)first) ? (double)first : 0.0;                    \
        for (int j = 0; j < LANES; j++) mn[j] = mx[j] = first;                       \
        Py_ssize_t i = 0;                                                            \
        for (; i + LANES <= n; i += LANES) {                                         \
            for (int j = 0; j < LANES; j++) {                                        \
                VT v = LOAD(p, i + j);                                               \
                double d = (double)v - k;                                            \
                s1[j] += d;                                                          \
                s2[j] += d * d;                                                      \
                mn[j] = v < mn[j] ? v : mn[j];                                       \
                mx[j] = v > mx[j] ? v : mx[j];                                       \
                z[j] += v == 0;                                                      \
            }                                                                        \
        }                                                                            \
        CHUNK_FINISH(VT, LOAD)                                                       \
    }

DEFINE_CHUNK(chunk_f32, float, load_f32)
DEFINE_CHUNK(chunk_f64, double, load_f64)
DEFINE_CHUNK(chunk_f16, float, load_f16)
DEFINE_CHUNK(chunk_bf16, float, load_bf16)

/* float32, the commonest dtype, written out with AVX-512 intrinsics where the CPU has AVX-512F:
 * the same lanes, operations and folding as chunk_f32's loop, so the same bits, in fewer
 * instructions than GCC makes of that loop (which extracts each upper half to convert it, and
 * counts zeros in vector lanes): each half converts straight from memory, and a compare mask's
 * popcount counts the zeros, on the integer side: 1.42 -> 1.27 us a call for 8,192 floats in L1 (Zen 4).
 * Used where __builtin_cpu_supports says so at import, unless PICKLEHOOKS_F32_LOOP=lanes is set then
 * (tests compare the two); -DPICKLEHOOKS_NO_CLONES leaves it out. */
#if LANES == 16 && (HAVE_CLONES || (defined(__clang__) && defined(__x86_64__) && !defined(PICKLEHOOKS_NO_CLONES)))
#include <immintrin.h>
#define HAVE_AVX512_F32 1
__attribute__((target("avx512f,popcnt"))) static void chunk_f32_avx512(const void *restrict p, Py_ssize_t n,
                                                                       part_t *out) {
    const float *x = (const float *)p;
    float first = x[0];
    double k = isfinite((double)first) ? (double)first : 0.0;
    const __m512d kk = _mm512_set1_pd(k);
    const __m512 zero = _mm512_setzero_ps();
    __m512d s1lo = _mm512_setzero_pd(), s1hi = s1lo, s2lo = s1lo, s2hi = s1lo;
    __m512 vmn = _mm512_set1_ps(first), vmx = vmn;
    int32_t zeros = 0;
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        __m512 v = _mm512_loadu_ps(x + i);
        vmn = _mm512_min_ps(v, vmn); /* v < mn ? v : mn, NaN keeping mn: the loop's select */
        vmx = _mm512_max_ps(v, vmx);
        zeros += __builtin_popcount((unsigned)_mm512_cmpeq_ps_mask(v, zero));
        __m512d lo = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), kk);
        __m512d hi = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8)), kk);
        s1lo = _mm512_add_pd(s1lo, lo);
        s1hi = _mm512_add_pd(s1hi, hi);
        s2lo = _mm512_fmadd_pd(lo, lo, s2lo);
        s2hi = _mm512_fmadd_pd(hi, hi, s2hi);
    }
    double s1[LANES], s2[LANES];
    float mn[LANES], mx[LANES];
    int32_t z[LANES] = {0};
    _mm512_storeu_pd(s1, s1lo);
    _mm512_storeu_pd(s1 + 8, s1hi);
    _mm512_storeu_pd(s2, s2lo);
    _mm512_storeu_pd(s2 + 8, s2hi);
    _mm512_storeu_ps(mn, vmn);
    _mm512_storeu_ps(mx, vmx);
    z[0] = zeros; /* only the total is kept */
    CHUNK_FINISH(float, load_f32)
}
#else
#define HAVE_AVX512_F32 0
#endif

typedef void (*chunk_fn)(const void *restrict, Py_ssize_t, part_t *);
/* chunk_f32 becomes chunk_f32_avx512 at import where the CPU has AVX-512F (see stats_init). */
static chunk_fn CHUNK_FN[NCODES] = {chunk_f32, chunk_f64, chunk_f16, chunk_bf16};

/* Chan et al.'s pairwise update: merging (n, mean, M2) of two sets needs no
 * sums that can cancel. NaN/Inf in a part propagate (and are dealt with later). */
static void merge(acc_t *acc, const part_t *part, Py_ssize_t count) {
    double nc = (double)count;
    double mean = part->k + part->s1 / nc;
    double m2 = part->s2 - part->s1 * (part->s1 / nc);
    if (m2 < 0) m2 = 0; /* rounding; NaN stays NaN */
    if (acc->n == 0) {
        acc->n = nc;
        acc->mean = mean;
        acc->m2 = m2;
        acc->mn = part->mn;
        acc->mx = part->mx;
        acc->zeros = part->zeros;
        return;
    }
    double n = acc->n + nc;
    double delta = mean - acc->mean;
    acc->mean += delta * (nc / n);
    acc->m2 += m2 + delta * delta * (acc->n * (nc / n));
    acc->n = n;
    if (part->mn < acc->mn) acc->mn = part->mn;
    if (part->mx > acc->mx) acc->mx = part->mx;
    acc->zeros += part->zeros;
}

/* An n-dimensional walk over the innermost runs of a strided layout. */
typedef struct {
    int ndim; /* outer dims (all but the innermost) */
    Py_ssize_t size[MAXDIM], stride[MAXDIM]; /* bytes */
    Py_ssize_t idx[MAXDIM];
    const char *base;
    Py_ssize_t inner_len, inner_stride; /* elements, bytes */
    Py_ssize_t runs; /* total number of runs */
} walk_t;

/* The run after `cur` (odometer on the outer dims). */
static inline const char *next_run(walk_t *w, const char *cur) {
    for (int d = w->ndim - 1; d >= 0; d--) {
        if (++w->idx[d] < w->size[d]) return cur + w->stride[d];
        w->idx[d] = 0;
        cur -= w->stride[d] * (w->size[d] - 1);
    }
    return cur;
}

typedef struct {
    int code, item;
    chunk_fn fn;
    acc_t acc;
    char buf[CHUNK * 8];
    Py_ssize_t used; /* elements in buf */
} state_t;

static void flush(state_t *st) {
    if (st->used) {
        part_t part;
        st->fn(st->buf, st->used, &part);
        merge(&st->acc, &part, st->used);
        st->used = 0;
    }
}

/* Feed one run of len elements, stride bytes apart, into the statistics. */
static void feed(state_t *st, const char *p, Py_ssize_t len, Py_ssize_t stride) {
    const int item = st->item;
    if (stride == item && len >= DIRECT_MIN) {
        flush(st);
        for (Py_ssize_t i = 0; i < len; i += CHUNK) {
            Py_ssize_t m = len - i < CHUNK ? len - i : CHUNK;
            part_t part;
            st->fn(p + i * item, m, &part);
            merge(&st->acc, &part, m);
        }
        return;
    }
    while (len > 0) {
        Py_ssize_t m = CHUNK - st->used;
        if (m > len) m = len;
        char *dst = st->buf + st->used * item;
        if (stride == item) {
            memcpy(dst, p, (size_t)(m * item));
        } else if (item == 4) {
            for (Py_ssize_t i = 0; i < m; i++) memcpy(dst + 4 * i, p + i * stride, 4);
        } else if (item == 8) {
            for (Py_ssize_t i = 0; i < m; i++) memcpy(dst + 8 * i, p + i * stride, 8);
        } else {
            for (Py_ssize_t i = 0; i < m; i++) memcpy(dst + 2 * i, p + i * stride, 2);
        }
        st->used += m;
        p += m * stride;
        len -= m;
        if (st->used == CHUNK) flush(st);
    }
}

static double value_at(int code, const char *p) {
    switch (code) {
    case F32: return load_f32(p, 0);
    case F64: return load_f64(p, 0);
    case F16: return load_f16(p, 0);
    default: return load_bf16(p, 0);
    }
}

typedef struct {
    double nan, posinf, neginf, finite_absmax;
} counts_t;

/* The slow second pass, only for data whose sums came out non-finite. */
static void count_nonfinite(walk_t *w, int code, counts_t *c) {
    memset(c, 0, sizeof *c);
    const char *run = w->base;
    for (Py_ssize_t r = 0; r < w->runs; r++) {
        const char *p = run;
        for (Py_ssize_t i = 0; i < w->inner_len; i++, p += w->inner_stride) {
            double v = value_at(code, p);
            if (isnan(v)) c->nan++;
            else if (isinf(v)) *(v > 0 ? &c->posinf : &c->neginf) += 1;
            else if (fabs(v) > c->finite_absmax) c->finite_absmax = fabs(v);
        }
        run = next_run(w, run);
    }
}

/* The pass (and, for non-finite sums, the counting pass); no Python calls. */
static int one_pass(state_t *st, walk_t *w, int code, counts_t *c) {
    st->code = code;
    st->item = ITEMSIZE[code];
    st->fn = CHUNK_FN[code];
    memset(&st->acc, 0, sizeof st->acc);
    st->used = 0;
    const char *run = w->base;
    for (Py_ssize_t r = 0; r < w->runs; r++) {
        feed(st, run, w->inner_len, w->inner_stride);
        run = next_run(w, run);
    }
    flush(st);
    int nonfinite = !(isfinite(st->acc.mean) && isfinite(st->acc.m2));
    if (nonfinite) {
        for (int d = 0; d < w->ndim; d++) w->idx[d] = 0;
        count_nonfinite(w, code, c);
    }
    return nonfinite;
}

/* -- Stats: what stats() returns ------------------------------------------------------------
 * The nine values in one object: a read-only sequence of floats (len, indexing, iteration,
 * ==), as a tuple of them would be, but one allocation instead of ten. A log keeps one per
 * record until it is read, and inside a model ten small objects per record measured about
 * 2.5 us more than none (bench/bench_record_path.py). It pickles and copies as a plain tuple,
 * so nothing saved ever needs this extension to load. */
enum { NSTATS = 9 };

typedef struct {
    PyObject_HEAD
    double v[NSTATS];
} Stats;

static PyTypeObject StatsType;

static Py_ssize_t stats_len(PyObject *self) {
    (void)self;
    return NSTATS;
}

static PyObject *stats_item(PyObject *self, Py_ssize_t i) {
    if (i < 0 || i >= NSTATS) {
        PyErr_SetString(PyExc_IndexError, "Stats index out of range");
        return NULL;
    }
    return PyFloat_FromDouble(((Stats *)self)->v[i]);
}

static PyObject *stats_tuple(PyObject *self) {
    PyObject *t = PyTuple_New(NSTATS);
    for (Py_ssize_t i = 0; t && i < NSTATS; i++) {
        PyObject *f = PyFloat_FromDouble(((Stats *)self)->v[i]);
        if (!f) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, f);
    }
    return t;
}

static PyObject *stats_subscript(PyObject *self, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        return stats_item(self, i < 0 ? i + NSTATS : i);
    }
    PyObject *t = stats_tuple(self); /* slices: as the tuple's */
    if (!t) return NULL;
    PyObject *r = PyObject_GetItem(t, key);
    Py_DECREF(t);
    return r;
}

/* == and != against another Stats or any tuple, as tuples of the same floats compare. */
static PyObject *stats_richcompare(PyObject *self, PyObject *other, int op) {
    if ((op != Py_EQ && op != Py_NE) || !(PyTuple_Check(other) || Py_IS_TYPE(other, &StatsType)))
        Py_RETURN_NOTIMPLEMENTED;
    if (self == other) return PyBool_FromLong(op == Py_EQ);
    PyObject *a = stats_tuple(self);
    PyObject *b = Py_IS_TYPE(other, &StatsType) ? stats_tuple(other) : Py_NewRef(other);
    PyObject *r = a && b ? PyObject_RichCompare(a, b, op) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

static PyObject *stats_repr(PyObject *self) {
    PyObject *t = stats_tuple(self);
    if (!t) return NULL;
    PyObject *r = PyUnicode_FromFormat("Stats%R", t);
    Py_DECREF(t);
    return r;
}

static PyObject *stats_reduce(PyObject *self, PyObject *unused) {
    (void)unused;
    PyObject *t = stats_tuple(self);
    return t ? Py_BuildValue("(O(N))", (PyObject *)&PyTuple_Type, t) : NULL;
}

static PySequenceMethods stats_as_sequence = {.sq_length = stats_len, .sq_item = stats_item};
static PyMappingMethods stats_as_mapping = {.mp_length = stats_len, .mp_subscript = stats_subscript};
static PyMethodDef stats_methods[] = {
    {"__reduce__", stats_reduce, METH_NOARGS, "Pickled and copied as a tuple of the nine floats."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StatsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "picklehooks._speedups.Stats",
    .tp_doc = "The nine statistics of one tensor, in STAT_NAMES order: a read-only sequence of floats.",
    .tp_basicsize = sizeof(Stats),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_SEQUENCE,
    .tp_as_sequence = &stats_as_sequence,
    .tp_as_mapping = &stats_as_mapping,
    .tp_richcompare = stats_richcompare,
    .tp_repr = stats_repr,
    .tp_methods = stats_methods,
    .tp_hash = PyObject_HashNotImplemented,
};

/* Bounds of float64 data handled here (see the header comment). */
static const double F64_LARGEST = 0x1p450, F64_SMALLEST = 0x1p-400;

static int ssize_item(PyObject *tuple, Py_ssize_t i, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, i));
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

PyObject *stats_of_memory(PyObject *ptr_obj, PyObject *code_obj, PyObject *sizes, PyObject *strides) {
    uintptr_t ptr = (uintptr_t)PyLong_AsVoidPtr(ptr_obj);
    if (PyErr_Occurred()) return NULL;
    long code = PyLong_AsLong(code_obj);
    if (code == -1 && PyErr_Occurred()) return NULL;
    if (code < 0 || code >= NCODES || !PyTuple_Check(sizes) || !PyTuple_Check(strides) ||
        PyTuple_GET_SIZE(sizes) != PyTuple_GET_SIZE(strides)) {
        PyErr_SetString(PyExc_ValueError, "stats: bad dtype code, or sizes and strides are not tuples of one length");
        return NULL;
    }
    const int item = ITEMSIZE[code];
    Py_ssize_t ndim = PyTuple_GET_SIZE(sizes);
    /* No live allocation sits in the first page; torch reports such addresses
     * for storage that was freed (resized to 0) under a view, and for
     * efficient zero tensors (nullptr). */
    if (ptr < 4096 || ptr % (uintptr_t)item || ndim > MAXDIM) Py_RETURN_NONE;

    /* Canonical layout: size-1 dims dropped, stride-0 dims turned into a
     * repeat factor (the same elements again: counts and M2 scale, the rest
     * doesn't), negative strides flipped (order doesn't matter to any
     * statistic), dims sorted by stride and merged where contiguous. */
    Py_ssize_t size[MAXDIM], stride[MAXDIM];
    int nd = 0;
    double repeat = 1;
    const char *base = (const char *)ptr;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        Py_ssize_t n, s;
        if (ssize_item(sizes, i, &n) || ssize_item(strides, i, &s)) return NULL;
        if (n < 0) {
            PyErr_SetString(PyExc_ValueError, "stats: negative size");
            return NULL;
        }
        if (n == 0) Py_RETURN_NONE; /* empty: NaN statistics, the caller's business */
        if (n == 1) continue;
        if (s == 0) {
            repeat *= (double)n;
            continue;
        }
        if (s < 0) {
            base += (n - 1) * s * item;
            s = -s;
        }
        size[nd] = n;
        stride[nd] = s;
        nd++;
    }
    for (int i = 1; i < nd; i++) { /* insertion sort, largest stride first */
        Py_ssize_t n = size[i], s = stride[i];
        int j = i - 1;
        for (; j >= 0 && stride[j] < s; j--) {
            size[j + 1] = size[j];
            stride[j + 1] = stride[j];
        }
        size[j + 1] = n;
        stride[j + 1] = s;
    }
    int merged = 0;
    for (int i = 0; i < nd; i++) {
        if (merged && stride[merged - 1] == stride[i] * size[i]) {
            size[merged - 1] *= size[i];
            stride[merged - 1] = stride[i];
        } else {
            size[merged] = size[i];
            stride[merged] = stride[i];
            merged++;
        }
    }
    nd = merged;

    walk_t w;
    w.base = base;
    if (nd == 0) {
        w.inner_len = 1;
        w.inner_stride = item;
    } else {
        w.inner_len = size[nd - 1];
        w.inner_stride = stride[nd - 1] * item;
    }
    w.ndim = nd > 0 ? nd - 1 : 0;
    w.runs = 1;
    for (int d = 0; d < w.ndim; d++) {
        w.size[d] = size[d];
        w.stride[d] = stride[d] * item;
        w.idx[d] = 0;
        w.runs *= size[d];
    }
    double numel = (double)w.runs * (double)w.inner_len;

    state_t st; /* its chunk buffer is 32 KiB: fine on any thread's stack */
    counts_t c = {0, 0, 0, 0};
    int nonfinite;
    if (numel < NOGIL_MIN) {
        nonfinite = one_pass(&st, &w, (int)code, &c);
    } else {
        Py_BEGIN_ALLOW_THREADS;
        nonfinite = one_pass(&st, &w, (int)code, &c);
        Py_END_ALLOW_THREADS;
    }
    acc_t a = st.acc;

    double n = a.n; /* == numel */
    double mean = a.mean, m2 = a.m2, mn = a.mn, mx = a.mx;
    double absmax = fabs(mn) > fabs(mx) ? fabs(mn) : fabs(mx); /* NaN here is replaced below */
    double std, norm, nan = 0, inf = 0;
    if (nonfinite) {
        nan = c.nan;
        inf = c.posinf + c.neginf;
        if (code == F64 && c.finite_absmax > F64_LARGEST) Py_RETURN_NONE;
        if (nan > 0) {
            mean = std = mn = mx = absmax = norm = NAN;
        } else if (inf > 0) {
            mean = c.posinf > 0 && c.neginf > 0 ? NAN : (c.posinf > 0 ? INFINITY : -INFINITY);
            std = NAN;
            norm = INFINITY;
        } else {
            Py_RETURN_NONE; /* finite data whose sums overflowed: can't be float32/16 */
        }
    } else {
        if (code == F64 && (absmax > F64_LARGEST || (absmax > 0 && absmax < F64_SMALLEST))) Py_RETURN_NONE;
        std = sqrt(m2 / n);
        norm = sqrt(repeat * (m2 + n * (mean * mean)));
    }
    Stats *result = PyObject_New(Stats, &StatsType);
    if (!result) return NULL;
    double vals[NSTATS] = {mean, std, mn, mx, absmax, norm, nan * repeat, inf * repeat, (double)a.zeros / n};
    memcpy(result->v, vals, sizeof vals);
    return (PyObject *)result;
}

static PyObject *stats_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "stats(ptr, dtype_code, sizes, strides) takes 4 arguments");
        return NULL;
    }
    return stats_of_memory(args[0], args[1], args[2], args[3]);
}

static PyMethodDef stats_functions[] = {
    {"stats", (PyCFunction)(void (*)(void))stats_py, METH_FASTCALL,
     "stats($module, ptr, dtype_code, sizes, strides, /)\n--\n\n"
     "Stats (9 floats in STAT_NAMES order), or None.\n\n"
     "Reads the memory at ptr (strides in elements); the caller guarantees it is readable.\n"
     "None: not handled here (empty, float64 beyond [2**-400, 2**450], odd pointer)."},
    {NULL, NULL, 0, NULL},
};

int stats_init(PyObject *m) {
    if (PyType_Ready(&StatsType) < 0 || PyModule_AddFunctions(m, stats_functions) < 0) return -1;
    Py_INCREF(&StatsType);
    if (PyModule_AddObject(m, "Stats", (PyObject *)&StatsType) < 0) {
        Py_DECREF(&StatsType);
        return -1;
    }
    PyObject *codes = Py_BuildValue("{s:i,s:i,s:i,s:i}", "float32", F32, "float64", F64, "float16", F16,
                                    "bfloat16", BF16);
    if (!codes || PyModule_AddObject(m, "DTYPE_CODES", codes) < 0) {
        Py_XDECREF(codes);
        return -1;
    }
    /* Which loop runs here: the clone GCC's resolver picks, or the one build. */
    const char *isa = "portable";
#if HAVE_CLONES
    __builtin_cpu_init();
    isa = __builtin_cpu_supports("x86-64-v4") ? "x86-64-v4" : __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3" : "x86-64";
#endif
    /* And for float32: the lane loop above, or its AVX-512 spelling. */
    const char *f32_loop = "lanes";
#if HAVE_AVX512_F32
    __builtin_cpu_init();
    const char *forced = getenv("PICKLEHOOKS_F32_LOOP");
    if (__builtin_cpu_supports("avx512f") && !(forced && strcmp(forced, "lanes") == 0)) {
        CHUNK_FN[F32] = chunk_f32_avx512;
        f32_loop = "avx512";
    }
#endif
    if (PyModule_AddIntConstant(m, "CHUNK", CHUNK) < 0 || PyModule_AddStringConstant(m, "ISA", isa) < 0 ||
        PyModule_AddStringConstant(m, "F32_LOOP", f32_loop) < 0)
        return -1;
    return 0;
}
