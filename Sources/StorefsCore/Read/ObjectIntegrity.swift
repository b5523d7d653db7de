import Foundation
import StorageClient
import Synchronization
import Locking

/// The end-to-end check of one object generation's cached copy (docs/integrity.md): the one
/// place that decides which download completes the object and checks it against the object's
/// crc32c. Its rules:
///
/// 1. Every cached block carries its CRC32C and is checked before it is served (`CachedObject`).
/// 2. Every ranged answer is checked for its position and length (`HTTPClient`).
/// 3. When a download makes the object complete in the cache, the blocks' CRC32Cs combined
///    must equal the object's crc32c, **before that download's bytes are served**:
///    - match: the object is verified;
///    - mismatch: every cached block is dropped, finished downloads of the object are let go,
///      the whole object is fetched again and the completing read is served from the second
///      download; a second mismatch, or a block outside the completing download found wrong
///      (readers may have had it), fails the read with EIO (`checksumMismatch`), and open files
///      of the object fail their further reads (`CachedObject.noteServedWrong`).
/// 4. Which download completes the object is decided one download at a time (`decision`):
///    a download that does not complete it is finished and listed as unstored under the same
///    lock, so two downloads can never each leave the completion to the other's cache copy,
///    made after its bytes were served. The completing one is first checked from memory (its
///    bytes, the unstored downloads' and the index's CRC32Cs, `matchesBeforeStoring`): on a
///    match it is answered at once and its copy is written like any other; otherwise the full
///    check stores every unstored download and itself, and combines the index.
/// 5. While a full check runs (`CachedObject.beginCheck`/`endCheck`), readers that overlapped it
///    wait for its verdict before replying (`BlockReader.readChecked`).
/// 6. A cache copy that completes the object (written after its bytes were served) is checked
///    too, under the same lock: a mismatch drops the object, and its next read fails once so
///    that whoever read the wrong bytes hears of it.
///
/// What no checksum covers (a flipped bit in a range of an object never read whole, a shifted
/// 206 body) is docs/integrity.md's "What no checksum covers".
final class ObjectIntegrity: Sendable {
    /// Taken to decide which download completes the object, while a completing download is
    /// checked, and for the check after a cache copy (rule 4). Lock order: first among the
    /// read path's locks; `CachedObject`'s and the block cache's are taken under it (the full
    /// check writes to the cache). It is held across network I/O in one case only: after a
    /// mismatch, while the object is fetched again (`refetched`), so that no other download of
    /// the object, whose bytes may be as wrong, completes it meanwhile. A correct server never
    /// causes a mismatch; this costs the object's other downloads a wait, never a wrong byte
    /// (docs/architecture.md, "Threads and locks").
    private let decision = OrderedLock(.integrityDecision)
    /// Downloads that finished without completing their object, until their cache copy is made
    /// (rule 4). A leaf lock.
    private let unstored = OrderedMutex<[Flight]>(.integrityUnstored, [])
    /// Signalled when a full check ends (rule 5): readers that overlapped it wait on it. Taken
    /// under `decision` by the check, alone by readers; nothing is taken under it.
    private let checkEnded = OrderedCondition(.integrityCheckEnded)

    /// What deciding on a landed download did.
    enum Landing {
        /// The download is finished and may be read; its cache copy is the caller's to make.
        case finished
        /// It completed the object and was checked end to end and stored here: finished, with
        /// the check's verdict.
        case checked
    }

    /// Downloads the object's bytes `[offset, offset + buffer.count)` again (after a mismatch).
    typealias Refetch = (_ offset: Int64, _ buffer: UnsafeMutableRawBufferPointer) throws(StorageError) -> Void

    /// No download waits for its cache copy here.
    var isEmpty: Bool { unstored.withLock { $0.isEmpty } }

    /// A download of the object landed (its bytes in `flight`, not finished yet): decides
    /// whether it completes the object and, if it does, checks the object before anyone may
    /// read its bytes (rules 3 and 4). `flights` is the object's flight table (finished flights
    /// go when the object is found wrong).
    func landed(_ flight: Flight, of meta: ObjectMetadata, cached: CachedObject, flights: FlightTable,
                partSize: Int64, refetch: Refetch) -> Landing {
        decision.lock()
        defer { decision.unlock() }
        guard cached.awaitsCheck else {
            flight.finish(.success(()))
            return .finished
        }
        let others = unstored.withLock { $0.filter { $0 !== flight } }
        guard cached.wouldComplete([flight.firstBlock...flight.lastBlock] + others.map { $0.firstBlock...$0.lastBlock }) else {
            flight.finish(.success(()))
            unstored.withLock { $0.append(flight) }
            return .finished
        }
        // Checked from memory first: the CRC32Cs of its bytes and of the others' with the
        // index's. When they match it finishes and is stored like any download, after its
        // readers have it, and the others' copies are left to their own threads: no reader
        // waits for a disk write. The index is checked again once the copies are made.
        let own = cached.blockCRCs(first: flight.firstBlock, UnsafeRawBufferPointer(flight.buffer))
        let pending = others.map { (first: $0.firstBlock, bytes: UnsafeRawBufferPointer($0.buffer)) }
        if cached.matchesBeforeStoring(pending, known: (flight.firstBlock, own)) == true {
            // Its cache copy records these (`storeToCache`). Only here: the full check below
            // may overwrite the flight's bytes with a second download's.
            flight.blockCRCs = own
            flight.finish(.success(()))
            unstored.withLock { $0.append(flight) }
            return .finished
        }
        cached.beginCheck()
        for other in others { cached.store(first: other.firstBlock, UnsafeRawBufferPointer(other.buffer)) }
        let outcome = completeAndCheck(flight, meta, cached, flights: flights, partSize: partSize, refetch: refetch)
        checkEnded.lock()
        cached.endCheck()
        checkEnded.broadcast()
        checkEnded.unlock()
        if case .failure = outcome { flights.forget(flight) }
        flight.finish(outcome)
        if case .success = outcome, cached.cachedBytes(from: flight.start, upTo: flight.end) == flight.length {
            flights.forget(flight)  // readers take the bytes from the cache
        } else if flight.markStored() {
            flights.forget(flight)  // its cache copy is made: memory may let it go
        }
        return .checked
    }

