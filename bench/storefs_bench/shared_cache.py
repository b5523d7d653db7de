"""The shared-cache row (issue 45; docs/cache.md): a second storefs mount of the same cache dir
reads big.bin after the first one read it.

One phase per storefs system and run, on its own fresh cache dir: the first mount reads big.bin
cold (`dd bs=1M`, after drop_caches) and stays mounted; a second mount, at a second mount point
on the same cache dir, reads it again after drop_caches. The row is the second read's MiB/s;
the extras say what it cost against the cold read: the media requests each daemon made (its own
count, `user.storefs.stats`), the bytes the server sent meanwhile, the cache dir's disk use with
both mounted (one copy, not two), and each daemon's peak RSS. rclone is left out (its docs say
two processes sharing a cache directory corrupt it), and so is the floor (no cache).

Hooked into phases.measure_system (one step) and report.py (ROW, EXTRAS), so that the rows other
work adds to those files merge beside it.
"""

from __future__ import annotations

import json
import os
import shutil

from . import MIB
from .data import BIG
from .host import dir_size_mib, drop_caches, log, proc_wchar
from .readers import seq_read_mibs
from .systems import STOREFS_VARIANTS, Mount

KEY = "second_mount"
ROW = (KEY, "second mount, same cache dir: re-read of big (dd bs=1M)", "MiB/s", True)
EXTRAS = [
    ("second_mount_cold_mibs", "shared cache: the first mount's cold read of big in the same phase", "MiB/s"),
    ("second_mount_first_media_requests", "shared cache: media requests of the first mount (cold read)", ""),
    ("second_mount_media_requests", "shared cache: media requests of the second mount (its read of big)", ""),
    ("second_mount_server_mib_sent", "shared cache: MiB the server sent during the second mount's read", "MiB"),
    ("second_mount_cache_mib", "shared cache: cache dir size with both mounts (big is one copy)", "MiB"),
    ("second_mount_rss_first", "shared cache: the first daemon's peak RSS (VmHWM)", "MiB"),
    ("second_mount_rss_second", "shared cache: the second daemon's peak RSS (VmHWM)", "MiB"),
]


def media_requests(mnt: str) -> int:
    """Media GETs the daemon at `mnt` made so far, by its own count (any status)."""
    stats = json.loads(os.getxattr(mnt, "user.storefs.stats"))
    return sum(int(n) for n in stats["storage"]["requests"].get("media", {}).values())


def second_mount_phase(sr) -> None:
    """First mount reads big cold; a second mount of the same cache dir reads it again."""
    if sr.system not in STOREFS_VARIANTS:
        return
    ctx = sr.ctx
    cache = sr.fresh_cache()
    second_mnt = os.path.join(ctx.workdir, "mnt-second")
    os.makedirs(second_mnt, exist_ok=True)
    try:
        with sr.mount(cache) as first:
            drop_caches()
            cold = seq_read_mibs(sr.big, ctx.size, first.pid)
            sr.put_extra("second_mount_cold_mibs", cold)
            sr.put_extra("second_mount_first_media_requests", media_requests(ctx.mnt))
            with Mount(sr.system, ctx, second_mnt, cache) as second:
                drop_caches()
                w0 = proc_wchar(ctx.server.pid)
                v = seq_read_mibs(os.path.join(second_mnt, BIG), ctx.size, second.pid)
                w1 = proc_wchar(ctx.server.pid)
                sr.put(KEY, v)
                requests = media_requests(second_mnt)
                sr.put_extra("second_mount_media_requests", requests)
                if w0 is not None and w1 is not None:
                    sr.put_extra("second_mount_server_mib_sent", (w1 - w0) / MIB)
                sr.put_extra("second_mount_cache_mib", dir_size_mib(cache))
                sr.put_extra("second_mount_rss_first", first.hwm_mib())
                sr.put_extra("second_mount_rss_second", second.hwm_mib())
                log(f"  {sr.system} second mount of the same cache dir {v:.0f} MiB/s (cold {cold:.0f}), "
                    f"{requests} media request(s), cache dir {dir_size_mib(cache):.0f} MiB")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
