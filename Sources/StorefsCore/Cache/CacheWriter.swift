import Locking
import Foundation
import Synchronization

/// What to do with read-ahead the cache disk cannot keep up with (`cache_writes=`).
public enum CacheWrites: String, Sendable {
    /// Cache every byte (the default): each prefetch thread writes its part before its next
    /// download, so reads slow down to the disk's write speed.
    case all
    /// Write through the `CacheWriter` and serve what it cannot keep up with uncached, so
    /// reads keep the network's speed.
    case keepUp = "keep_up"
}

/// With `cache_writes=keep_up`, writes downloaded read-ahead into the block cache on a thread of
/// its own, so downloads never wait long for the disk.
///
/// When the prefetch threads write their own parts (`cache_writes=all`), a cold read goes
/// exactly as fast as the cache disk writes (128 MB/s of cache writes gave 126 MB/s of
/// reading). Here the writes queue up to `maxBacklog` bytes (the parts wait in memory, charged
/// to the memory budget). A download that finds the queue full waits for room for as long as
/// its caller allows, then its part goes uncached instead of making reads slow. A warning says
/// so once per mount; what was not cached is fetched again on its next read.
final class CacheWriter: @unchecked Sendable {
    let maxBacklog: Int64
    private var backlog: Int64 = 0
    private let room = OrderedCondition(.cacheWriterRoom)
    /// The one thread that writes (`WorkerPools.cacheWrites`).
    private let thread: WorkerPool
    private let skippedBytes = Atomic<Int64>(0)
    private let queuedBytes = Atomic<Int64>(0)
    private let warned = Atomic<Bool>(false)

    /// `pool`: its thread (one); by default one of its own (tests).
    init(maxBacklog: Int64, pool: WorkerPool = WorkerPool(threads: 1, name: "storefs-cachewrite")) {
        self.maxBacklog = maxBacklog
        self.thread = pool
    }

    /// Queues `job`, a cache write of `bytes`, waiting at most `patience` seconds for room;
    /// false (and nothing queued) if there was none. An empty queue takes any job, however large.
    func submit(bytes: Int64, patience: Double, _ job: @escaping @Sendable () -> Void) -> Bool {
        let deadline = Date().addingTimeInterval(patience)
        room.lock()
        var taken = true
        while backlog > 0 && backlog + bytes > maxBacklog {
            if !room.wait(until: deadline) {
                taken = backlog == 0 || backlog + bytes <= maxBacklog
                break
            }
        }
        if taken { backlog += bytes }
        room.unlock()
        guard taken else {
            skippedBytes.add(bytes, ordering: .relaxed)
            if !warned.exchange(true, ordering: .relaxed) {
                Log.warn("cache writes fall behind the downloads (the disk under cache_dir is slower than the network): "
                         + "some read-ahead is served without being cached")
            }
            return false
        }
        queuedBytes.add(bytes, ordering: .relaxed)
        thread.submit { [self] in
            job()
            room.lock()
            backlog -= bytes
            room.broadcast()
            room.unlock()
        }
        return true
    }

    /// Bytes of read-ahead left uncached because the backlog was full.
    var skipped: Int64 { skippedBytes.load(ordering: .relaxed) }
    /// Bytes of cache writes queued so far.
    var queued: Int64 { queuedBytes.load(ordering: .relaxed) }

    /// Waits until every queued write is done, at most `timeout` seconds; false on time-out.
    func drain(timeout: Double) -> Bool {
        thread.drain(timeout: timeout)
    }
}
