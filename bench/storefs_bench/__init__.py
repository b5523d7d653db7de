"""The storefs benchmark behind `bench/run` (bench/README.md explains every row).

Where a number comes from:

    host.py       the machine: logging, cleanup on exit and Ctrl-C, processes by pid, /proc
                  readers (CPU, RSS, bytes written), drop_caches, how busy the machine was
    stats.py      nearest-rank percentile, median
    data.py       the loopback bucket's contents (big.bin + a 10,000-file tree), made once
    servers.py    the servers: fake-gcs-server, the synthetic scale bucket, the WAN link proxy
    systems.py    the filesystems under test: floor, storefs, rclone-off/full; how each is
                  built or found, started, stopped, and sampled (RSS, CPU)
    readers.py    how bytes and names are read through a mount: dd with a stall watchdog,
                  the pread and stat workers, timed shell commands
    workers.py    the child-process loops (pread, stat) readers.py starts
    baselines.py  curl: one stream, N ranged streams, one 4 KiB GET; the local disk
    phases.py     the loopback (and --link) rows measured on each mount
    scale.py      the --scale rows: listing walks of a bucket of millions of objects
    report.py     medians, ratios, verdicts, the tables and the JSON file
    chart.py      --chart: the table as bars (matplotlib), from a run or a saved JSON file
    tls.py        --tls: the run's CA and certificate, nginx between the link's two proxies,
                  what TLS costs, the listing walk over HTTPS
    workloads.py  the workload rows (1,000 small files, mmap by 1 and 4 threads, cached reads
                  after the pages are dropped): data, baselines, phases, request counts
    workload_workers.py   their child-process loops
    workload_report.py    their table, targets, verdicts and JSON rows
    whole_file.py bench/whole-file: files of 512 KiB-8 MiB fetched whole or in parts, for
                  whole_file='s default

`bench/run` only parses arguments, picks the setting and calls these; `bench/whole-file`
calls whole_file.py.
"""

import os

MIB = 1 << 20
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH_DIR)
