import Foundation
import Glibc
import Synchronization

/// The cache's side of the whole-object check (docs/integrity.md): the object's expected
/// CRC32C, combining the blocks' CRC32Cs when the object is complete, the check epochs that
/// readers compare before and after they copy, and the served-wrong epoch of open files.
extension CachedObject {
    /// Stores blocks (as `store(first:_:)`), then, if that made the object complete, checks it
    /// end to end: the blocks' CRC32Cs combined must equal the object's `crc32c`.
    func storeAndCheck(first: Int, _ bytes: UnsafeRawBufferPointer) -> Completion {
        store(first: first, bytes)
        return checkIfComplete()
    }

    /// Tells the object its expected CRC32C (from the metadata of an open); a complete object
    /// found on disk is checked at once. nil: nothing to check against (no `crc32c`).
    func expect(crc32c: UInt32?) -> Completion {
        guard let crc32c else { return .incomplete }
        state.withLock { s in
            if s.expected != crc32c { s.expected = crc32c; s.verified = false }
        }
        return checkIfComplete()
    }

    /// Whether storing the blocks of `ranges` would leave no block missing.
    func wouldComplete(_ ranges: [ClosedRange<Int>]) -> Bool {
        state.withLock { s in
            // Most downloads of a large object are far from completing it: no per-block walk.
            guard ranges.reduce(0, { $0 + $1.count }) >= s.index.count - s.index.present else { return false }
            var missing = Set<Int>()  // the ranges may overlap (a download made again)
            for r in ranges { for b in r where !s.index.isPresent(b) { missing.insert(b) } }
            return s.index.present + missing.count == s.index.count
        }
    }

    var isVerified: Bool { state.withLock { $0.verified } }

    /// Bytes of this object were served before a mismatch showed they may be wrong: every
    /// file open on it until now fails its further reads (the kernel would otherwise retry a
    /// failed page and hide the error), and opens after this drop the kernel's page cache.
    func noteServedWrong() { servedWrong.add(1, ordering: .releasing) }

    /// How many times bytes of this object were found wrong after readers may have had them; a
    /// stream opened before the latest one fails its reads (docs/integrity.md). Read on every
    /// read: an atomic, not the state lock its readers share.
    var servedWrongEpoch: Int { servedWrong.load(ordering: .acquiring) }

    /// An end-to-end check of a completing download (`ObjectIntegrity.landed`) begins:
    /// from now until `endCheck`, bytes read from this file may be that download's, unchecked.
    /// Readers take `checkEpoch` and `isChecking` before they copy and look again after: a read
    /// that overlapped a check waits for it and honours its verdict (docs/integrity.md).
    func beginCheck() {
        checksRunning.add(1, ordering: .sequentiallyConsistent)
        checksBegun.add(1, ordering: .sequentiallyConsistent)
    }

    /// The check is over; called after `noteServedWrong` if it found wrong bytes served, so a
    /// reader that sees it over sees the verdict too.
    func endCheck() { checksRunning.subtract(1, ordering: .sequentiallyConsistent) }

    /// How many checks have begun (read before `isChecking`).
    var checkEpoch: Int { checksBegun.load(ordering: .sequentiallyConsistent) }

    var isChecking: Bool { checksRunning.load(ordering: .sequentiallyConsistent) > 0 }

    /// Whether a known CRC32C still waits to be checked (so completing the object matters).
    var awaitsCheck: Bool { state.withLock { $0.expected != nil && !$0.verified } }

