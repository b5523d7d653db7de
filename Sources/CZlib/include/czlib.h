#ifndef STOREFS_CZLIB_H
#define STOREFS_CZLIB_H
/* gzip streams for manifests, from zlib (Debian zlib1g-dev). Why a shim: inflateInit2 and
 * deflateInit2 are macros, and z_stream is a struct Swift should not lay out; each stream here is
 * an opaque handle its Swift owner frees. */
#include <stddef.h>
#include <stdint.h>

typedef struct czlib_stream czlib_stream;

/* Status of czlib_inflate / czlib_deflate. */
enum {
    CZLIB_OK = 0,         /* progress made; call again with more input or output room */
    CZLIB_END = 1,        /* the end of a gzip member (inflate) or of the stream (deflate finish) */
    CZLIB_ERROR = -1,     /* the data is not gzip, or is damaged (czlib_message says why) */
};

/* A gzip decoder (inflate accepting only the gzip wrapper); NULL when out of memory. */
czlib_stream *czlib_inflate_new(void);
/* Decodes from in[0..in_len) into out[0..out_cap): *consumed and *produced say how much. */
int czlib_inflate(czlib_stream *s, const uint8_t *in, size_t in_len, size_t *consumed,
                  uint8_t *out, size_t out_cap, size_t *produced);
/* Starts a new gzip member (files made by `cat a.gz b.gz` hold several). 0 or -1. */
int czlib_inflate_reset(czlib_stream *s);

/* A gzip encoder at `level` (1..9); NULL when out of memory. */
czlib_stream *czlib_deflate_new(int level);
/* Encodes in[0..in_len) into out[0..out_cap); with finish != 0, ends the stream once all
 * input is taken (CZLIB_END when the trailer is out). */
int czlib_deflate(czlib_stream *s, const uint8_t *in, size_t in_len, size_t *consumed,
                  uint8_t *out, size_t out_cap, size_t *produced, int finish);

/* zlib's message for the last error, or "" (never NULL). */
const char *czlib_message(const czlib_stream *s);
/* Frees either kind of stream (NULL is fine). */
void czlib_free(czlib_stream *s);
#endif
