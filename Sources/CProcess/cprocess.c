#define _GNU_SOURCE
#include "cprocess.h"
#include <malloc.h>
#include <sys/xattr.h>
#include <fcntl.h>
#include <sys/prctl.h>

int cprocess_make_undumpable(void) { return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); }

int cprocess_malloc_trim(void) { return malloc_trim(0); }

int cprocess_limit_arenas(int arenas) { return mallopt(M_ARENA_MAX, arenas); }

long cprocess_getxattr(const char *path, const char *name, void *value, unsigned long size) {
    return (long)getxattr(path, name, value, (size_t)size);
}

long cprocess_fgetxattr(int fd, const char *name, void *value, unsigned long size) {
    return (long)fgetxattr(fd, name, value, (size_t)size);
}

long cprocess_lgetxattr(const char *path, const char *name, void *value, unsigned long size) {
    return (long)lgetxattr(path, name, value, (size_t)size);
}

int cprocess_o_direct(void) { return O_DIRECT; }

int cprocess_o_path(void) { return O_PATH; }
