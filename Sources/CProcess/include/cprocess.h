#ifndef STOREFS_CPROCESS_H
#define STOREFS_CPROCESS_H
/* Process-wide settings Swift cannot reach: prctl is variadic, and malloc.h (malloc_trim)
 * is not part of Glibc's Swift module. */

/* No core dumps, no ptrace or /proc/PID/mem by other processes of the same user: the
 * process holds tokens and keys. 0 or -1/errno. */
int cprocess_make_undumpable(void);
/* Returns free malloc pages to the system (malloc_trim). */
int cprocess_malloc_trim(void);
/* Caps glibc's malloc arenas (mallopt M_ARENA_MAX); 1 on success. */
int cprocess_limit_arenas(int arenas);
#endif
