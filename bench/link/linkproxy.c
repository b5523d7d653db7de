/*
 * linkproxy: a model of a WAN link to a storage service, for the storefs benchmark. Not part
 * of storefs.
 *
 *     linkproxy --upstream PORT [--port N] [--setup-ms MS] [--ttfb-ms MS]
 *               [--conn-mibps R] [--total-mibps R] [--log FILE] [--no-splice] [--raw]
 *
 * Listens on 127.0.0.1:N (0, the default, picks a free port; "READY <port>" is printed on
 * stdout once it listens) and forwards every connection to 127.0.0.1:PORT, shaping what the
 * client sees the way a distant HTTP server would look:
 *   - setup:  a new connection moves no bytes for MS ms (TCP + TLS handshakes);
 *   - ttfb:   the first byte of every HTTP response is held until MS ms after the last byte of
 *             its request reached the proxy (round trip + server think time), on keep-alive
 *             connections too: the proxy follows HTTP/1.1 message framing in both directions;
 *   - conn-mibps / total-mibps: token buckets on the bytes sent to clients, per connection and
 *             over all connections (served round-robin when the shared bucket runs short).
 *   - raw:    no HTTP framing at all (TLS bytes, HTTP/2): setup and both caps still apply, per
 *             connection, but there is no TTFB (--raw refuses --ttfb-ms > 0). bench/run --tls
 *             puts one raw proxy in front of the TLS terminator (setup, caps) and a TTFB-only
 *             one behind it, where requests are HTTP/1.1 again.
 * Uploads (client -> server) are forwarded as fast as they come. README.md next to this file
 * says what is modelled, what is not, and how accurate it is.
 *
 * Design: one thread, edge-triggered epoll. A connection is two "halves" (requests: client ->
 * upstream; responses: upstream -> client). A half parses HTTP framing from a buffer and moves
 * the bulk of large bodies with splice(2) through a pipe, so body bytes never enter user space;
 * that keeps the proxy's own cost small next to the client's and the server's on a 2-core box.
 *
 * Built by bench/link/link.py with: cc -O2 -o linkproxy linkproxy.c   (Linux, libc only)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUF_SIZE (64 * 1024)    /* per half; also the largest HTTP head (or chunk line) parsed */
#define PIPE_SIZE (1024 * 1024) /* splice pipe capacity asked for (the default is 64 KiB) */
#define SPLICE_MIN (16 * 1024)  /* body bytes still to come below this are read, not spliced */
#define MAX_EVENTS 256
#define MIB 1048576.0
#define NS_PER_MS 1000000LL
#define UNTIL_CLOSE UINT64_MAX  /* body length of a response that ends when the server closes */

/* ------------------------------------------------------------------ configuration, totals */

static struct {
    int port, upstream_port;
    double setup_ms, ttfb_ms, conn_mibps, total_mibps;
    const char *log_path;
    bool splice;
    bool raw; /* --raw: every connection is forwarded unframed from its first byte */
} cfg = {.splice = true};

static int64_t setup_ns, ttfb_ns;
static int epfd, listen_fd, log_fd = -1;
static int64_t t0; /* monotonic time at start: log times are seconds since then */
static struct sockaddr_in upstream_addr;

static struct {
    unsigned long long opened, active, requests, responses, bytes_down, bytes_up;
} totals;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double since_start(int64_t t) { return (double)(t - t0) / 1e9; }

