import Foundation
import StorageClient
import Synchronization

/// Downloads: a flight's bytes fetched, checked as a whole object when they complete it
/// (ObjectIntegrity), handed to its waiters, and copied to the block cache (the map is in
/// BlockReader.swift).
extension BlockReader {
    /// Downloads a flight's bytes, stores them in the cache, then wakes its waiters.
    /// `isCancelled` is the interrupted-check of the reader that made a demand download (nil for
    /// read-ahead); other waiters of a cancelled download make their own. `connection`: one set
    /// aside for the reader's own download (its first request takes it). `downloaded` hears
    /// how the download itself ended (and how long its answer took to start; nil when the bytes
    /// were here already), before anything is stored.
    func execute(_ flight: Flight, _ stream: Stream, isCancelled: (@Sendable () -> Bool)?,
                         after: AfterReply? = nil, connection: ConnectionClaim? = nil,
                         downloaded: ((Result<ReadTiming?, StorageError>) -> Void)? = nil) {
        let meta = stream.meta
        let t0 = now()
        var timing: ReadTiming?
        do throws(StorageError) {
            // A file's first read takes the first bytes its lookup asked for, if they are of
            // this generation; the rest (if any) is downloaded.
            var have = 0
            if isCancelled != nil, flight.start == 0, !firstBytes.isEmpty,
               let first = firstBytes.take(meta.name, generation: meta.generation, size: meta.size, wait: 2, isCancelled: isCancelled) {
                have = min(first.count, flight.length)
                let buffer = flight.beginDownload()
                first.withUnsafeBytes { buffer.baseAddress!.copyMemory(from: $0.baseAddress!, byteCount: have) }
            }
            if have < flight.length {
                // The buffer is taken when the first byte arrives: a part waiting for a far
                // server's answer holds budget, not memory (docs/architecture.md, "Adaptive
                // transfers", Buffers taken at the first byte).
                let from = have
                let target = RangeBuffer(count: flight.length - from) {
                    UnsafeMutableRawBufferPointer(rebasing: flight.beginDownload()[from...])
                }
                // Read-ahead has no reader to interrupt it: it ends at unmount.
                timing = try store.read(meta.name, generation: meta.generation, offset: flight.start + Int64(have), into: target,
                                        isCancelled: isCancelled ?? { [self] in stopping.load(ordering: .relaxed) },
                                        connection: connection)
            }
            downloaded?(.success(timing))
        } catch {
            downloaded?(.failure(error))
            health.note(error)
            flight.probe?.end()
            // A reader was given this error: the kernel asks again for the page at once, and
            // that read gets the same answer rather than all of its tries anew.
            if isCancelled != nil, error.code != .cancelled { stream.flights.noteFailure(flight, error) }
            stream.flights.forget(flight)  // the next reader tries afresh
            flight.finish(.failure(error))
            return
        }
        health.noteSuccess()
        flight.probe?.end()
        // The mount's first download to land says whether the server is near, before its bytes
        // are stored (what is kept in memory depends on it).
        if let timing { transfers.noteFirstByte(timing.firstByte) }
        // Whether it completes the object, and the end-to-end check if it does, before anyone
        // may read its bytes (ObjectIntegrity, docs/integrity.md).
        if let cached = stream.cached {
            let landing = stream.flights.integrity.landed(flight, of: meta, cached: cached, flights: stream.flights,
                                                          partSize: config.partSize) { [store] offset, buffer throws(StorageError) in
                try store.read(meta.name, generation: meta.generation, offset: offset, into: buffer, isCancelled: isCancelled)
            }
            if case .checked = landing { return }
        } else {
            flight.finish(.success(()))
        }
        // Waiters copy from the buffer at once; the disk copy is made afterwards (the buffer
        // lives as long as this call holds the flight). The flight stays registered until a
        // reader has copied its last block, or memory runs short.
        Log.trace("op=fetch object=\(meta.name) offset=\(flight.start) bytes=\(flight.length) get_us=\(Int((now() - t0) * 1e6))")
        if isCancelled != nil {
            // A reader made this download and is waiting to reply: the cache copy is written
            // after that reply, by the same thread when it can wait (a hand-off to another
            // thread costs a wake-up here), else on a prefetch thread.
            // It keeps the cache file open: the reader may close its file before this runs.
            stream.cached?.open()
            let store: @Sendable () -> Void = { [self] in
                self.storeToCache(flight, stream)
                if let c = stream.cached { self.cache?.release(c) }
                self.retireIfIdle(stream)
            }
            if let after { after.add(store) } else { prefetchPool.submit(store) }
        } else if config.cacheWrites == .keepUp, let cached = stream.cached {
            // Read-ahead, keep_up: the writer thread makes the cache copy, and this thread is
            // free for the next download. When the writer is behind, this thread waits for room
            // as long as 2 × `parallel` downloads like this one take (a disk at an eighth of the
            // network's speed still gets every part, the downloads slowed to its pace); after
            // that the part goes uncached. Measured (1 GiB, sleeps added to the cache writes to
            // mimic a 128 MB/s disk): reads at 125 MB/s with `all`, ~540 MB/s with this, 24% cached.
            cached.open()
            let patience = (now() - t0) * Double(2 * max(1, config.parallel))
            let queued = writer.submit(bytes: Int64(flight.length), patience: patience) { [self] in
                self.storeToCache(flight, stream)
                self.cache?.release(cached)
                self.retireIfIdle(stream)
            }
            if !queued {
                cache?.release(cached)
                stream.flights.integrity.stored(flight)  // never cached: nothing to count on
                if flight.markStored() { stream.flights.forget(flight) }
            }
        } else {
            // Read-ahead, all (the default): this thread writes the copy before its next
            // download, so reads go no faster than the disk writes.
            let downloaded = now()
            storeToCache(flight, stream)
            noteSlowCacheWrite(download: downloaded - t0, write: now() - downloaded)
        }
    }

