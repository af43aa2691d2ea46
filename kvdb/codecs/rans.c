/* Tier K's entropy coder: rANS over rows of int16 values, each row coded with its class's static table.
 *
 * docs/formats.md ("Entropy-coded symbol rows (rANS)", version 1) is the specification; this file
 * and kvdb/codecs/rans.py implement it, and tests/kernels/test_rans.py holds a pure-Python decoder
 * written from the document alone. Python owns every buffer (values, tables, the stream, the
 * outputs) and passes pointers through ctypes; nothing here allocates.
 *
 * Two states alternate symbol by symbol, so a decoder has two independent dependency chains
 * in flight (a table lookup and a multiply each): that, not SIMD, is where the speed comes from.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define PREC 12
#define TOTAL (1u << PREC)
#define MASK (TOTAL - 1u)
#define ESCAPE 255
#define OFFSET 127
#define LOWER (1u << 16)        /* L: states live in [L, 2**32) between symbols */
#define BYTE_FREQ (TOTAL / 256) /* an escaped value's two bytes are uniform symbols */

static inline uint32_t get_u32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static inline void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ---------------------------------------------------------------------------------------- */
/* encoding: symbols last to first, words written downwards from the end of `out`            */
/* ---------------------------------------------------------------------------------------- */

typedef struct {
    uint32_t x[2];
    uint8_t *word;        /* the last word written; the next goes just below it */
    const uint8_t *floor; /* words may not go below: the 8 bytes of the states */
    int64_t index;        /* the position in the symbol sequence of the symbol just put */
} Encoder;

/* Puts the symbol before `e->index` into its state; -1 when `out` is full. A state at or above
 * freq << 20 would leave [L, 2**32) once the symbol is in, so it first sheds its low word (once
 * is enough: after it the state is below 2**16 <= freq << 20). */
static inline int put(Encoder *e, uint32_t start, uint32_t freq) {
    uint32_t *x = &e->x[--e->index & 1];
    if ((uint64_t)*x >= (uint64_t)freq << (32 - PREC)) {
        if (e->word - e->floor < 2) return -1;
        e->word -= 2;
        e->word[0] = (uint8_t)*x;
        e->word[1] = (uint8_t)(*x >> 8);
        *x >>= 16;
    }
    *x = ((*x / freq) << PREC) + *x % freq + start;
    return 0;
}

/* The symbol a value codes as: its own where it has one with a non-zero frequency, else ESCAPE
 * (then the value follows as two bytes), so any int16 codes with any table whose ESCAPE is >= 1. */
static inline uint32_t symbol_of(int32_t v, const uint16_t *freqs) { return v < -OFFSET || v > OFFSET || !freqs[v + OFFSET] ? ESCAPE : (uint32_t)(v + OFFSET); }

int64_t kvdb_rans_encode(const int16_t *values, int64_t rows, int64_t n, const int32_t *classes, const uint16_t *freqs, const uint16_t *starts, uint8_t *out,
                         int64_t capacity) {
    if (capacity < 8) return -1;
    int64_t symbols = 0; /* the length of the symbol sequence: its parity picks the last symbol's state */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < n; t++) symbols += symbol_of(values[r * n + t], freqs + (int64_t)classes[r] * 256) == ESCAPE ? 3 : 1;
    Encoder e = {{LOWER, LOWER}, out + capacity, out + 8, symbols};
    for (int64_t r = rows - 1; r >= 0; r--) {
        const uint16_t *f = freqs + (int64_t)classes[r] * 256, *s = starts + (int64_t)classes[r] * 256;
        for (int64_t t = n - 1; t >= 0; t--) {
            int32_t v = values[r * n + t];
            uint32_t sym = symbol_of(v, f);
            if (sym == ESCAPE) {
                if (f[ESCAPE] == 0) return -2;
                uint32_t u = (uint32_t)(v + 32768);
                if (put(&e, (u >> 8) * BYTE_FREQ, BYTE_FREQ) || put(&e, (u & 0xFF) * BYTE_FREQ, BYTE_FREQ)) return -1;
            }
            if (put(&e, s[sym], f[sym])) return -1;
        }
    }
    int64_t words = out + capacity - e.word;
    put_u32(out, e.x[0]);
    put_u32(out + 4, e.x[1]);
    memmove(out + 8, e.word, (size_t)words);
    return 8 + words;
}

/* ---------------------------------------------------------------------------------------- */
/* decoding: x0 always holds the state of the next symbol; the two swap after each symbol     */
/* ---------------------------------------------------------------------------------------- */