static void complain(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("linkproxy: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void die(const char *what) {
    complain("%s: %s", what, strerror(errno));
    exit(1);
}

/* ------------------------------------------------------------------------- token buckets */

/* Bytes may go to a client when its connection's bucket and the shared bucket both hold them.
 * Buckets fill continuously (rate x elapsed time, computed when looked at), so the cap is
 * exact over time; `capacity` bounds the burst after idling to ~2 ms worth, and a connection
 * that runs dry waits for `conn_min_send` bytes (~1 ms worth) rather than dribbling: sends come
 * in ~1 ms steps, smooth at any timescale a benchmark looks at.
 * A sender held back by the bucket may save up to `catch_up` (100 ms worth) instead: if the
 * proxy is scheduled late on a busy machine, the bytes it could have sent meanwhile still go,
 * and the cap stays exact on average instead of losing every late wake-up's tokens. */
struct bucket {
    double rate;     /* bytes per ns; 0 = no cap */
    double tokens;   /* bytes that may be sent now */
    double capacity; /* the most saved up while idle */
    double catch_up; /* the most saved up while held back */
    int64_t at;      /* when `tokens` was last brought up to date */
};

static void bucket_init(struct bucket *b, double mibps, double capacity, int64_t now) {
    b->rate = mibps * MIB / 1e9;
    b->capacity = capacity;
    b->catch_up = b->rate * 100 * NS_PER_MS;
    if (b->catch_up < capacity) b->catch_up = capacity;
    b->tokens = capacity;
    b->at = now;
}

static void bucket_refill(struct bucket *b, int64_t now, bool held_back) {
    if (now <= b->at) return;
    double cap = held_back ? b->catch_up : b->capacity;
    if (b->tokens < cap) {
        b->tokens += (double)(now - b->at) * b->rate;
        if (b->tokens > cap) b->tokens = cap;
    }
    b->at = now;
}

/* When the bucket will hold `need` bytes. */
static int64_t bucket_ready_at(const struct bucket *b, double need) {
    return b->at + (int64_t)((need - b->tokens) / b->rate) + 1;
}

static double clamp(double v, double lo, double hi) { return v < lo ? lo : v > hi ? hi : v; }

static double conn_min_send; /* bytes: 1 ms at --conn-mibps, at least 4 KiB */

/* ------------------------------------------------------------------------- data structures */

enum parse_state {
    ST_HEAD,       /* waiting for a complete request or status line + headers */
    ST_BODY,       /* `remaining` body bytes (or one chunk's data + CRLF) to pass through */
    ST_CHUNK_SIZE, /* waiting for a chunk-size line */
    ST_TRAILER,    /* after the last chunk: trailer lines up to a blank one */
    ST_DONE,       /* message complete; parsing waits until all of it has been forwarded */
    ST_RAW,        /* no framing any more (upgrade, or bytes that are not HTTP): pass everything */
};

/* One request and the response to it, as far as the log needs them. Usually the request half
 * hands it to the connection's queue once the request is in, and the response half takes it
 * from there. A response may start while its request is still arriving (100 Continue, an early
 * error): then both halves hold it, and whichever lets go last frees it. */
struct request {
    struct request *next;
    unsigned seq;
    bool is_head, is_connect;
    bool receiving; /* the request half still holds it (request not complete) */
    bool answering; /* the response half holds it (response started) */
    bool answered;  /* the final response has been forwarded and logged */
    int status;
    int64_t t_req, t_first, t_last; /* last request byte in; first, last response byte out */
    unsigned long long bytes, head_bytes;
    char method[16], path[384], range[96];
};

enum endpoint_kind { EP_LISTEN, EP_SIGNAL, EP_CLIENT, EP_UPSTREAM };

/* A socket as epoll sees it. With edge-triggered epoll the flags say "may have data / room":
 * set by events, cleared only when an operation would block. */
struct endpoint {
    enum endpoint_kind kind;
    int fd;
    bool readable, writable;
    struct conn *conn;
};

/* One direction of a connection. Bytes in the buffer: [0,sent) forwarded, [sent,parsed)
 * framed and ready to forward, [parsed,len) not parsed yet. The pipe holds body bytes spliced
 * from src; they are always later in the stream than the buffered ones (splicing in waits
 * until the buffer is empty) and go out first. */
struct half {
    struct conn *conn;
    struct endpoint *src, *dst;
    bool response; /* upstream -> client: the shaped direction */
    char *buf;
    size_t sent, parsed, len;
    int pipe_r, pipe_w; /* -1 until the first body large enough to splice */
    size_t piped, pipe_cap;
    bool no_splice;
    enum parse_state state;
    uint64_t remaining; /* ST_BODY */
    bool chunked;       /* ST_BODY is one chunk: back to ST_CHUNK_SIZE after it */
    bool interim;       /* response: a 1xx before the final response */
    bool upgrade;       /* response: 101 or CONNECT 2xx: both halves go raw after it */
    bool src_eof, dst_shut;
    int64_t release_at; /* response: nothing goes out before (the TTFB hold) */
    struct request *msg; /* being received (request half) or answered (response half) */
};

struct conn {
    unsigned id, next_seq, requests;
    bool connecting, dead;
    struct endpoint client, upstream;
    struct half up, down;
    int64_t ready_at; /* end of the setup delay */
    struct request *queue_head, *queue_tail; /* requests in, response not started */
    struct bucket bucket;
    bool held_back; /* waiting for its own bucket: see struct bucket */
    unsigned long long bytes_down, bytes_up;
    /* timer list: pumped again at wake_at (setup end, TTFB release, tokens) */
    bool timed;
    int64_t wake_at;
    struct conn *timer_prev, *timer_next, *due_next;
    /* queue for the shared bucket */
    bool gqueued;
    struct conn *gq_prev, *gq_next;
    struct conn *dead_next; /* freed after the current batch of events */
};

static void pump(struct conn *c);

/* ------------------------------------------------------------------------------- timers */

static struct conn *timer_head;

static void timer_arm(struct conn *c, int64_t at) {
    if (c->timed) {
        if (at < c->wake_at) c->wake_at = at;
        return;
    }
    c->timed = true;
    c->wake_at = at;
    c->timer_prev = NULL;
    c->timer_next = timer_head;
    if (timer_head) timer_head->timer_prev = c;
    timer_head = c;
}

static void timer_cancel(struct conn *c) {
    if (!c->timed) return;
    if (c->timer_prev) c->timer_prev->timer_next = c->timer_next;
    else timer_head = c->timer_next;
    if (c->timer_next) c->timer_next->timer_prev = c->timer_prev;
    c->timed = false;
}

/* Pumps every connection whose time has come. Collected first: pumping re-arms timers. */
static void run_timers(int64_t now) {
    struct conn *due = NULL;
    for (struct conn *c = timer_head, *next; c; c = next) {
        next = c->timer_next;
        if (c->wake_at > now) continue;
        timer_cancel(c);
        c->due_next = due;
        due = c;
    }
    while (due) {
        struct conn *c = due;
        due = c->due_next;
        pump(c);
    }
}

/* ------------------------------------------------------------- the shared (total) bucket */

/* Connections that ran out of shared tokens wait in a FIFO; when the bucket has refilled,
 * dispatch_shared() lets them send one quantum each in turn, so the total is split fairly
 * instead of going to whoever's socket event comes first. */
static struct bucket shared;
static double shared_quantum; /* most one connection sends per turn */
static double shared_wake;    /* tokens to collect before waking the queue */
static struct { struct conn *head, *tail; unsigned len; } shared_queue;
static struct conn *shared_turn; /* the connection dispatch_shared() is serving */

static void shared_enqueue(struct conn *c) {
    if (c->gqueued) return;
    c->gqueued = true;
    c->gq_next = NULL;
    c->gq_prev = shared_queue.tail;
    if (shared_queue.tail) shared_queue.tail->gq_next = c;
    else shared_queue.head = c;
    shared_queue.tail = c;
    shared_queue.len++;
}

static void shared_dequeue(struct conn *c) {
    if (!c->gqueued) return;
    if (c->gq_prev) c->gq_prev->gq_next = c->gq_next;
    else shared_queue.head = c->gq_next;
    if (c->gq_next) c->gq_next->gq_prev = c->gq_prev;
    else shared_queue.tail = c->gq_prev;
    c->gqueued = false;
    shared_queue.len--;
}

static void dispatch_shared(int64_t now) {
    if (!shared_queue.head) return;
    bucket_refill(&shared, now, true);
    if (shared.tokens < shared_wake) return;
    /* Each turn either spends tokens or drops the connection from the queue; the budget
     * only guards against a pathological ping-pong of tiny sends. */
    unsigned budget = 2 * shared_queue.len + 1;
    while (shared_queue.head && budget-- > 0 && shared.tokens >= shared_quantum) {
        struct conn *c = shared_queue.head;
        shared_dequeue(c);
        shared_turn = c;
        pump(c);
        shared_turn = NULL;
    }
}

/* How many of `want` bytes a connection may send to its client now; 0 = wait (the
 * connection has then been given a timer or a place in the shared queue). */
static size_t download_allowance(struct conn *c, size_t want, int64_t now) {
    double allow = (double)want;
    if (c->bucket.rate > 0) {
        struct bucket *b = &c->bucket;
        bucket_refill(b, now, c->held_back);
        double need = clamp((double)want, 1, conn_min_send);
        c->held_back = b->tokens < need;
        if (c->held_back) {
            timer_arm(c, bucket_ready_at(b, need));
            return 0;
        }
        if (b->tokens < allow) allow = b->tokens;
    }
    if (shared.rate > 0) {
        if (c->gqueued) return 0; /* waiting for its turn */
        if (shared_queue.head && shared_turn != c) {
            shared_enqueue(c); /* others were first */
            return 0;
        }
        bucket_refill(&shared, now, shared_queue.head != NULL);
        if (shared.tokens < clamp((double)want, 1, shared_quantum)) {
            shared_enqueue(c);
            return 0;
        }
        if (shared.tokens < allow) allow = shared.tokens;
        if (shared_quantum < allow) allow = shared_quantum;
    }
    return (size_t)allow;
}

static void charge_download(struct conn *c, size_t n) {
    if (c->bucket.rate > 0) c->bucket.tokens -= (double)n;
    if (shared.rate > 0) {
        shared.tokens -= (double)n;
        if (shared_queue.head) shared_enqueue(c); /* one quantum per turn while others wait */
    }
}

/* ------------------------------------------------------------------------------ logging */

/* A bounded string builder for log fields; output is cut, never overrun. */
struct text {
    char *p;
    size_t len, cap;
};

static void text_put(struct text *t, const char *s, size_t n) {
    while (n-- > 0 && t->len + 1 < t->cap) t->p[t->len++] = *s++;
    t->p[t->len] = '\0';
}

/* Log fields are space separated: bytes that could break a line or a field become %XX. */
static void text_put_escaped(struct text *t, const char *s, size_t n) {
    static const char hex[] = "0123456789ABCDEF";
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch <= ' ' || ch >= 0x7f || ch == '"' || ch == '\\') {
            char esc[3] = {'%', hex[ch >> 4], hex[ch & 15]};
            text_put(t, esc, 3);
        } else {
            text_put(t, s + i, 1);
        }
    }
}

