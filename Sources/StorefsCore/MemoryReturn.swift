internal import CProcess
import Glibc
import Foundation
import Synchronization
import Locking

/// Makes memory that a burst of reads took go back to the system afterwards.
///
/// Measured (issue 13): after 16 readers had read 4 GiB, RSS stayed ~110 MiB over a 30 MiB
/// baseline: the FUSE reply buffers (32 × 1 MiB) and the download regions kept by their pools,
/// and free pages glibc's arenas kept. Now pools let their buffers go once idle for a couple of
/// seconds, and a background thread returns free malloc pages (`malloc_trim`): 4–14 MiB over
/// the baseline 5 s later (scripts/stress memory). Fixing glibc's mmap threshold together with
/// an arena cap of 4 was tried too: it cost ~10% of cold sequential throughput and ~40% on
/// `find` (bench/run --quick, A/B). Listing walks of a million objects later showed what the
/// arenas alone keep: `limitArenas` caps them, and nothing else is tuned.
public enum MemoryReturn {
    /// Buffer pools register how to let their idle buffers go (`idle`: seconds unused).
    public static func register(_ release: @escaping @Sendable (_ idle: Double) -> Void) {
        pools.withLock { $0.append(release) }
    }

    private static let pools = OrderedMutex<[@Sendable (Double) -> Void]>(.memoryReturn, [])

    /// Starts the trimming thread (after daemonizing: fork keeps only the calling thread):
    /// every `seconds`, pools unused for that long let their buffers go, then malloc trims.
    public static func startTrimming(every seconds: Double = 2) {
        let thread = Thread {
            while true {
                Thread.sleep(forTimeInterval: seconds)
                for release in pools.withLock({ $0 }) { release(seconds) }
                _ = cprocess_malloc_trim()
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
