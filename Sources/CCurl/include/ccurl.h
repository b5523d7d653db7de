#ifndef STOREFS_CCURL_H
#define STOREFS_CCURL_H
/* curl_easy_setopt / curl_easy_getinfo are variadic, which Swift cannot call:
 * these typed wrappers are the whole reason this module exists. */
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
/* CURL_GLOBAL_DEFAULT is a macro of macros; give Swift a plain value. */
static inline long ccurl_global_default(void) { return CURL_GLOBAL_DEFAULT; }
#endif
