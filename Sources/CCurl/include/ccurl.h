#ifndef STOREFS_CCURL_H
#define STOREFS_CCURL_H
/* curl_easy_setopt / curl_easy_getinfo are variadic, which Swift cannot call: these typed
 * wrappers are the main reason this module exists. The rest (ccurl.c) is what needs OpenSSL's
 * or pthread's types, which Swift never sees: the trust store and the share handle. */
#include <curl/curl.h>

typedef size_t (*ccurl_data_cb)(char *ptr, size_t size, size_t nmemb, void *userdata);

static inline CURLcode ccurl_setopt_long(CURL *h, CURLoption o, long v) { return curl_easy_setopt(h, o, v); }
static inline CURLcode ccurl_setopt_str(CURL *h, CURLoption o, const char *v) { return curl_easy_setopt(h, o, v); }
static inline CURLcode ccurl_setopt_ptr(CURL *h, CURLoption o, void *v) { return curl_easy_setopt(h, o, v); }
static inline CURLcode ccurl_setopt_slist(CURL *h, CURLoption o, struct curl_slist *v) { return curl_easy_setopt(h, o, v); }
static inline CURLcode ccurl_setopt_writefn(CURL *h, ccurl_data_cb f) { return curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, f); }
static inline CURLcode ccurl_setopt_headerfn(CURL *h, ccurl_data_cb f) { return curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, f); }
typedef int (*ccurl_xferinfo_cb)(void *userdata, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal, curl_off_t ulnow);
static inline CURLcode ccurl_setopt_xferinfofn(CURL *h, ccurl_xferinfo_cb f) { return curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, f); }
static inline CURLcode ccurl_getinfo_long(CURL *h, CURLINFO i, long *v) { return curl_easy_getinfo(h, i, v); }
static inline CURLcode ccurl_getinfo_double(CURL *h, CURLINFO i, double *v) { return curl_easy_getinfo(h, i, v); }
static inline CURLcode ccurl_getinfo_str(CURL *h, CURLINFO i, char **v) { return curl_easy_getinfo(h, i, v); }
/* CURL_GLOBAL_DEFAULT is a macro of macros; give Swift a plain value. */
static inline long ccurl_global_default(void) { return CURL_GLOBAL_DEFAULT; }

/* ---- Trust store: one OpenSSL X509_STORE per process, shared by every connection. ----
 * OpenSSL 3 takes ~20 ms of CPU to parse the system bundle (139 certificates), and libcurl
 * 7.88 parses it again for every new connection of every easy handle (its CA cache is per
 * multi handle). storefs parses it once and hands the same store to each new TLS context.
 * (docs/architecture.md, "HTTPS"). */

/* Loads every certificate of a PEM file into a new store. On success returns the store and
 * sets *count; on failure returns NULL and writes a reason into err. */
void *ccurl_trust_load_file(const char *path, int *count, char *err, size_t errlen);
/* A store that looks certificates up in an OpenSSL hashed directory (c_rehash), lazily. */
void *ccurl_trust_load_directory(const char *path, char *err, size_t errlen);
void ccurl_trust_free(void *store);
/* Verification with exactly this store: curl loads no CA file of its own (CAINFO and CAPATH
 * unset), and each new TLS context gets the store. Peer and host verification stay on. */
CURLcode ccurl_setopt_trust(CURL *h, void *store);

/* ---- Share handle: TLS sessions (resumption on new connections) and DNS answers. ---- */
CURLSH *ccurl_share_new(void);
static inline CURLcode ccurl_setopt_share(CURL *h, CURLSH *s) { return curl_easy_setopt(h, CURLOPT_SHARE, s); }
#endif
