import Foundation
import StorageClient
import Synchronization

/// Read-ahead: what a sequential reader will want next, downloaded before it asks
/// (docs/architecture.md, "Adaptive transfers"; the map is in BlockReader.swift).
extension BlockReader {
    func observe(_ stream: Stream, offset: Int64, count: Int) {
        // A small file's first miss fetches it whole: nothing to read ahead.
        if stream.meta.size <= config.wholeObjectLimit { return }
        // A reader's window covers its share of the parts that may run at once, and a little
        // more: alone, all of them; beside other readers that want read-ahead, an equal share
        // (the gate shares the slots so, `PartQueue`), so that N readers together hold about
        // the parts in flight plus two each, not N times all of them.
        // Each sequential stream in the file is a reader of its own (`ReadStreams`).
        let id = stream.detector.withLock { $0.stream(for: offset, count: count) }
        let reader = ReaderID(file: ObjectIdentifier(stream), stream: id)
        let (parts, part, near, readers, nextParts) = transfers.current(for: reader)
        let share = config.adaptive ? max(1, parts / readers) : parts
        let limit = config.adaptive ? Int64(share + 2) * part : config.readAhead
        let observed = stream.detector.withLock { d in
            d.with(id) { p in
                (p.observe(offset: offset, count: count, size: stream.meta.size, limit: limit, granularity: part), p.hasEvidence,
                 stream.cached == nil ? nil : p.warm(reach: Self.warmReach, size: stream.meta.size))
            }
        }
        guard let (ahead, isStream, warm) = observed else { return }
        if let warm { self.warm(stream, warm) }
        guard let ahead else { return }
        // During an outage nothing is read ahead: one operation at a time asks (BucketHealth),
        // and that is a reader's. The window is tried again on the next read.
        if health.outage != nil {
            stream.detector.withLock { _ = $0.with(id) { $0.unscheduled(from: ahead.lowerBound) } }
            return
        }
        // Only for a stream (a short read's first window needs no more connections) with bytes
        // to download (a cached file read on a far mount needs none).
        if config.adaptive, !near, isStream, transfers.seemsFar,
           Int64(stream.cached?.cachedBytes(from: ahead.lowerBound, upTo: ahead.upperBound) ?? 0) < Int64(ahead.count) {
            openConnectionsAhead(stream, from: ahead.lowerBound, parts: nextParts, part: part)
        }
        if let stopped = schedule(stream, ahead, for: reader) {
            // Out of memory budget: the rest of the window is tried again on the next read.
            stream.detector.withLock { _ = $0.with(id) { $0.unscheduled(from: stopped) } }
        }
    }

    /// On a far link a new connection's set-up (TCP and TLS: a round trip or more each) is
    /// paid before a part needs it: once a reader reads on, connections are opened up to the
    /// parts that may run at once after the count's next step up (no more than the rest of the
    /// file needs), each with a one-byte request, while the reader's window is still small
    /// (docs/architecture.md, "Adaptive transfers"). Open connections stay in the pool for
    /// every file after.
    func openConnectionsAhead(_ stream: Stream, from offset: Int64, parts: Int, part: Int64) {
        let want = Int(min(Int64(parts), (stream.meta.size - offset + part - 1) / max(1, part)))
        guard want >= 2, let tuning, let have = tuning.connectionCount else { return }
        let missing = connectionsQueued.withLock { queued -> Int in
            let missing = want - have - queued
            if missing > 0 { queued += missing }
            return missing
        }
        guard missing > 0 else { return }
        let meta = stream.meta
        for _ in 0..<missing {
            pools.connect.submit { [self] in
                connectionsQueued.withLock { $0 -= 1 }  // from here on `connectionCount` has it
                tuning.openConnection(forReading: meta.name, generation: meta.generation)
            }
        }
    }

    /// How far ahead of a sequential reader its cached blocks are asked from the cache file.
    static let warmReach: Int64 = 4 << 20

