internal import CProcess
import Foundation
import Synchronization

/// Makes memory that a burst of reads took go back to the system afterwards.
///
/// Measured (issue 13): after 16 readers had read 4 GiB, RSS stayed ~110 MiB over a 30 MiB
/// baseline: the FUSE reply buffers (32 × 1 MiB) and the download regions kept by their pools,
/// and free pages glibc's arenas kept. Now pools let their buffers go once idle for a couple of
/// seconds, and a background thread returns free malloc pages (`malloc_trim`): 4–14 MiB over
/// the baseline 5 s later (scripts/stress memory). Capping arenas and fixing glibc's mmap
/// threshold were tried too: they cost ~10% of cold sequential throughput and ~40% on `find`
/// (bench/run --quick, A/B) for no gain once the pools return their buffers.
public enum MemoryReturn {
    /// Buffer pools register how to let their idle buffers go (`idle`: seconds unused).
    public static func register(_ release: @escaping @Sendable (_ idle: Double) -> Void) {
        pools.withLock { $0.append(release) }
    }

    private static let pools = Mutex<[@Sendable (Double) -> Void]>([])

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

    /// No core dumps and no same-user ptrace or /proc/PID/mem: the process holds secrets.
    public static func makeUndumpable() -> Bool { cprocess_make_undumpable() == 0 }
}