    /// If every block is present and not yet verified: combines and compares (a mismatch drops
    /// every block). The block reader calls it under its object's check lock.
    func checkIfComplete() -> Completion {
        // Another mount may hold the blocks this one misses.
        if cache.shared.isShared { lookForMissingBlocks() }
        // Copied out under the lock, combined outside it (a large object has many blocks).
        let snapshot = state.withLock { s -> (crcs: [UInt32], expected: UInt32)? in
            guard let expected = s.expected, !s.verified, let crcs = s.index.allCRCs() else { return nil }
            return (crcs, expected)
        }
        guard let snapshot else { return state.withLock { $0.verified } ? .verified : .incomplete }
        let combined = Checksum.crc32c(combining: snapshot.crcs, blockLength: format.blockSize,
                                       lastLength: format.blockLength(format.blockCount - 1))
        if combined == snapshot.expected {
            state.withLock { s in if s.expected == snapshot.expected { s.verified = true } }
            return .verified
        }
        Log.warn("op=verify cache_file=\(hex.prefix(12)) crc32c mismatch: blocks combine to \(String(combined, radix: 16)), "
                 + "the object says \(String(snapshot.expected, radix: 16)); dropping every cached block of it")
        cache.unreserve(evictAll())
        return .mismatch(previous: snapshot.crcs)
    }

    /// The CRC32C of each block in `bytes`, which hold whole blocks from `first` (the
    /// object's last block may be short), up to the last block they hold whole: what `store`
    /// and `matchesBeforeStoring` both need, computed once for a download that completes the
    /// object (`ObjectIntegrity.landed`).
    func blockCRCs(first: Int, _ bytes: UnsafeRawBufferPointer) -> [UInt32] {
        let bs = format.blockSize
        var crcs: [UInt32] = []
        crcs.reserveCapacity((bytes.count + bs - 1) / bs)
        var b = first
        while b < format.blockCount, (b - first) * bs < bytes.count {
            let at = (b - first) * bs
            let length = format.blockLength(b)
            guard at + length <= bytes.count else { break }
            crcs.append(Checksum.crc32c(UnsafeRawBufferPointer(rebasing: bytes[at..<(at + length)])))
            b += 1
        }
        return crcs
    }

    /// The end-to-end check of a download that would complete the object, made before its
    /// bytes are stored (docs/integrity.md, "Checked before stored"): every block's CRC32C comes
    /// from the index where the block is present, else from the finished download in `pending`
    /// that holds it (the completing one and those whose cache copy is still being written).
    /// True when they combine to the object's CRC32C; false when they do not; nil when it
    /// cannot tell (a block in neither, no CRC32C to compare with, or already verified). It
    /// marks nothing verified and drops nothing: the cache copies, once made, are checked again
    /// from the index (`checkIfComplete`), and a mismatch here is left to the full check.
    /// `known`: the CRC32Cs of the first pending download's blocks, already computed
    /// (`blockCRCs`), so its bytes are not read twice.
    func matchesBeforeStoring(_ pending: [(first: Int, bytes: UnsafeRawBufferPointer)],
                              known: (first: Int, crcs: [UInt32])? = nil) -> Bool? {
        let snapshot = state.withLock { s -> (crcs: [UInt32], present: [Bool], expected: UInt32)? in
            guard let expected = s.expected, !s.verified else { return nil }
            var crcs = [UInt32](repeating: 0, count: s.index.count)
            var present = [Bool](repeating: false, count: s.index.count)
            s.index.forEachPresent { b, e, _ in
                crcs[b] = e.crc
                present[b] = true
            }
            return (crcs, present, expected)
        }
        guard var snapshot else { return nil }
        let bs = format.blockSize
        if let known {
            for (i, crc) in known.crcs.enumerated() where known.first + i < format.blockCount && !snapshot.present[known.first + i] {
                snapshot.crcs[known.first + i] = crc
                snapshot.present[known.first + i] = true
            }
        }
        for (first, bytes) in pending {
            var b = first
            while b < format.blockCount, (b - first) * bs < bytes.count {
                if !snapshot.present[b] {
                    let at = (b - first) * bs
                    let length = format.blockLength(b)
                    guard at + length <= bytes.count else { return nil }
                    snapshot.crcs[b] = Checksum.crc32c(UnsafeRawBufferPointer(rebasing: bytes[at..<(at + length)]))
                    snapshot.present[b] = true
                }
                b += 1
            }
        }
        guard !snapshot.present.contains(false) else { return nil }
        return Checksum.crc32c(combining: snapshot.crcs, blockLength: bs,
                               lastLength: format.blockLength(format.blockCount - 1)) == snapshot.expected
    }
}
