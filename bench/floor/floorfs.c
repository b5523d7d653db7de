/*
 * floorfs: the least a FUSE filesystem can do to serve one object over HTTP. A benchmark
 * baseline, not part of storefs.
 *
 *     floorfs URL SIZE NAME MOUNTPOINT [MANIFEST]
 *
 * Shows one read-only file NAME of SIZE bytes. MANIFEST (bench/run's workload rows) adds more
 * files, one a line `SIZE URL PATH`: PATH is a name in the root, or DIR/NAME in one directory
 * DIR (the same on every line that has one); their sizes come from the manifest, so a listing
 * or lookup costs no request (the floor of what knowing the sizes ahead can save). Every FUSE read becomes exactly one ranged GET
 * of the requested bytes on the calling FUSE thread (one keep-alive libcurl handle per thread),
 * answered with fuse_reply_buf. No cache, no read-ahead of its own, no checks beyond the length.
 * Mount settings match storefs (1 MiB requests: max_readahead and the bdi read_ahead_kb,
 * async reads, multi-threaded loop), so bench/run can put storefs's numbers beside what the
 * same machine gives a filesystem that has no work of its own: the FUSE round trip plus one
 * GET is the floor of a cold random read, and this file's throughput is what FUSE + HTTP give
 * without a block cache (whose writes storefs pays for).
 *
 * FLOORFS_CACHE_DIR, when set, makes it write what it reads as the least a cache of a file per
 * object does (bench/run's "the floor writing a file per file" row): an open makes a file under
 * a temporary name there, each read's bytes are written into it at their offset after the
 * reply (buffered, no sync, no header, index or checksum), and the release closes it and renames
 * it to its final name.
 *
 * Over https (bench/run --tls) two environment variables set what every handle uses:
 * FLOORFS_CA_FILE, a PEM bundle trusted instead of the system store (CURLOPT_CAINFO), and
 * FLOORFS_HTTP_VERSION, 1.1 or 2 (CURLOPT_HTTP_VERSION; libcurl's own default over https is
 * HTTP/2 by ALPN). Unset, libcurl's defaults apply, as before.
 *
 * Built by bench/run with: cc -O2 floorfs.c -o floorfs $(pkg-config --cflags --libs fuse3 libcurl)
 */
/* 312 or later: fuse_session_loop_mt() then takes the fuse_loop_cfg made below (see main). */
#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>
#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#define MAX_REQUEST (1 << 20)
#define BIG_INO 2          /* NAME */
#define DIR_INO 3          /* the manifest's directory, if it has one */
#define FIRST_ENTRY_INO 4  /* the manifest's files, in its order */

static const char *object_url;
static const char *file_name;
static off_t file_size;
static const char *ca_file;   /* FLOORFS_CA_FILE, or NULL */
static long http_version = CURL_HTTP_VERSION_NONE; /* FLOORFS_HTTP_VERSION */
static int cache_dir_fd = -1; /* FLOORFS_CACHE_DIR, or -1 */
static unsigned long cache_files; /* names made so far (atomically) */

/* The manifest's files (read once before mounting, never changed after). */
struct entry {
    char *name;   /* the last component */
    char *url;
    off_t size;
    fuse_ino_t parent;  /* FUSE_ROOT_ID or DIR_INO */
};
static struct entry *entries;
static size_t n_entries;
static char *dir_name;  /* NULL when no line names a directory */

static int load_manifest(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        perror(path);
        return -1;
    }
    char line[8192];
    size_t cap = 0;
    while (fgets(line, sizeof line, f)) {
        long long size;
        char url[4096], rel[2048];
        if (sscanf(line, "%lld %4095s %2047s", &size, url, rel) != 3 || size < 0) {
            fprintf(stderr, "floorfs: %s: a line is not `SIZE URL PATH`: %s", path, line);
            fclose(f);
            return -1;
        }
        if (n_entries == cap) {
            cap = cap ? 2 * cap : 1024;
            entries = realloc(entries, cap * sizeof *entries);
        }
        struct entry *e = &entries[n_entries++];
        e->url = strdup(url);
        e->size = size;
        e->parent = FUSE_ROOT_ID;
        char *slash = strchr(rel, '/');
        if (slash) {
            *slash = 0;
            if (strchr(slash + 1, '/') || (dir_name && strcmp(dir_name, rel) != 0)) {
                fprintf(stderr, "floorfs: %s: one directory level, one directory: %s/%s\n", path, rel, slash + 1);
                fclose(f);
                return -1;
            }
            if (!dir_name) dir_name = strdup(rel);
            e->parent = DIR_INO;
            e->name = strdup(slash + 1);
        } else {
            e->name = strdup(rel);
        }
    }
    fclose(f);
    return 0;
}

static struct entry *entry_of(fuse_ino_t ino) {
    return ino >= FIRST_ENTRY_INO && ino - FIRST_ENTRY_INO < n_entries ? &entries[ino - FIRST_ENTRY_INO] : NULL;
}

