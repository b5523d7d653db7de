import StorageClient
import Synchronization
import Locking

extension BlockReader {
    /// Per-open-file state: the generation's cache entry, its flights and the sequential detector.
    final class Stream: Sendable {
        let meta: ObjectMetadata
        let cached: CachedObject?
        let flights: FlightTable
        /// The sequential streams read through this file (a leaf lock).
        let detector: OrderedMutex<ReadStreams>
        /// The object's `servedWrongEpoch` when this file was opened.
        let openedEpoch: Int
        /// A warm connection set aside for the download of a read that missed, before that
        /// read let read-ahead go: taken by the read's own download on a worker.
        let parkedClaim = OrderedMutex<ConnectionClaim?>(.streamParkedClaim, nil)
        /// The read noted last (offset, count): a miss is asked again on a thread that may wait,
        /// and is noted for read-ahead once.
        private let lastRead = OrderedMutex<(offset: Int64, count: Int)?>(.streamLastRead, nil)

        init(meta: ObjectMetadata, cached: CachedObject?, flights: FlightTable, detector: ReadStreams) {
            self.meta = meta
            self.cached = cached
            self.flights = flights
            self.detector = OrderedMutex(.streamDetector, detector)
            openedEpoch = cached?.servedWrongEpoch ?? 0
        }

        /// Whether this read is not the one noted last (and notes it).
        func isNew(read offset: Int64, count: Int) -> Bool {
            lastRead.withLock { last in
                if let l = last, l.offset == offset, l.count == count { return false }
                last = (offset, count)
                return true
            }
        }

        /// Bytes this open file may have served were found wrong since it was opened.
        var hasServedWrong: Bool { (cached?.servedWrongEpoch ?? 0) != openedEpoch }

        /// The object ever had wrong bytes served: the kernel's page cache of it is not kept.
        var everServedWrong: Bool { openedEpoch != 0 }
    }
}