    /// Says once per mount when cache writes, not downloads, set the pace of read-ahead.
    func noteSlowCacheWrite(download: Double, write: Double) {
        guard cache != nil, write > 0.05, write > 2 * download, !slowWritesNoted.exchange(true, ordering: .relaxed) else { return }
        Log.warn("writing read-ahead to the cache took \(Int(write * 1000)) ms against \(Int(download * 1000)) ms to download it: "
                 + "the disk under cache_dir sets the read speed; -o cache_writes=keep_up keeps reads at the network's speed")
    }

    /// Writes the flight's cache copy. A reader's own miss is let go once its bytes are cached
    /// (its reader has them; readers after it take them from the cache). Read-ahead stays
    /// until its reader has copied it to its end, the file is closed by all, or memory runs
    /// short (`dropStored`): the reader then copies from memory, or replies from it, not from
    /// the cache file with a CRC check of every block, a copy and a checksum pass per byte.
    /// Near the server the daemon's CPU sets the pace; far from it too, on a machine that is
    /// busy (docs/architecture.md, "Adaptive transfers": Kept in memory). A reader's window
    /// bounds what it keeps, and parts in flight take memory from kept parts first.
    func storeToCache(_ flight: Flight, _ stream: Stream) {
        if let cached = stream.cached {
            // The disk write outside the object's check lock, the check under it: never beside
            // a completing download's check (which could then find only dropped blocks).
            cached.store(first: flight.firstBlock, UnsafeRawBufferPointer(flight.buffer), ahead: flight.isReadAhead,
                         crcs: flight.blockCRCs)
            stream.flights.integrity.stored(flight)
            if case .mismatch = stream.flights.integrity.checkAfterStoring(cached) {
                // Completed by a write made after its bytes were served (a cache copy written
                // after the reply): nothing of it stays, readers fetch again, and the next read
                // fails once so that a reader of the wrong bytes hears of it.
                stream.flights.forget(flight)
                stream.flights.dropFinished()
                cached.noteServedWrong()
                return
            }
            if !flight.keptUntilRead, cached.cachedBytes(from: flight.start, upTo: flight.end) == flight.length {
                stream.flights.forget(flight)
                return
            }
        }
        // Closed by all meanwhile: nobody will read it (the close let go of finished flights).
        if flight.markStored() || !isOpen(stream) { stream.flights.forget(flight) }
    }
}
