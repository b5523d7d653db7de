#include "czlib.h"

#include <stdlib.h>
#include <zlib.h>

struct czlib_stream {
    z_stream z;
    int deflating;
};

czlib_stream *czlib_inflate_new(void) {
    czlib_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    /* 15 + 16: a 32 KiB window, gzip wrapper only (a raw or zlib stream is an error). */
    if (inflateInit2(&s->z, 15 + 16) != Z_OK) {
        free(s);
        return NULL;
    }
    return s;
}

static int run(czlib_stream *s, const uint8_t *in, size_t in_len, size_t *consumed, uint8_t *out,
               size_t out_cap, size_t *produced, int flush) {
    /* zlib counts in uInt: hand it at most 1 GiB at a time. */
    uInt in_now = in_len > (1u << 30) ? (1u << 30) : (uInt)in_len;
    uInt out_now = out_cap > (1u << 30) ? (1u << 30) : (uInt)out_cap;
    s->z.next_in = (Bytef *)in;
    s->z.avail_in = in_now;
    s->z.next_out = out;
    s->z.avail_out = out_now;
    int rc = s->deflating ? deflate(&s->z, flush) : inflate(&s->z, Z_NO_FLUSH);
    *consumed = in_now - s->z.avail_in;
    *produced = out_now - s->z.avail_out;
    switch (rc) {
    case Z_STREAM_END: return CZLIB_END;
    case Z_OK: return CZLIB_OK;
    case Z_BUF_ERROR: return CZLIB_OK; /* no progress possible now: the caller gives more */
    default: return CZLIB_ERROR;
    }
}

int czlib_inflate(czlib_stream *s, const uint8_t *in, size_t in_len, size_t *consumed,
                  uint8_t *out, size_t out_cap, size_t *produced) {
    return run(s, in, in_len, consumed, out, out_cap, produced, Z_NO_FLUSH);
}

int czlib_inflate_reset(czlib_stream *s) { return inflateReset(&s->z) == Z_OK ? 0 : -1; }

czlib_stream *czlib_deflate_new(int level) {
    czlib_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->deflating = 1;
    if (deflateInit2(&s->z, level, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
        free(s);
        return NULL;
    }
    return s;
}

int czlib_deflate(czlib_stream *s, const uint8_t *in, size_t in_len, size_t *consumed,
                  uint8_t *out, size_t out_cap, size_t *produced, int finish) {
    return run(s, in, in_len, consumed, out, out_cap, produced, finish ? Z_FINISH : Z_NO_FLUSH);
}

const char *czlib_message(const czlib_stream *s) { return s && s->z.msg ? s->z.msg : ""; }

void czlib_free(czlib_stream *s) {
    if (!s) return;
    if (s->deflating) deflateEnd(&s->z); else inflateEnd(&s->z);
    free(s);
}