static int is_dir(fuse_ino_t ino) {
    return ino == FUSE_ROOT_ID || (ino == DIR_INO && dir_name);
}

struct sink {
    char *buf;
    size_t filled;
    size_t want;
};

static size_t on_body(char *data, size_t size, size_t n, void *opaque) {
    struct sink *s = opaque;
    size_t len = size * n;
    if (s->filled + len > s->want) return 0; /* more than asked for: fail the transfer */
    memcpy(s->buf + s->filled, data, len);
    s->filled += len;
    return len;
}

/* Handles (each keeps its connection open) and buffers are pooled: whichever FUSE thread
 * serves a read reuses an open connection. */
struct slot {
    CURL *curl;
    char *buf;
    struct slot *next;
};
static struct slot *idle_slots;
static pthread_mutex_t slots_lock = PTHREAD_MUTEX_INITIALIZER;

static struct slot *take_slot(void) {
    pthread_mutex_lock(&slots_lock);
    struct slot *t = idle_slots;
    if (t) idle_slots = t->next;
    pthread_mutex_unlock(&slots_lock);
    if (t) return t;
    t = calloc(1, sizeof *t);
    t->curl = curl_easy_init();
    if (ca_file) curl_easy_setopt(t->curl, CURLOPT_CAINFO, ca_file);
    curl_easy_setopt(t->curl, CURLOPT_HTTP_VERSION, http_version);
    t->buf = malloc(MAX_REQUEST);
    return t;
}

static void give_slot(struct slot *t) {
    pthread_mutex_lock(&slots_lock);
    t->next = idle_slots;
    idle_slots = t;
    pthread_mutex_unlock(&slots_lock);
}

static void fill_attr(fuse_ino_t ino, struct stat *st) {
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    if (is_dir(ino)) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
    } else {
        struct entry *e = entry_of(ino);
        st->st_mode = S_IFREG | 0444;
        st->st_nlink = 1;
        st->st_size = e ? e->size : file_size;
    }
}

static void op_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    conn->max_readahead = MAX_REQUEST;
    conn->want |= conn->capable & FUSE_CAP_ASYNC_READ;
}