typedef struct {
    uint32_t x0, x1;
    const uint8_t *word, *end;
    int bad; /* read past the end, or an escape of a value that has a symbol: decoding goes on, reading nothing */
} Decoder;

/* Brings a state back into [L, 2**32) with the next word, and makes it wait its turn. Past the
 * end of the stream it reads nothing and marks the stream bad, so garbage never reads out of
 * bounds and the loop needs no exit of its own. */
static inline void refill(Decoder *d, uint32_t x) {
    if (x < LOWER) {
        if (d->word < d->end) {
            x = x << 16 | (uint32_t)d->word[0] | (uint32_t)d->word[1] << 8;
            d->word += 2;
        } else {
            d->bad = 1;
        }
    }
    d->x0 = d->x1;
    d->x1 = x;
}

static inline uint32_t uniform_byte(Decoder *d) {
    uint32_t x = d->x0, slot = x & MASK;
    refill(d, BYTE_FREQ * (x >> PREC) + (slot & (BYTE_FREQ - 1)));
    return slot / BYTE_FREQ;
}

/* The next value; its symbol (ESCAPE for an escaped value) in *symbol. */
static inline int32_t next_value(Decoder *d, const uint8_t *slots, const uint16_t *freqs, const uint16_t *starts, uint32_t *symbol) {
    uint32_t x = d->x0, slot = x & MASK, sym = slots[slot];
    refill(d, freqs[sym] * (x >> PREC) + slot - starts[sym]);
    *symbol = sym;
    if (__builtin_expect(sym != ESCAPE, 1)) return (int32_t)sym - OFFSET;
    uint32_t low = uniform_byte(d);
    int32_t v = (int32_t)(low | uniform_byte(d) << 8) - 32768;
    d->bad |= symbol_of(v, freqs) != ESCAPE; /* one value, one coding */
    return v;
}

/* The one decoding loop. Always inlined, so each combination of outputs that
 * kvdb_rans_decode passes as constants compiles to a loop without the other's stores. */
static inline __attribute__((always_inline)) int decode_rows(Decoder *d, int64_t rows, int64_t n, int64_t used, const int32_t *classes, const uint16_t *freqs,
                                                             const uint16_t *starts, const uint8_t *slots, int16_t *values_out, const float *recon,
                                                             float escape_step, float *floats_out, int64_t row_stride) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t c = classes[r], o = r * row_stride, t = 0;
        const uint8_t *sl = slots + c * TOTAL;
        const uint16_t *f = freqs + c * 256, *s = starts + c * 256;
        uint32_t sym;
        for (; t < used; t++) {
            int32_t v = next_value(d, sl, f, s, &sym);
            if (values_out) values_out[o + t] = (int16_t)v;
            if (floats_out) floats_out[o + t] = sym == ESCAPE ? (float)v * escape_step : recon[c * 256 + sym];
        }
        for (; t < n; t++) next_value(d, sl, f, s, &sym);
    }
    return d->bad || d->x0 != LOWER || d->x1 != LOWER || d->word != d->end ? -1 : 0;
}

int kvdb_rans_decode(const uint8_t *data, int64_t size, int64_t rows, int64_t n, int64_t used, const int32_t *classes, const uint16_t *freqs,
                     const uint16_t *starts, const uint8_t *slots, int16_t *values_out, const float *recon, float escape_step, float *floats_out,
                     int64_t row_stride) {
    if (size < 8 || (size - 8) % 2) return -1;
    Decoder d = {get_u32(data), get_u32(data + 4), data + 8, data + size, 0};
    if (d.x0 < LOWER || d.x1 < LOWER) return -1;
    if (values_out && floats_out)
        return decode_rows(&d, rows, n, used, classes, freqs, starts, slots, values_out, recon, escape_step, floats_out, row_stride);
    if (values_out) return decode_rows(&d, rows, n, used, classes, freqs, starts, slots, values_out, NULL, 0.0f, NULL, row_stride);
    if (floats_out) return decode_rows(&d, rows, n, used, classes, freqs, starts, slots, NULL, recon, escape_step, floats_out, row_stride);
    return decode_rows(&d, rows, n, used, classes, freqs, starts, slots, NULL, NULL, 0.0f, NULL, row_stride);
}

static struct PyModuleDef rans_module = {PyModuleDef_HEAD_INIT, .m_name = "_rans", .m_doc = "tier K's rANS coder (see rans.c)", .m_size = -1};

PyMODINIT_FUNC PyInit__rans(void) { return PyModule_Create(&rans_module); }