/* Query parameters whose values are logged; every other value (token=, X-Goog-Signature=,
 * pageToken=, ...) is dropped, since a log must never hold a credential. */
static const char *const LOGGED_QUERY_KEYS[] = {
    "alt", "prefix", "delimiter", "maxResults", "projection", "fields", "generation",
    "versions", "startOffset", "endOffset", "includeTrailingDelimiter", "matchGlob",
    "uploadType", NULL};

static bool query_key_logged(const char *key, size_t n) {
    for (const char *const *k = LOGGED_QUERY_KEYS; *k; k++)
        if (strlen(*k) == n && memcmp(*k, key, n) == 0) return true;
    return false;
}

/* The request target for the log: the path, and the query with only allow-listed values. */
static void format_target(char *out, size_t cap, const char *s, size_t n) {
    struct text t = {out, 0, cap};
    out[0] = '\0';
    const char *q = memchr(s, '?', n);
    text_put_escaped(&t, s, q ? (size_t)(q - s) : n);
    if (!q) return;
    const char *end = s + n;
    char sep = '?';
    for (const char *p = q + 1; p < end;) {
        const char *amp = memchr(p, '&', (size_t)(end - p));
        const char *param_end = amp ? amp : end;
        const char *eq = memchr(p, '=', (size_t)(param_end - p));
        const char *key_end = eq ? eq : param_end;
        text_put(&t, &sep, 1);
        sep = '&';
        text_put_escaped(&t, p, (size_t)(key_end - p));
        if (eq && query_key_logged(p, (size_t)(key_end - p)))
            text_put_escaped(&t, eq, (size_t)(param_end - eq));
        p = param_end + 1;
    }
}

static void write_all(int fd, const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return; /* a log that cannot be written must not stop the link */
        s += w;
        n -= (size_t)w;
    }
}

/* One line, one write(2) on an O_APPEND file: a reader never sees half a line in the middle. */
static void log_line(const char *fmt, ...) {
    if (log_fd < 0) return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof line) {
        n = sizeof line - 1;
        line[n - 1] = '\n';
    }
    write_all(log_fd, line, (size_t)n);
}

static const char *time_field(char *buf, size_t cap, int64_t t) {
    if (t == 0) return "-";
    snprintf(buf, cap, "%.6f", since_start(t));
    return buf;
}

static void log_request(const struct conn *c, const struct request *r, bool done) {
    char treq[32], tfirst[32], tlast[32];
    unsigned long long body = r->bytes > r->head_bytes ? r->bytes - r->head_bytes : 0;
    log_line("req conn=%u seq=%u method=%s path=%s range=%s status=%d t_req=%s t_first=%s "
             "t_last=%s bytes=%llu body=%llu done=%d\n",
             c->id, r->seq, r->method, r->path, r->range[0] ? r->range : "-", r->status,
             time_field(treq, sizeof treq, r->t_req), time_field(tfirst, sizeof tfirst, r->t_first),
             time_field(tlast, sizeof tlast, r->t_last), r->bytes, body, done ? 1 : 0);
}

static void report_summary(const char *why) {
    char line[512];
    int n = snprintf(line, sizeof line,
                     "summary reason=%s t=%.6f connections=%llu active=%llu requests=%llu "
                     "responses=%llu bytes_down=%llu bytes_up=%llu\n",
                     why, since_start(now_ns()), totals.opened, totals.active, totals.requests,
                     totals.responses, totals.bytes_down, totals.bytes_up);
    write_all(2, line, (size_t)n);
    if (log_fd >= 0) write_all(log_fd, line, (size_t)n);
}