    /// Has the kernel read the cached blocks in `range` that no download holds in memory from
    /// the cache file, on a prefetch thread (`Prefetcher.warm`): a sequential reader of cached
    /// bytes then finds them in the page cache. Blocks still in memory are read from there.
    func warm(_ stream: Stream, _ range: Range<Int64>) {
        guard let c = stream.cached else { return }
        let first = Int(range.lowerBound / Int64(blockSize))
        let last = Int((range.upperBound - 1) / Int64(blockSize))
        let cachedMask = c.cachedMask(first...last)
        let comingMask = stream.flights.coveredMask(first...last)
        var b = first
        while b <= last {
            guard cachedMask[b - first], !comingMask[b - first] else {
                b += 1
                continue
            }
            var end = b
            while end < last, cachedMask[end + 1 - first], !comingMask[end + 1 - first] { end += 1 }
            let blocks = b...end
            c.open()
            prefetchPool.submit { [self] in
                c.willNeed(blocks: blocks)
                self.cache?.release(c)
            }
            b = end + 1
        }
    }

    /// Schedules read-ahead downloads for the bytes in `range`, in parts, skipping blocks that
    /// are cached or already coming; stops where the memory budget is used up and returns where
    /// it stopped (nil when all of it is scheduled). Called on FUSE threads by many readers at
    /// once: it looks at the cache index and the flight table once each, not once per block.
    func schedule(_ stream: Stream, _ range: Range<Int64>, for reader: ReaderID) -> Int64? {
        let meta = stream.meta
        let first = Int(range.lowerBound / Int64(blockSize))
        let last = Int((range.upperBound - 1) / Int64(blockSize))
        let perPart = max(1, Int(transfers.partSize / Int64(blockSize)))
        // The flight table first, then the cache: a flight leaves the table only once its bytes
        // are cached (or will never be), so a block found in neither is really missing. The
        // other order could miss a part whose cache copy ended in between and fetch it again.
        let comingMask = stream.flights.coveredMask(first...last)
        let cachedMask = stream.cached?.cachedMask(first...last) ?? [Bool](repeating: false, count: last - first + 1)
        func taken(_ b: Int) -> Bool { cachedMask[b - first] || comingMask[b - first] }
        var b = first
        while b <= last {
            if taken(b) {
                b += 1
                continue
            }
            var end = b
            while end < last, end - b + 1 < perPart, !taken(end + 1) { end += 1 }
            let start = Int64(b) * Int64(blockSize)
            let length = Int(min(meta.size, Int64(end + 1) * Int64(blockSize)) - start)
            if !budget.tryAcquire(Int64(length)) {
                dropStored()
                guard budget.tryAcquire(Int64(length)) else { return start }
            }
            let flight = newFlight(first: b, last: end, start: start, length: length, readAhead: true)
            if stream.flights.registerIfFree(flight) {
                // Read-ahead outlives the read that asked for it: keep the cache file open.
                stream.cached?.open()
                transfers.enqueue(for: reader, on: prefetchPool) { [self] in
                    let t0 = now()
                    if flight.claim() {
                        // The slot is given back once the bytes are here, before the cache copy:
                        // the next part's download may start while this thread writes, and a
                        // part's measured time is the link's alone (its cache write counted too).
                        self.execute(flight, stream, isCancelled: nil) { outcome in
                            switch outcome {
                            case .success(let timing):
                                self.transfers.release(for: reader, bytes: Int64(flight.length), seconds: now() - t0,
                                                       firstByte: timing?.firstByte ?? 0)
                            case .failure(let e):
                                self.transfers.release(for: reader, bytes: 0, seconds: 0, firstByte: 0, failed: true,
                                                       refused: e.code == .quotaExceeded || e.httpStatus == 503)
                            }
                        }
                    } else {
                        // A reader took it over while it waited for a slot.
                        self.transfers.release(for: reader, bytes: 0, seconds: 0, firstByte: 0, failed: true)
                    }
                    if let c = stream.cached { self.cache?.release(c) }
                    self.retireIfIdle(stream)
                }
            }
            b = end + 1
        }
        return nil
    }
}
