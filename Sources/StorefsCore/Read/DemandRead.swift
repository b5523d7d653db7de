import Foundation
import StorageClient
import Synchronization

/// The demand read: what a reader asked for, from the cache, from landed downloads, or
/// downloaded now (the map is in BlockReader.swift).
extension BlockReader {
    /// Serves a read of `dst.count` bytes at `offset`: the one entry point of the read path.
    ///
    /// The read is noted for read-ahead (once, however often it is asked: a miss is asked again
    /// on a thread that may wait). With `Network.never` it is served only from what is here, the
    /// block cache and downloads that have landed, and a miss says so (`.miss`) without touching
    /// the network: safe on a FUSE thread. With `.allowed` missing blocks are downloaded,
    /// sharing downloads already in flight. A read lying wholly inside one landed download is
    /// replied from the download's buffer, borrowed (one copy fewer); any other is copied into
    /// `dst`.
    func read(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
              network: Network) throws(StorageError) -> ReadAnswer {
        if stream.isNew(read: offset, count: dst.count) {
            let parked = parkConnectionIfMissing(stream, at: offset)
            observe(stream, offset: offset, count: dst.count)
            if case .never = network {
                guard let reply = readLanded(stream, at: offset, into: dst) else {
                    return .miss(transfers.isNear ? .brief : .long)
                }
                if parked { stream.parkedClaim.withLock { $0 = nil } }  // landed meanwhile: not needed
                return .reply(reply)
            }
        } else if case .never = network {
            guard let reply = readLanded(stream, at: offset, into: dst) else { return .miss(transfers.isNear ? .brief : .long) }
            return .reply(reply)
        }
        guard case .allowed(let isCancelled) = network else { preconditionFailure("handled above") }
        // This read's own download, if it makes one, goes out on the connection parked for it.
        let claim = stream.parkedClaim.withLock { c -> ConnectionClaim? in
            defer { c = nil }
            return c
        }
        let after = AfterReply()
        do throws(StorageError) {
            let whole = try readChecked(stream, at: offset, into: dst, isCancelled: isCancelled, after: after, connection: claim)
            guard let flight = whole else { return .reply(ReadReply(bytes: UnsafeRawBufferPointer(dst), after: after)) }
            after.hold(flight)
            let at = Int(offset - flight.start)
            return .reply(ReadReply(bytes: UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + dst.count)]),
                                    borrowed: true, after: after))
        } catch {
            // Cache copies of downloads this read made are written all the same, off this
            // thread: the error reply does not wait for them.
            for job in after.takeWork() { prefetchPool.submit(job) }
            throw error
        }
    }

    /// A read served from what has landed, or nil on a miss: never touches the network.
    func readLanded(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer) -> ReadReply? {
        // Taken before anything is copied: while a completing download is checked, the cache
        // may hold its bytes unchecked, and the check may yet find that bytes served were wrong.
        let epoch = stream.cached?.checkEpoch ?? 0
        if stream.hasServedWrong || stream.cached?.isChecking == true { return nil }  // the waiting read decides
        var pos = offset
        let end = offset + Int64(dst.count)
        if let flight = stream.flights.flight(for: Int(pos / Int64(blockSize))), flight.start <= pos, end <= flight.end,
           case .success? = flight.finished {
            // A finished download's buffer never changes (a completing download is checked
            // before it finishes), so what holds for a copy holds here.
            let at = Int(pos - flight.start)
            if end == flight.end, flight.markConsumed() { stream.flights.forget(flight) }
            let after = AfterReply()
            after.hold(flight)
            return ReadReply(bytes: UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + dst.count)]), borrowed: true,
                             after: after)
        }
        while pos < end {
            // A sequential reader usually arrives just after its read-ahead landed: it copies
            // from the download's buffer (no disk read, no second CRC pass).
            if let flight = stream.flights.flight(for: Int(pos / Int64(blockSize))), case .success? = flight.finished {
                pos += copy(from: flight, stream, at: pos, upTo: end, into: dst, dstOffset: offset)
                continue
            }
            guard let cached = stream.cached else { return nil }
            let n = cached.cachedBytes(from: pos, upTo: end)
            guard n > 0, cached.read(at: pos, into: slice(dst, Int(pos - offset), n)) else { return nil }
            pos += Int64(n)
        }
        // A check began while this copied, or found wrong bytes served: the waiting read decides.
        if let cached = stream.cached, cached.checkEpoch != epoch || cached.isChecking || stream.hasServedWrong { return nil }
        return ReadReply(bytes: UnsafeRawBufferPointer(dst))
    }

    /// On a far link a reader that will wait for its own download keeps the warm connection
    /// for it: the read-ahead this read lets go is queued first and would take it, leaving the
    /// reader a new connection's set-up (60 ms through `wan`) before its first byte
    /// (docs/architecture.md, "Adaptive transfers"). Near the server a connection costs
    /// nothing worth the lock.
    func parkConnectionIfMissing(_ stream: Stream, at offset: Int64) -> Bool {
        let block = Int(offset / Int64(blockSize))
        guard transfers.seemsFar, stream.flights.flight(for: block) == nil, stream.cached?.isCached(block) != true,
              let claim = tuning?.claimIdleConnection() else { return false }
        stream.parkedClaim.withLock { $0 = claim }  // one that was parked and not taken goes back
        return true
    }

    func slice(_ dst: UnsafeMutableRawBufferPointer, _ at: Int, _ count: Int) -> UnsafeMutableRawBufferPointer {
        UnsafeMutableRawBufferPointer(rebasing: dst[at..<(at + count)])
    }

    /// Copies what a finished flight holds from `pos` on (up to `end`); returns the bytes copied.
    /// The flight is let go once a reader has copied up to its end and the disk copy is made.
    func copy(from flight: Flight, _ stream: Stream, at pos: Int64, upTo end: Int64,
                      into dst: UnsafeMutableRawBufferPointer, dstOffset: Int64) -> Int64 {
        let flightEnd = flight.end
        let n = Int(min(end, flightEnd) - pos)
        let at = Int(pos - flight.start)
        slice(dst, Int(pos - dstOffset), n).copyMemory(from: UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + n)]))
        if pos + Int64(n) == flightEnd, flight.markConsumed() { stream.flights.forget(flight) }
        return Int64(n)
    }

    /// Lets go of finished read-ahead nobody has read yet whose cache copy is made or skipped
    /// (memory budget pressure): only that frees memory (`FlightTable.dropStored`).
    func dropStored() {
        for shard in flightTables {
            for table in shard.entries.withLock({ $0.values.map(\.table) }) { table.dropStored() }
        }
    }

    /// Serves the read, downloading what is missing, and returns the download that holds the
    /// whole read when the reply may be made from its buffer (nil: the bytes are in `dst`).
    /// No bytes are returned while a check of the object is under way that began before this
    /// read ended: it may find that bytes served earlier (or copied here) were wrong.
    func readChecked(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                             isCancelled: (@Sendable () -> Bool)?, after: AfterReply,
                             connection: ConnectionClaim?) throws(StorageError) -> Flight? {
        while true {
            let epoch = stream.cached?.checkEpoch ?? 0
            let checking = stream.cached?.isChecking ?? false
            if stream.hasServedWrong { throw servedWrongError(stream) }
            var whole: Flight?
            let fromCache = try readOnce(stream, at: offset, into: dst, isCancelled: isCancelled, after: after,
                                         connection: connection, whole: &whole)
            guard let cached = stream.cached else { return whole }
            if checking || cached.isChecking || cached.checkEpoch != epoch {
                guard stream.flights.integrity.waitForCheck(of: cached, isCancelled: isCancelled) else {
                    throw StorageError(.cancelled, "read interrupted")
                }
                if stream.hasServedWrong { throw servedWrongError(stream) }
                // Bytes from the cache may have been the checked download's, stored before its
                // check (and not counted as served): read them again, now checked.
                if fromCache { continue }
            }
            if stream.hasServedWrong { throw servedWrongError(stream) }
            return whole
        }
    }

    func servedWrongError(_ stream: Stream) -> StorageError {
        StorageError(.checksumMismatch,
                     "gs://\(stream.meta.bucket)/\(stream.meta.name): bytes read through this open file did not match its crc32c (open it again)")
    }

    /// One pass of `readChecked`; true if any bytes came from the block cache. A read that lies
    /// wholly inside one successful download is not copied: `whole` is set to it.
    func readOnce(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                          isCancelled: (@Sendable () -> Bool)?, after: AfterReply, connection: ConnectionClaim?,
                          whole: inout Flight?) throws(StorageError) -> Bool {
        var fromCache = false
        var pos = offset
        let end = offset + Int64(dst.count)
        // Where the cache was looked at again after a miss: once per position, so a block that
        // is indexed but cannot be read (its file closed, a failed disk read) is downloaded.
        var lookedAgain: Int64 = -1
        while pos < end {
            if let cached = stream.cached {
                let n = cached.cachedBytes(from: pos, upTo: end)
                if n > 0, cached.read(at: pos, into: slice(dst, Int(pos - offset), n)) {
                    pos += Int64(n)
                    fromCache = true
                    continue
                }
            }
            let block = Int(pos / Int64(blockSize))
            let lastBlock = Int((end - 1) / Int64(blockSize))
            guard let flight = try flightFor(stream, block: block, through: lastBlock, mayFindCached: lookedAgain != pos,
                                             isCancelled: isCancelled) else {
                lookedAgain = pos  // its cache copy was made since the look above: read it from there
                continue
            }
            // Ours to run: a demand download we made, or read-ahead still queued (claimed here
            // rather than waited for behind other files' downloads on the prefetch threads).
            let mine = flight.claim()
            // The reader waits for the link: the read-ahead did not keep ahead of it.
            if flight.finished == nil { transfers.noteReaderWaited() }
            if mine {
                execute(flight, stream, isCancelled: isCancelled ?? { false }, after: after, connection: connection)
            }
            guard let outcome = flight.wait(isCancelled: isCancelled) else {
                throw StorageError(.cancelled, "read interrupted")
            }
            switch outcome {
            case .success:
                if pos == offset, end <= flight.end {
                    // The reply is made from the download's buffer (a worker's copy into the
                    // reply buffer was ~5% of the daemon's CPU with 8 readers on loopback).
                    whole = flight
                    if end == flight.end, flight.markConsumed() { stream.flights.forget(flight) }
                    return fromCache
                }
                pos += copy(from: flight, stream, at: pos, upTo: end, into: dst, dstOffset: offset)
            case .failure(let error):
                // Someone else's download was cancelled: make our own on the next turn.
                if error.code == .cancelled && !mine { continue }
                throw error
            }
        }
        return fromCache
    }

    /// The flight that will bring `block`: an existing one, or a new demand download of the
    /// run of missing blocks from `block` through at most `lastBlock`. Nil (only when
    /// `mayFindCached`) if `block` turned out to be cached: the caller reads it from there.
    func flightFor(_ stream: Stream, block: Int, through lastBlock: Int, mayFindCached: Bool,
                           isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> Flight? {
        let meta = stream.meta
        if let existing = stream.flights.flight(for: block) { return existing }
        if let failed = stream.flights.recentFailure(covering: block) { throw failed }
        // The caller missed the cache before it looked here: a download whose cache copy ended
        // in between has left the table (a flight leaves it only once its bytes are cached or
        // will never be). Looking at the cache after the table closes that gap; misses only.
        func landed() -> Bool { mayFindCached && stream.cached?.isCached(block) == true }
        if landed() { return nil }
        // During an outage one download at a time asks (BucketHealth): it carries the probe.
        let probe = try health.admit()
        var first = block
        var last = block
        var lastBlock = lastBlock
        // The file's first read, its first bytes asked beside its lookup: it takes all of them.
        if block == 0, firstBytes.contains(meta.name) {
            lastBlock = max(lastBlock, Int((min(Int64(FirstBytesTable.length), meta.size) - 1) / Int64(blockSize)))
        }
        // A small file none of which is here yet is fetched whole (`Config.wholeObjectLimit`).
        let whole = isFetchedWhole(stream)
        if whole {
            first = 0
            lastBlock = Int((meta.size - 1) / Int64(blockSize))
        }
        while last < lastBlock, stream.flights.flight(for: last + 1) == nil, !(stream.cached?.isCached(last + 1) ?? false) {
            last += 1
        }
        let start = Int64(first) * Int64(blockSize)
        let length = Int(min(meta.size, Int64(last + 1) * Int64(blockSize)) - start)
        // Finished read-ahead nobody has read yet gives way to a reader once its cache copy is
        // made (with the cache off at once: it could hold the whole budget, even this file's).
        guard budget.acquire(Int64(length), isCancelled: isCancelled, makeRoom: { self.dropStored() }) else {
            throw StorageError(.cancelled, "read interrupted while waiting for memory")
        }
        // Waiting for room, the reader may have let the block's cache copy land.
        if landed() {
            budget.release(Int64(length))
            return nil
        }
        let flight = newFlight(first: first, last: last, start: start, length: length, wholeObject: whole, probe: probe)
        if let raced = stream.flights.register(flight, orExistingFor: block) { return raced }
        return flight
    }

    /// Whether the next miss of this file fetches it whole: it is small (at most
    /// `Config.wholeObjectLimit`), and none of it is cached or coming.
    func isFetchedWhole(_ stream: Stream) -> Bool {
        let size = stream.meta.size
        guard size > 0, size <= config.wholeObjectLimit else { return false }
        let all = 0...Int((size - 1) / Int64(blockSize))
        return !stream.flights.coveredMask(all).contains(true) && !(stream.cached?.cachedMask(all).contains(true) ?? false)
    }
}