/* ------------------------------------------------------------------------- HTTP framing */

struct head_info {
    unsigned long long content_length;
    bool has_length, chunked, bad;
    const char *range;
    size_t range_len;
};

static bool name_is(const char *name, size_t n, const char *want) {
    return strlen(want) == n && strncasecmp(name, want, n) == 0;
}

static bool contains_token_ci(const char *s, size_t n, const char *token) {
    size_t tn = strlen(token);
    for (size_t i = 0; i + tn <= n; i++)
        if (strncasecmp(s + i, token, tn) == 0) return true;
    return false;
}

static bool parse_decimal(const char *s, size_t n, unsigned long long *out) {
    unsigned long long v = 0;
    if (n == 0) return false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9' || v > (UINT64_MAX - 9) / 10) return false;
        v = v * 10 + (unsigned)(s[i] - '0');
    }
    *out = v;
    return true;
}

/* Reads the headers that decide framing (and Range, for the log) from the lines in [p,end). */
static void scan_headers(const char *p, const char *end, struct head_info *hi) {
    memset(hi, 0, sizeof *hi);
    while (p < end) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol) break;
        const char *line_end = (eol > p && eol[-1] == '\r') ? eol - 1 : eol;
        const char *colon = memchr(p, ':', (size_t)(line_end - p));
        if (colon) {
            const char *v = colon + 1, *ve = line_end;
            while (v < ve && (*v == ' ' || *v == '\t')) v++;
            while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
            size_t name_len = (size_t)(colon - p), vn = (size_t)(ve - v);
            unsigned long long cl = 0;
            if (name_is(p, name_len, "content-length")) {
                if (!parse_decimal(v, vn, &cl) || (hi->has_length && cl != hi->content_length))
                    hi->bad = true;
                hi->content_length = cl;
                hi->has_length = true;
            } else if (name_is(p, name_len, "transfer-encoding")) {
                if (contains_token_ci(v, vn, "chunked")) hi->chunked = true;
            } else if (name_is(p, name_len, "range")) {
                hi->range = v;
                hi->range_len = vn;
            }
        }
        p = eol + 1;
    }
}

static void start_body(struct half *h, uint64_t n, bool chunked) {
    h->state = ST_BODY;
    h->remaining = n;
    h->chunked = chunked;
}

/* Parsing stops at ST_DONE until the message has been forwarded (see pump_half), so a
 * response's TTFB hold always starts with nothing earlier left to send. */
static void message_parsed(struct half *h, int64_t now) {
    struct conn *c = h->conn;
    h->state = ST_DONE;
    if (h->response || !h->msg) return;
    struct request *r = h->msg;
    h->msg = NULL;
    r->t_req = now; /* the request's last byte is in: its TTFB clock starts */
    r->receiving = false;
    c->requests++;
    totals.requests++;
    if (r->answered) {
        free(r);
    } else if (!r->answering) {
        r->next = NULL;
        if (c->queue_tail) c->queue_tail->next = r;
        else c->queue_head = r;
        c->queue_tail = r;
    }
}

static void go_raw(struct half *h) {
    h->state = ST_RAW;
    h->parsed = h->len;
}

static struct request *request_new(struct conn *c) {
    struct request *r = calloc(1, sizeof *r);
    if (!r) die("calloc");
    r->seq = ++c->next_seq;
    return r;
}

/* "METHOD target HTTP/1.x" + headers; false = not HTTP/1.x. */
static bool parse_request_head(struct half *h, const char *head, size_t n, int64_t now) {
    const char *end = head + n, *eol = memchr(head, '\n', n);
    const char *sp1 = memchr(head, ' ', (size_t)(eol - head));
    if (!sp1) return false;
    const char *sp2 = memchr(sp1 + 1, ' ', (size_t)(eol - sp1 - 1));
    if (!sp2 || eol - sp2 < 9 || memcmp(sp2 + 1, "HTTP/1.", 7) != 0) return false;
    struct head_info hi;
    scan_headers(eol + 1, end, &hi);
    if (hi.bad) return false;

    struct request *r = request_new(h->conn);
    r->receiving = true;
    struct text method = {r->method, 0, sizeof r->method};
    text_put_escaped(&method, head, (size_t)(sp1 - head));
    r->is_head = strcmp(r->method, "HEAD") == 0;
    r->is_connect = strcmp(r->method, "CONNECT") == 0;
    format_target(r->path, sizeof r->path, sp1 + 1, (size_t)(sp2 - sp1 - 1));
    struct text range = {r->range, 0, sizeof r->range};
    if (hi.range) text_put_escaped(&range, hi.range, hi.range_len);
    h->msg = r;

    if (hi.chunked) h->state = ST_CHUNK_SIZE;
    else if (hi.content_length > 0) start_body(h, hi.content_length, false);
    else message_parsed(h, now);
    return true;
}

/* The request a response answers: the oldest complete one; else the one still arriving (100
 * Continue, an early error); else (the request was not HTTP) a placeholder. */
static struct request *take_request(struct conn *c) {
    struct request *r = c->queue_head;
    if (r) {
        c->queue_head = r->next;
        if (!c->queue_head) c->queue_tail = NULL;
    } else if (c->up.msg) {
        r = c->up.msg;
    } else {
        r = request_new(c);
        strcpy(r->method, "-");
        strcpy(r->path, "-");
    }
    r->answering = true;
    return r;
}

