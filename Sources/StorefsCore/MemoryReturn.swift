internal import CProcess
import Glibc
import Foundation
import Synchronization
import Locking

/// Makes memory that a burst of reads took go back to the system afterwards.
///
/// Measured (issue 13): after 16 readers had read 4 GiB, RSS stayed ~110 MiB over a 30 MiB
/// baseline: the FUSE reply buffers (32 × 1 MiB) and the download regions kept by their pools,
/// and free pages glibc's arenas kept. Now pools let their buffers go once idle, and a
/// background thread returns free malloc pages (`malloc_trim`). Fixing glibc's mmap threshold
/// together with an arena cap of 4 was tried too: it cost ~10% of cold sequential throughput
/// and ~40% on `find` (bench/run --quick, A/B). Listing walks of a million objects later
/// showed what the arenas alone keep: `limitArenas` caps them, and nothing else is tuned.
///
/// When (issue 49, item 10): pools idle for 2 s were let go on a 2 s tick, so 2–4 s after
/// their last use, and that use comes up to a second after the readers stop (the last replies,
/// cache copies of the last parts). Measured 5 s after a load, RSS was back (40 MiB) or not yet
/// (204) by the tick's phase alone; nothing else held it. Now the tick is 0.25 s and a pool
/// idle for 0.5 s lets go: 0.5–0.75 s after its last use, and malloc trims right after (and
/// every 2 s as before, for what the metadata path frees). A load that pauses longer maps its
/// regions again, at a page fault per 4 KiB touched (2 MiB pages where THP allows), which
/// such a pause dwarfs.
public enum MemoryReturn {
    /// Buffer pools register how to let their idle buffers go (`idle`: seconds unused); the
    /// closure says whether it let any go.
    public static func register(_ release: @escaping @Sendable (_ idle: Double) -> Bool) {
        pools.withLock { $0.append(release) }
    }

    private static let pools = OrderedMutex<[@Sendable (Double) -> Bool]>(.memoryReturn, [])

    /// Seconds without use after which a pool lets its buffers go.
    public static let idleSeconds = 0.5

    /// Starts the trimming thread (after daemonizing: fork keeps only the calling thread):
    /// every `seconds`, pools unused for `idleSeconds` let their buffers go; malloc trims
    /// after a pool did, and every `trimEvery` ticks.
    public static func startTrimming(every seconds: Double = 0.25, trimEvery: Int = 8) {
        let thread = Thread {
            var tick = 0
            while true {
                Thread.sleep(forTimeInterval: seconds)
                tick += 1
                var released = false
                for release in pools.withLock({ $0 }) where release(idleSeconds) { released = true }
                if released || tick % trimEvery == 0 { _ = cprocess_malloc_trim() }
            }
        }
        thread.name = "storefs-trim"
        thread.start()
    }

    /// One malloc arena per CPU instead of glibc's eight (docs/architecture.md, "Metadata
    /// memory"): listing bursts on 64 metadata and 4 listing threads left each thread's arena
    /// holding freed pages, so RSS after `find` over 1.1M objects stayed at 262–302 MiB and
    /// grew walk after walk (274 → 367 → 379); with 2 arenas on 2 CPUs, 216–217 and
    /// 215 → 258 → 257, with the same times (bench/run --scale, idle machine), and loopback
    /// reads were not slower (bench/run --quick). An earlier A/B that also fixed glibc's mmap
    /// threshold cost throughput: only the arena count is set. `MALLOC_ARENA_MAX` in the
    /// environment wins. Call before any thread starts.
    public static func limitArenas() {
        guard getenv("MALLOC_ARENA_MAX") == nil else { return }
        _ = cprocess_limit_arenas(Int32(max(2, sysconf(Int32(_SC_NPROCESSORS_ONLN)))))
    }

    /// No core dumps and no same-user ptrace or /proc/PID/mem: the process holds secrets.
    public static func makeUndumpable() -> Bool { cprocess_make_undumpable() == 0 }
}