    /// Waits while a full check of the object runs (rule 5); false if `isCancelled` said so
    /// first (asked every 50 ms: an interrupt wakes nothing here).
    func waitForCheck(of cached: CachedObject, isCancelled: (@Sendable () -> Bool)?) -> Bool {
        checkEnded.lock()
        defer { checkEnded.unlock() }
        while cached.isChecking {
            if let isCancelled, isCancelled() { return false }
            _ = checkEnded.wait(until: Date().addingTimeInterval(0.05))
        }
        return true
    }

    /// `flight`'s cache copy was made (or will never be): it no longer counts as unstored.
    func stored(_ flight: Flight) { unstored.withLock { $0.removeAll { $0 === flight } } }

    /// A cache copy was just written: checks the object if that completed it (rule 6).
    /// Written outside the decision, checked under it: never beside a completing download's
    /// check, which could then find only dropped blocks.
    func checkAfterStoring(_ cached: CachedObject) -> CachedObject.Completion {
        decision.lock()
        defer { decision.unlock() }
        return cached.checkIfComplete()
    }

    /// Stores a download that completes the object and checks the object end to end. On a
    /// mismatch every cached block is dropped, finished downloads of the object are let go (they
    /// may hold the bad bytes) and the whole object is fetched again; the flight then holds the
    /// bytes of that second download. It fails (EIO) when the second download does not match
    /// either, and when it shows that a block outside this flight, which readers may already
    /// have been given, was wrong: never silently wrong bytes.
    private func completeAndCheck(_ flight: Flight, _ meta: ObjectMetadata, _ cached: CachedObject, flights: FlightTable,
                                  partSize: Int64, refetch: Refetch) -> Result<Void, StorageError> {
        guard case .mismatch(let previous) = cached.storeAndCheck(first: flight.firstBlock, UnsafeRawBufferPointer(flight.buffer)) else {
            return .success(())
        }
        flights.dropFinished()
        let blockSize = cached.format.blockSize
        let part = max(partSize, Int64(blockSize))
        let scratch = UnsafeMutableRawBufferPointer.allocate(byteCount: Int(min(part, meta.size)), alignment: 4096)
        defer { scratch.deallocate() }
        var last = CachedObject.Completion.incomplete
        var servedWrong: [Int] = []
        var notedWrong = false
        var offset: Int64 = 0
        while offset < meta.size {
            let length = Int(min(part, meta.size - offset))
            let window = UnsafeMutableRawBufferPointer(rebasing: scratch[0..<length])
            do throws(StorageError) {
                try refetch(offset, window)
            } catch {
                // The object did not match and nothing tells which bytes served were right.
                cached.noteServedWrong()
                return .failure(error)
            }
            // Which blocks differ from what was cached (and so perhaps served) before?
            let firstBlock = Int(offset / Int64(blockSize))
            var at = 0
            while at < length {
                let n = min(blockSize, length - at)
                let b = firstBlock + at / blockSize
                let crc = Checksum.crc32c(UnsafeRawBufferPointer(rebasing: window[at..<(at + n)]))
                if b < previous.count, crc != previous[b], !(flight.firstBlock...flight.lastBlock).contains(b) { servedWrong.append(b) }
                at += n
            }
            // Open files learn it before the right bytes are cached: a reader that finds them
            // there (the FUSE thread's cache hits) must not finish a read of which earlier
            // parts were wrong.
            if !servedWrong.isEmpty && !notedWrong {
                cached.noteServedWrong()
                notedWrong = true
            }
            // The flight's own bytes come from this download now.
            let from = max(offset, flight.start), to = min(offset + Int64(length), flight.end)
            if from < to {
                UnsafeMutableRawBufferPointer(rebasing: flight.buffer[Int(from - flight.start)..<Int(to - flight.start)])
                    .copyMemory(from: UnsafeRawBufferPointer(rebasing: window[Int(from - offset)..<Int(to - offset)]))
            }
            last = cached.storeAndCheck(first: firstBlock, UnsafeRawBufferPointer(window))
            offset += Int64(length)
        }
        let object = "gs://\(meta.bucket)/\(meta.name) generation \(meta.generation)"
        if case .mismatch = last {
            // Nothing can tell which earlier bytes were right: every open file of it fails on.
            cached.noteServedWrong()
            return .failure(StorageError(.checksumMismatch, "\(object) does not match its crc32c, downloaded twice"))
        }
        if !servedWrong.isEmpty {
            Log.error("op=verify object=\(meta.name) gen=\(meta.generation) crc32c mismatch: \(servedWrong.count) block(s) from offset \(Int64(servedWrong[0]) * Int64(blockSize)) were wrong when first downloaded and may have been read; this read fails so the reader knows, the object is now cached right")
            return .failure(StorageError(.checksumMismatch, "\(object): bytes read earlier did not match its crc32c"))
        }
        Log.info("op=verify object=\(meta.name) gen=\(meta.generation) fetched again after a crc32c mismatch: \(last == .verified ? "now matches" : "could not be checked again (cache full)")")
        return .success(())
    }
}