/* "HTTP/1.x NNN ..." + headers; false = not HTTP/1.x. Body rules of RFC 9112 section 6.3. */
static bool parse_response_head(struct half *h, const char *head, size_t n, int64_t now) {
    const char *d = head + 9;
    if (n < 12 || memcmp(head, "HTTP/1.", 7) != 0 || head[8] != ' ' || d[0] < '1' || d[0] > '9' ||
        d[1] < '0' || d[1] > '9' || d[2] < '0' || d[2] > '9')
        return false;
    int status = (d[0] - '0') * 100 + (d[1] - '0') * 10 + (d[2] - '0');
    struct head_info hi;
    scan_headers((const char *)memchr(head, '\n', n) + 1, head + n, &hi);
    if (hi.bad) return false;

    if (!h->msg) h->msg = take_request(h->conn); /* else a 1xx came first: same request */
    struct request *r = h->msg;
    /* Every head (1xx or final) waits TTFB after the request's last byte, or after now when
     * the server answers before the request is complete. */
    h->release_at = (r->receiving || !r->t_req ? now : r->t_req) + ttfb_ns;
    r->head_bytes += n;
    if (status < 200 && status != 101) {
        h->interim = true;
        message_parsed(h, now);
        return true;
    }
    r->status = status;
    if (status == 101 || (r->is_connect && status / 100 == 2)) {
        h->upgrade = true;
        message_parsed(h, now);
    } else if (r->is_head || status == 204 || status == 304) {
        message_parsed(h, now);
    } else if (hi.chunked) {
        h->state = ST_CHUNK_SIZE;
    } else if (hi.has_length) {
        if (hi.content_length > 0) start_body(h, hi.content_length, false);
        else message_parsed(h, now);
    } else {
        start_body(h, UNTIL_CLOSE, false);
    }
    return true;
}

/* Returns false while the head is incomplete. Bytes that do not parse as HTTP/1.x switch the
 * half to raw forwarding: the link then stops modelling that connection but still works. */
static bool parse_head(struct half *h, int64_t now) {
    /* Blank lines before a message are allowed (RFC 9112 section 2.2); forwarded as they are. */
    while (h->parsed < h->len && (h->buf[h->parsed] == '\r' || h->buf[h->parsed] == '\n'))
        h->parsed++;
    if (h->parsed == h->len) return false;
    const char *start = h->buf + h->parsed;
    const char *end = memmem(start, h->len - h->parsed, "\r\n\r\n", 4);
    if (!end) return false;
    size_t n = (size_t)(end + 4 - start);
    bool ok = h->response ? parse_response_head(h, start, n, now)
                          : parse_request_head(h, start, n, now);
    h->parsed += n;
    if (!ok) {
        complain("connection %u: not HTTP/1.x, forwarding it unmodelled", h->conn->id);
        go_raw(h);
    }
    return true;
}

/* Index just past the next '\n' in the unparsed bytes, or 0 if the line is not complete. */
static size_t line_end(const struct half *h) {
    const char *nl = memchr(h->buf + h->parsed, '\n', h->len - h->parsed);
    return nl ? (size_t)(nl - h->buf) + 1 : 0;
}

static bool parse_chunk_size(struct half *h) {
    size_t e = line_end(h);
    if (!e) return false;
    uint64_t size = 0;
    size_t i = h->parsed, digits = 0;
    for (; i < e; i++, digits++) {
        char ch = h->buf[i];
        int v = ch >= '0' && ch <= '9' ? ch - '0'
              : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
              : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
        if (v < 0) break;
        if (size >> 59) { digits = 0; break; } /* absurd size: treat as garbage */
        size = size * 16 + (uint64_t)v;
    }
    h->parsed = e;
    if (digits == 0) go_raw(h);
    else if (size == 0) h->state = ST_TRAILER;
    else start_body(h, size + 2, true); /* the chunk's data and the CRLF after it */
    return true;
}

static bool parse_trailer_line(struct half *h, int64_t now) {
    size_t e = line_end(h);
    if (!e) return false;
    bool blank = e - h->parsed == 1 || (e - h->parsed == 2 && h->buf[h->parsed] == '\r');
    h->parsed = e;
    if (blank) message_parsed(h, now);
    return true;
}

/* Advances `parsed` over the buffered bytes as far as the framing is known. */
static void parse_buffered(struct half *h, int64_t now) {
    while (h->parsed < h->len) {
        switch (h->state) {
        case ST_HEAD:
            if (!parse_head(h, now)) return;
            break;
        case ST_BODY: {
            uint64_t take = h->len - h->parsed;
            if (h->remaining != UNTIL_CLOSE) {
                if (take > h->remaining) take = h->remaining;
                h->remaining -= take;
            }
            h->parsed += take;
            if (h->remaining == 0) {
                if (h->chunked) h->state = ST_CHUNK_SIZE;
                else message_parsed(h, now);
            }
            break;
        }
        case ST_CHUNK_SIZE:
            if (!parse_chunk_size(h)) return;
            break;
        case ST_TRAILER:
            if (!parse_trailer_line(h, now)) return;
            break;
        case ST_RAW:
            h->parsed = h->len;
            break;
        case ST_DONE:
            return;
        }
    }
}

/* Called once a message has been parsed and all its bytes forwarded. */
static void message_forwarded(struct half *h, int64_t now) {
    struct conn *c = h->conn;
    h->state = ST_HEAD;
    if (!h->response) return;
    if (h->interim) {
        h->interim = false; /* the final response to the same request follows */
        return;
    }
    /* catch-up tokens are for the response that was held back, not a burst for the next */
    if (c->bucket.tokens > c->bucket.capacity) c->bucket.tokens = c->bucket.capacity;
    c->held_back = false;
    if (h->msg) {
        struct request *r = h->msg;
        h->msg = NULL;
        r->t_last = now;
        log_request(c, r, true);
        r->answering = false;
        r->answered = true;
        if (!r->receiving) free(r);
        totals.responses++;
    }
    if (h->upgrade) {
        go_raw(h);
        go_raw(&c->up);
    }
}

/* ----------------------------------------------------------------------- moving bytes */

static bool all_sent(const struct half *h) { return h->piped == 0 && h->sent == h->parsed; }

static void account_output(struct half *h, size_t n, int64_t now) {
    struct conn *c = h->conn;
    if (!h->response) {
        c->bytes_up += n;
        totals.bytes_up += n;
        return;
    }
    c->bytes_down += n;
    totals.bytes_down += n;
    charge_download(c, n);
    if (h->msg) {
        if (!h->msg->t_first && !h->interim) h->msg->t_first = now; /* the final response's */
        h->msg->bytes += n;
    }
}