static fuse_ino_t find(fuse_ino_t parent, const char *name) {
    if (parent == FUSE_ROOT_ID && strcmp(name, file_name) == 0) return BIG_INO;
    if (parent == FUSE_ROOT_ID && dir_name && strcmp(name, dir_name) == 0) return DIR_INO;
    for (size_t i = 0; i < n_entries; i++)
        if (entries[i].parent == parent && strcmp(entries[i].name, name) == 0) return FIRST_ENTRY_INO + i;
    return 0;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    fuse_ino_t ino = find(parent, name);
    if (!ino) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    e.ino = ino;
    e.attr_timeout = e.entry_timeout = 3600;
    fill_attr(ino, &e.attr);
    fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)fi;
    struct stat st;
    fill_attr(ino, &st);
    fuse_reply_attr(req, &st, 3600);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (is_dir(ino)) {
        fuse_reply_err(req, EISDIR);
        return;
    }
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
        fuse_reply_err(req, EROFS);
        return;
    }
    fi->keep_cache = 1;
    fi->fh = 0;
    if (cache_dir_fd >= 0) {
        /* fh: the cache file's descriptor + 1, and its number in the high half. */
        unsigned long n = __atomic_add_fetch(&cache_files, 1, __ATOMIC_RELAXED);
        char temp[64];
        snprintf(temp, sizeof temp, "%lu.tmp", n);
        int fd = openat(cache_dir_fd, temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) {
            fuse_reply_err(req, errno);
            return;
        }
        fi->fh = ((uint64_t)n << 32) | (uint64_t)(fd + 1);
    }
    fuse_reply_open(req, fi);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino;
    if (fi->fh) {
        int fd = (int)(fi->fh & 0xffffffff) - 1;
        unsigned long n = (unsigned long)(fi->fh >> 32);
        char temp[64], final[64];
        snprintf(temp, sizeof temp, "%lu.tmp", n);
        snprintf(final, sizeof final, "%lu", n);
        close(fd);
        renameat(cache_dir_fd, temp, cache_dir_fd, final);
    }
    fuse_reply_err(req, 0);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    struct entry *e = entry_of(ino);
    off_t fsize = e ? e->size : file_size;
    if (off >= fsize) {
        fuse_reply_buf(req, NULL, 0);
        return;
    }
    if (size > MAX_REQUEST) size = MAX_REQUEST;
    if ((off_t)size > fsize - off) size = (size_t)(fsize - off);
    struct slot *t = take_slot();
    struct sink s = {t->buf, 0, size};
    char range[64];
    snprintf(range, sizeof range, "%lld-%lld", (long long)off, (long long)(off + (off_t)size - 1));
    curl_easy_setopt(t->curl, CURLOPT_URL, e ? e->url : object_url);
    curl_easy_setopt(t->curl, CURLOPT_RANGE, range);
    curl_easy_setopt(t->curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(t->curl, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(t->curl, CURLOPT_WRITEDATA, &s);
    CURLcode rc = curl_easy_perform(t->curl);
    long status = 0;
    curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
    if (rc != CURLE_OK || status != 206 || s.filled != size) {
        fuse_reply_err(req, EIO);
    } else {
        fuse_reply_buf(req, t->buf, size);
        if (fi->fh && pwrite((int)(fi->fh & 0xffffffff) - 1, t->buf, size, off) != (ssize_t)size)
            fprintf(stderr, "floorfs: a cache write failed: %s\n", strerror(errno));
    }
    give_slot(t);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)fi;
    if (!is_dir(ino)) {
        fuse_reply_err(req, ENOTDIR);
        return;
    }
    /* The directory's entries in a fixed order: ".", "..", then (root) NAME and the manifest's
     * directory, then the manifest's files whose parent this is. Offset i+1 follows entry i. */
    size_t cap = 4 + n_entries;
    const char **names = malloc(cap * sizeof *names);
    fuse_ino_t *inos = malloc(cap * sizeof *inos);
    size_t n = 0;
#define ADD(NAME, INO) do { names[n] = (NAME); inos[n] = (INO); n++; } while (0)
    ADD(".", ino);
    ADD("..", FUSE_ROOT_ID);
    if (ino == FUSE_ROOT_ID) {
        ADD(file_name, BIG_INO);
        if (dir_name) ADD(dir_name, DIR_INO);
    }
    for (size_t i = 0; i < n_entries; i++)
        if (entries[i].parent == ino) ADD(entries[i].name, FIRST_ENTRY_INO + i);
#undef ADD
    char *buf = malloc(size);
    size_t used = 0;
    for (off_t i = off; i >= 0 && (size_t)i < n; i++) {
        struct stat st;
        fill_attr(inos[i], &st);
        size_t len = fuse_add_direntry(req, buf + used, size - used, names[i], &st, i + 1);
        if (len > size - used) break;
        used += len;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
    free(names);
    free(inos);
}

/* Buffered sequential reads arrive as 1 MiB requests only if the mount's bdi allows it. The
 * device number comes from mountinfo: a stat() of the mount point would wait on this very
 * daemon, whose loop has not started yet. */
static void raise_readahead(const char *mountpoint) {
    FILE *m = fopen("/proc/self/mountinfo", "r");
    if (!m) return;
    char line[4096], dev[64] = "", mnt[4096];
    while (fgets(line, sizeof line, m)) {
        unsigned id, parent;
        char d[64];
        if (sscanf(line, "%u %u %63s %*s %4095s", &id, &parent, d, mnt) == 4 && strcmp(mnt, mountpoint) == 0)
            strcpy(dev, d);
    }
    fclose(m);
    if (!dev[0]) return;
    char path[128];
    snprintf(path, sizeof path, "/sys/class/bdi/%s/read_ahead_kb", dev);
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "%d\n", MAX_REQUEST / 1024);
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "usage: floorfs URL SIZE NAME MOUNTPOINT [MANIFEST]\n");
        return 2;
    }
    if (argc == 6 && load_manifest(argv[5]) != 0) return 2;
    object_url = argv[1];
    file_size = strtoll(argv[2], NULL, 10);
    file_name = argv[3];
    const char *mountpoint = argv[4];
    ca_file = getenv("FLOORFS_CA_FILE");
    const char *hv = getenv("FLOORFS_HTTP_VERSION");
    if (hv && strcmp(hv, "1.1") == 0) http_version = CURL_HTTP_VERSION_1_1;
    else if (hv && strcmp(hv, "2") == 0) http_version = CURL_HTTP_VERSION_2TLS;
    else if (hv && *hv) {
        fprintf(stderr, "floorfs: FLOORFS_HTTP_VERSION must be 1.1 or 2, not '%s'\n", hv);
        return 2;
    }
    const char *cd = getenv("FLOORFS_CACHE_DIR");
    if (cd && *cd) {
        cache_dir_fd = open(cd, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (cache_dir_fd < 0) {
            fprintf(stderr, "floorfs: FLOORFS_CACHE_DIR %s: %s\n", cd, strerror(errno));
            return 2;
        }
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);

    struct fuse_lowlevel_ops ops = {
        .init = op_init,
        .lookup = op_lookup,
        .getattr = op_getattr,
        .open = op_open,
        .read = op_read,
        .release = op_release,
        .readdir = op_readdir,
    };
    char *fargv[] = {argv[0], "-o", "ro,fsname=floorfs,subtype=floorfs,default_permissions", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se) return 1;
    if (fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, mountpoint) != 0) {
        fuse_session_destroy(se);
        return 1;
    }
    raise_readahead(mountpoint);
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(cfg, 16);
    int rc = fuse_session_loop_mt(se, cfg);
    fuse_loop_cfg_destroy(cfg);
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return rc < 0 ? 1 : 0;
}