/* Sends pipe bytes, else buffered framed bytes, within the hold and the caps.
 * Returns bytes sent, 0 if nothing could go, -1 on a connection error. */
static ssize_t flush_output(struct half *h, int64_t now) {
    if (all_sent(h) || !h->dst->writable) return 0;
    if (h->response && now < h->release_at) {
        timer_arm(h->conn, h->release_at);
        return 0;
    }
    size_t want = h->piped ? h->piped : h->parsed - h->sent;
    size_t allow = h->response ? download_allowance(h->conn, want, now) : want;
    if (allow == 0) return 0;
    ssize_t n = h->piped
        ? splice(h->pipe_r, NULL, h->dst->fd, NULL, allow, SPLICE_F_MOVE | SPLICE_F_NONBLOCK)
        : send(h->dst->fd, h->buf + h->sent, allow, MSG_NOSIGNAL);
    if (n < 0) {
        if (errno == EINTR) return 0;
        if (errno != EAGAIN) return -1;
        h->dst->writable = false; /* until EPOLLOUT */
        return 0;
    }
    if (h->piped) {
        h->piped -= (size_t)n;
    } else {
        h->sent += (size_t)n;
        if (h->sent == h->len) h->sent = h->parsed = h->len = 0;
    }
    account_output(h, (size_t)n, now);
    return n;
}

static void on_src_eof(struct half *h, int64_t now) {
    h->src_eof = true;
    if (h->state == ST_BODY && h->remaining == UNTIL_CLOSE) message_parsed(h, now);
    /* Anything else mid-message is a truncated message: forwarded as it is (pump_half) and
     * logged as not done when the connection closes. */
}

static bool ensure_pipe(struct half *h) {
    if (h->pipe_r >= 0) return true;
    int p[2];
    if (pipe2(p, O_NONBLOCK | O_CLOEXEC) < 0) {
        h->no_splice = true; /* out of fds: this half copies through its buffer instead */
        return false;
    }
    fcntl(p[1], F_SETPIPE_SZ, PIPE_SIZE); /* best effort: a smaller pipe only costs syscalls */
    int cap = fcntl(p[1], F_GETPIPE_SZ);
    h->pipe_r = p[0];
    h->pipe_w = p[1];
    h->pipe_cap = cap > 0 ? (size_t)cap : 65536;
    return true;
}

/* Large bodies skip user space: spliced once the buffer has been forwarded (keeping order). */
static bool should_splice(const struct half *h) {
    if (!cfg.splice || h->no_splice || h->sent != h->len) return false;
    return h->state == ST_RAW || (h->state == ST_BODY && h->remaining >= SPLICE_MIN);
}

static int splice_in(struct half *h, int64_t now) {
    if (!ensure_pipe(h)) return 0;
    if (h->piped >= h->pipe_cap) return 0;
    uint64_t len = h->pipe_cap - h->piped;
    if (h->state == ST_BODY && h->remaining < len) len = h->remaining;
    ssize_t n = splice(h->src->fd, NULL, h->pipe_w, NULL, (size_t)len,
                       SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
    if (n < 0) {
        if (errno == EINTR) return 0;
        if (errno != EAGAIN) return -1;
        /* EAGAIN: the socket is empty, or the pipe's slots are full (partly filled pages);
         * only an empty pipe proves the former. */
        if (h->piped == 0) h->src->readable = false;
        return 0;
    }
    if (n == 0) {
        on_src_eof(h, now);
        return 1;
    }
    h->piped += (size_t)n;
    if (h->state == ST_BODY && h->remaining != UNTIL_CLOSE) {
        h->remaining -= (uint64_t)n;
        if (h->remaining == 0) {
            if (h->chunked) h->state = ST_CHUNK_SIZE;
            else message_parsed(h, now);
        }
    }
    return 1;
}

static int recv_into_buffer(struct half *h, int64_t now) {
    if (h->len == BUF_SIZE && h->sent > 0) { /* make room: drop what has been forwarded */
        memmove(h->buf, h->buf + h->sent, h->len - h->sent);
        h->parsed -= h->sent;
        h->len -= h->sent;
        h->sent = 0;
    }
    if (h->len == BUF_SIZE) {
        if (h->parsed > 0) return 0; /* full of bytes waiting to go out */
        complain("connection %u: HTTP head or chunk line over %d bytes, forwarding it unmodelled",
                 h->conn->id, BUF_SIZE);
        go_raw(h);
        return 1;
    }
    ssize_t n = recv(h->src->fd, h->buf + h->len, BUF_SIZE - h->len, 0);
    if (n < 0) {
        if (errno == EINTR) return 0;
        if (errno != EAGAIN) return -1;
        h->src->readable = false;
        return 0;
    }
    if (n == 0) {
        on_src_eof(h, now);
        return 1;
    }
    h->len += (size_t)n;
    parse_buffered(h, now);
    return 1;
}

static int fill_input(struct half *h, int64_t now) {
    if (h->src_eof || !h->src->readable || h->state == ST_DONE) return 0;
    if (h->src == &h->conn->upstream && h->conn->connecting) return 0;
    return should_splice(h) ? splice_in(h, now) : recv_into_buffer(h, now);
}

/* Moves what it can in one direction. 1 = progress, 0 = nothing to do, -1 = error. */
static int pump_half(struct half *h, int64_t now) {
    int progress = 0;
    for (;;) {
        ssize_t out = flush_output(h, now);
        if (out < 0) return -1;
        if (h->state == ST_DONE && all_sent(h)) {
            message_forwarded(h, now);
            parse_buffered(h, now); /* a pipelined message may be buffered already */
            progress = 1;
            continue;
        }
        if (h->src_eof) {
            if (h->state != ST_DONE) h->parsed = h->len; /* nothing more comes: pass the rest */
            if (all_sent(h) && h->sent == h->len && !h->dst_shut) {
                shutdown(h->dst->fd, SHUT_WR); /* half-close travels on */
                h->dst_shut = true;
                return 1;
            }
            if (out == 0) return progress;
            progress = 1;
            continue;
        }
        int in = fill_input(h, now);
        if (in < 0) return -1;
        if (out == 0 && in == 0) return progress;
        progress = 1;
    }
}

/* ------------------------------------------------------------------------- connections */

static struct conn *graveyard;

static void set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Closes with RST instead of FIN, so an error is not mistaken for the end of a body. */
static void close_with_reset(int fd) {
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
}

static void close_half_pipe(struct half *h) {
    if (h->pipe_r >= 0) {
        close(h->pipe_r);
        close(h->pipe_w);
    }
}

static void conn_close(struct conn *c, bool reset) {
    if (c->dead) return;
    c->dead = true;
    if (c->down.msg) log_request(c, c->down.msg, false); /* response cut short */
    for (struct request *r = c->queue_head; r; r = r->next) log_request(c, r, false);
    if (reset) {
        close_with_reset(c->client.fd);
        close_with_reset(c->upstream.fd);
    } else {
        close(c->client.fd);
        close(c->upstream.fd);
    }
    close_half_pipe(&c->up);
    close_half_pipe(&c->down);
    timer_cancel(c);
    shared_dequeue(c);
    log_line("close conn=%u t=%.6f requests=%u bytes_down=%llu bytes_up=%llu reset=%d\n", c->id,
             since_start(now_ns()), c->requests, c->bytes_down, c->bytes_up, reset ? 1 : 0);
    totals.active--;
    c->dead_next = graveyard;
    graveyard = c;
}

/* Frees connections closed during the last batch of events (which may still name them). */
static void free_graveyard(void) {
    while (graveyard) {
        struct conn *c = graveyard;
        graveyard = c->dead_next;
        if (c->up.msg != c->down.msg) free(c->up.msg); /* may be one request (take_request) */
        free(c->down.msg);
        for (struct request *r = c->queue_head, *next; r; r = next) {
            next = r->next;
            free(r);
        }
        free(c->up.buf);
        free(c->down.buf);
        free(c);
    }
}

static void pump(struct conn *c) {
    if (c->dead) return;
    int64_t now = now_ns();
    if (now < c->ready_at) {
        timer_arm(c, c->ready_at);
        return;
    }
    for (;;) {
        int up = pump_half(&c->up, now);
        int down = up < 0 ? -1 : pump_half(&c->down, now);
        if (up < 0 || down < 0) {
            conn_close(c, true);
            return;
        }
        if (!up && !down) break;
        now = now_ns();
    }
    if (c->up.dst_shut && c->down.dst_shut) conn_close(c, false);
}

static void init_half(struct half *h, struct conn *c, struct endpoint *src, struct endpoint *dst,
                      bool response) {
    h->conn = c;
    h->src = src;
    h->dst = dst;
    h->response = response;
    h->pipe_r = h->pipe_w = -1;
    h->buf = malloc(BUF_SIZE);
    if (!h->buf) die("malloc");
}

static void watch(struct endpoint *e) {
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, .data.ptr = e};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, e->fd, &ev) < 0) die("epoll_ctl");
}

static void conn_open(int client_fd, int64_t now) {
    static unsigned next_id;
    int upstream_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (upstream_fd < 0) {
        complain("socket: %s", strerror(errno));
        close_with_reset(client_fd);
        return;
    }
    set_nodelay(client_fd);
    set_nodelay(upstream_fd);
    int r = connect(upstream_fd, (struct sockaddr *)&upstream_addr, sizeof upstream_addr);
    if (r < 0 && errno != EINPROGRESS) {
        complain("connect to 127.0.0.1:%d: %s", cfg.upstream_port, strerror(errno));
        close(upstream_fd);
        close_with_reset(client_fd);
        return;
    }
    struct conn *c = calloc(1, sizeof *c);
    if (!c) die("calloc");
    c->id = ++next_id;
    c->connecting = r < 0;
    c->client = (struct endpoint){EP_CLIENT, client_fd, false, true, c};
    c->upstream = (struct endpoint){EP_UPSTREAM, upstream_fd, false, !c->connecting, c};
    init_half(&c->up, c, &c->client, &c->upstream, false);
    init_half(&c->down, c, &c->upstream, &c->client, true);
    if (cfg.raw) { /* TLS or HTTP/2 bytes: nothing to parse, so no TTFB; setup and caps hold */
        go_raw(&c->up);
        go_raw(&c->down);
    }
    if (cfg.conn_mibps > 0) bucket_init(&c->bucket, cfg.conn_mibps, 2 * conn_min_send, now);
    c->ready_at = now + setup_ns;
    watch(&c->client);
    watch(&c->upstream);
    totals.opened++;
    totals.active++;
    log_line("open conn=%u t=%.6f\n", c->id, since_start(now));
    if (setup_ns > 0) timer_arm(c, c->ready_at);
}

static void accept_connections(void) {
    for (;;) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN) complain("accept: %s", strerror(errno));
            return;
        }
        conn_open(fd, now_ns());
    }
}

static void on_connection_event(struct endpoint *e, uint32_t events) {
    struct conn *c = e->conn;
    if (c->dead) return;
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) e->readable = true;
    if (events & (EPOLLOUT | EPOLLHUP | EPOLLERR)) e->writable = true;
    if (e == &c->upstream && c->connecting && e->writable) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(e->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            complain("connect to 127.0.0.1:%d: %s", cfg.upstream_port, strerror(err));
            conn_close(c, true);
            return;
        }
        c->connecting = false;
    }
    pump(c);
}

/* Returns false when the proxy should exit. */
static bool on_signal(int sfd) {
    struct signalfd_siginfo si;
    while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (si.ssi_signo == SIGUSR1) {
            report_summary("usr1");
        } else {
            report_summary("exit");
            return false;
        }
    }
    return true;
}

/* ----------------------------------------------------------------------------- startup */

static void usage(void) {
    fputs("usage: linkproxy --upstream PORT [--port N] [--setup-ms MS] [--ttfb-ms MS]\n"
          "                 [--conn-mibps R] [--total-mibps R] [--log FILE] [--no-splice] [--raw]\n",
          stderr);
    exit(2);
}

static double number_arg(const char *name, const char *s) {
    char *end;
    double v = strtod(s ? s : "", &end);
    if (!s || *end || end == s || v < 0 || v != v) {
        complain("%s wants a number >= 0, got '%s'", name, s ? s : "");
        usage();
    }
    return v;
}

static void parse_args(int argc, char **argv) {
    cfg.upstream_port = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) usage();
        if (strcmp(a, "--no-splice") == 0) { cfg.splice = false; continue; }
        if (strcmp(a, "--raw") == 0) { cfg.raw = true; continue; }
        if (strcmp(a, "--log") == 0) { if (!v) usage(); cfg.log_path = v; i++; continue; }
        double x = number_arg(a, v);
        if (strcmp(a, "--upstream") == 0) cfg.upstream_port = (int)x;
        else if (strcmp(a, "--port") == 0) cfg.port = (int)x;
        else if (strcmp(a, "--setup-ms") == 0) cfg.setup_ms = x;
        else if (strcmp(a, "--ttfb-ms") == 0) cfg.ttfb_ms = x;
        else if (strcmp(a, "--conn-mibps") == 0) cfg.conn_mibps = x;
        else if (strcmp(a, "--total-mibps") == 0) cfg.total_mibps = x;
        else usage();
        i++;
    }
    if (cfg.upstream_port <= 0 || cfg.upstream_port > 65535 || cfg.port > 65535) usage();
    if (cfg.raw && cfg.ttfb_ms > 0) {
        complain("--raw forwards no HTTP framing, so it cannot hold responses: --ttfb-ms must be 0");
        usage();
    }
}

static void raise_fd_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max; /* 3 fds per direction per connection with pipes */
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

/* Loopback only: the model must never be reachable from outside the machine. */
static int listen_on_loopback(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) die("socket");
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0) die("bind 127.0.0.1");
    if (listen(fd, 4096) < 0) die("listen");
    return fd;
}

static int watch_signals(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGUSR1);
    sigprocmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN); /* a closed peer is an error return, not a death */
    int fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (fd < 0) die("signalfd");
    return fd;
}

/* Waking the shared queue every 0.5 ms (at least one quantum) serves several connections per
 * wake-up at high rates; a quantum of 0.1 ms worth (4-64 KiB) keeps the turns short. */
static void init_buckets(int64_t now) {
    if (cfg.conn_mibps > 0) conn_min_send = clamp(cfg.conn_mibps * MIB / 1000, 4096, 1e12);
    if (cfg.total_mibps <= 0) return;
    double per_ms = cfg.total_mibps * MIB / 1000;
    shared_quantum = clamp(per_ms / 10, 4096, 65536);
    shared_wake = per_ms / 2 > shared_quantum ? per_ms / 2 : shared_quantum;
    bucket_init(&shared, cfg.total_mibps, 2 * (per_ms > shared_wake ? per_ms : shared_wake), now);
}

static int64_t next_deadline(void) {
    int64_t d = 0;
    for (struct conn *c = timer_head; c; c = c->timer_next)
        if (!d || c->wake_at < d) d = c->wake_at;
    if (shared_queue.head) {
        int64_t s = bucket_ready_at(&shared, shared_wake);
        if (!d || s < d) d = s;
    }
    return d;
}

int main(int argc, char **argv) {
    parse_args(argc, argv);
    t0 = now_ns();
    setup_ns = (int64_t)(cfg.setup_ms * NS_PER_MS);
    ttfb_ns = (int64_t)(cfg.ttfb_ms * NS_PER_MS);
    upstream_addr = (struct sockaddr_in){.sin_family = AF_INET,
                                         .sin_port = htons((uint16_t)cfg.upstream_port),
                                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    raise_fd_limit();
    prctl(PR_SET_TIMERSLACK, 1UL); /* release TTFB holds on time, not up to 50 us late */
    if (cfg.log_path) {
        log_fd = open(cfg.log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (log_fd < 0) die(cfg.log_path);
    }
    init_buckets(t0);

    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0) die("epoll_create1");
    listen_fd = listen_on_loopback(cfg.port);
    struct endpoint listener = {EP_LISTEN, listen_fd, false, false, NULL};
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listener};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, listen_fd, &ev) < 0) die("epoll_ctl");
    struct endpoint signals = {EP_SIGNAL, watch_signals(), false, false, NULL};
    ev.data.ptr = &signals;
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, signals.fd, &ev) < 0) die("epoll_ctl");

    struct sockaddr_in bound;
    socklen_t blen = sizeof bound;
    getsockname(listen_fd, (struct sockaddr *)&bound, &blen);
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    log_line("start pid=%d port=%d upstream=%d setup_ms=%g ttfb_ms=%g conn_mibps=%g "
             "total_mibps=%g splice=%d epoch=%.6f\n",
             (int)getpid(), ntohs(bound.sin_port), cfg.upstream_port, cfg.setup_ms, cfg.ttfb_ms,
             cfg.conn_mibps, cfg.total_mibps, cfg.splice ? 1 : 0,
             (double)wall.tv_sec + wall.tv_nsec / 1e9);
    printf("READY %d\n", ntohs(bound.sin_port));
    fflush(stdout);

    struct epoll_event events[MAX_EVENTS];
    for (;;) {
        int64_t now = now_ns();
        run_timers(now);
        dispatch_shared(now);
        free_graveyard();
        int64_t deadline = next_deadline();
        struct timespec timeout, *tp = NULL;
        if (deadline) {
            int64_t wait = deadline - now_ns();
            if (wait < 0) wait = 0;
            timeout = (struct timespec){wait / 1000000000LL, wait % 1000000000LL};
            tp = &timeout;
        }
        int n = epoll_pwait2(epfd, events, MAX_EVENTS, tp, NULL);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_pwait2");
        }
        for (int i = 0; i < n; i++) {
            struct endpoint *e = events[i].data.ptr;
            if (e->kind == EP_LISTEN) accept_connections();
            else if (e->kind == EP_SIGNAL) { if (!on_signal(e->fd)) return 0; }
            else on_connection_event(e, events[i].events);
        }
        free_graveyard();
    }
}
